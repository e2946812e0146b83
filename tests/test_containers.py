"""The container images and the three-tier grid in containers (testcontainers + the docker SDK).

- the images are built from nothing but Dockerfiles and locally made base images
  (docker/build-images.sh: debootstrap + docker import, a host wheelhouse, no registry, no network
  in the builds), run as a non-root user and carry HEALTHCHECKs;
- a grid on a private network (router, embed server, three FFN shards with layers 9-17 replicated,
  nginx edge cache) answers the golden prompt through the client container with the same tokens as
  the local forward pass;
- killing the FFN shard that is serving a replicated range in the middle of a generation: the
  generation completes, with the same tokens;
- stopping the embed container: the edge cache still serves the rows it has cached;
- `docker compose up grid` (up, healthy, one prediction, down).

Skipped when no Docker engine is reachable, except under CI (env CI set), where that fails.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests import _docker as dk

# The first test to use `images` builds them all: minutes on a new machine (see docs/containers.md).
pytestmark = [pytest.mark.docker, pytest.mark.slow, pytest.mark.timeout(3600)]

PROMPT = "The capital of France is"
ROLES = ("slicer", "router", "ffn", "client", "serve", "embed", "edge", "prometheus")
GRID_KEY = "larql-test-grid-key-5f0c2a"


@pytest.fixture(scope="session")
def engine():
    dk.require_engine()
    yield
    dk.purge_session()


@pytest.fixture(scope="session")
def images(engine):
    """Every image, built once per session by docker/build-images.sh (from nothing on a new machine)."""
    return dk.build_images()


@pytest.fixture(scope="session")
def reference(gemma_f16):
    """The local forward pass on the same f16 vindex the images extract: token ids to compare with."""
    from larql_edge.format.vindex import Vindex
    from larql_edge.model.forward import Transformer

    vx = Vindex.open(gemma_f16)
    tok = vx.load_tokenizer()
    model = Transformer.local(vx)
    ids = tok.encode(PROMPT).ids
    out = {"vindex": vx, "prompt_ids": ids, "tokenizer": tok}
    out["greedy32"] = list(model.generate(ids, 32, stop_ids=[]))
    out["greedy16"] = out["greedy32"][:16]
    logits = model.next_logits(ids)
    out["top1"] = int(logits.argmax())
    return out


# ---- the images ----------------------------------------------------------------------------------

def test_dockerfiles_need_no_registry_frontend():
    """No `# syntax=` line (BuildKit would pull a frontend); every FROM is an ARG BASE_IMAGE or a stage."""
    root = dk.ROOT
    files = [root / "Dockerfile", *sorted((root / "docker").glob("Dockerfile.*")), *sorted((root / "docker").glob("*/Dockerfile*"))]
    assert len(files) >= 3, files
    for f in files:
        text = f.read_text()
        assert not re.search(r"(?im)^\s*#\s*syntax\s*=", text), f
        stages = set(re.findall(r"(?im)^FROM\s+\S+\s+AS\s+(\S+)", text))
        for src in re.findall(r"(?im)^FROM\s+(\S+)", text):
            assert src == "${BASE_IMAGE}" or src in stages, f"{f.name}: FROM {src}"
        assert re.search(r"(?m)^ARG BASE_IMAGE=\S+", text), f"{f.name}: no ARG BASE_IMAGE default"


def test_compose_file_never_pulls():
    """Every service of compose.yaml builds its image (pull_policy build), none pulls one."""
    text = (dk.ROOT / "compose.yaml").read_text()
    body = text[text.index("\nservices:\n"):text.index("\nvolumes:\n")]
    blocks = re.split(r"(?m)^  ([a-z][a-z0-9-]*):\n", body)[1:]
    services = dict(zip(blocks[::2], blocks[1::2], strict=True))
    assert {"slicer", "embed", "ffn-a", "ffn-b", "router", "edge", "prometheus", "grid"} <= set(services)
    for name, block in services.items():
        assert re.search(r"(?m)^    pull_policy: (build|never)$", block), name
        assert re.search(r"(?m)^    build:", block), name


def test_images_are_built_from_local_bases_only(images):
    """Each image's bottom layer is the docker-imported base of this machine: nothing was pulled."""
    d = dk.client()
    bases = {"larql-base:bookworm": ("slicer", "router", "ffn", "client", "embed"),
             "larql-base-nginx:bookworm": ("edge",), "larql-base-prometheus:bookworm": ("prometheus",)}
    for base, roles in bases.items():
        bottom = d.images.get(base).attrs["RootFS"]["Layers"][0]
        for role in roles:
            layers = d.images.get(dk.image(role)).attrs["RootFS"]["Layers"]
            assert layers[0] == bottom, (role, base)


def test_images_run_as_non_root_with_healthchecks(images):
    d = dk.client()
    for role in ROLES:
        cfg = d.images.get(dk.image(role)).attrs["Config"]
        user = cfg.get("User") or "root"
        assert user.split(":")[0] not in ("", "root", "0"), (role, user)
        if role in ("router", "ffn", "serve", "embed", "edge", "prometheus"):
            assert cfg.get("Healthcheck", {}).get("Test"), role
    embed = d.images.get(dk.image("embed")).attrs["Config"]
    assert embed["User"] == "10001:10001"
    assert "8082/tcp" in embed["ExposedPorts"]
    assert any(e.startswith("OPENBLAS_NUM_THREADS=1") for e in embed["Env"])


def test_embed_image_every_flag_has_an_env_twin(images):
    out = dk.client().containers.run(dk.image("embed"), ["--help"], remove=True, network_mode="none",
                                     labels={dk.LABEL: dk.SESSION}).decode()
    flags = re.findall(r"^\s+(--[a-z][a-z0-9-]*)", out, re.M)
    assert "--port" in flags and "--hot-cache" in flags, out
    text = " ".join(out.split())
    for flag in flags:
        if flag == "--help":
            continue
        env = "LARQL_" + flag[2:].replace("-", "_").upper()
        assert env in text, f"{flag}: no {env} in --help"
    assert "LARQL_VINDEX" in text


def test_embed_image_serves_gemma_with_no_arguments(images):
    """`docker run -p 8082:8082 larql-embed`: no argument, no environment; healthy, serves rows."""
    with dk.Grid("embed-alone") as g:
        g.start("embed", "embed", ports=(8082,))
        g.wait_healthy("embed", timeout=180)
        url = g.url("embed", 8082)
        r = httpx.get(f"{url}/v1/embed/9079", timeout=10)
        assert r.status_code == 200 and len(r.content) == 640 * 4
        assert "immutable" in r.headers["cache-control"] and r.headers.get("etag")
        top = httpx.post(f"{url}/v1/logits", timeout=30, content=b"\0" * (640 * 4),
                         headers={"content-type": "application/x-larql-ffn"})
        assert top.status_code == 200, top.text
        top_proc = g.wrapped("embed").top()
        users = {row[top_proc["Titles"].index("UID")] for row in top_proc["Processes"]}
        assert users == {"10001"}, top_proc


def test_read_only_embed_container_says_what_to_mount_then_serves(images):
    """`docker run --read-only larql-embed`: one line naming the fix and a non-zero exit, not a traceback;
    with the tmpfs it names, the same read-only container is healthy and serves rows and logits."""
    with dk.Grid("embed-ro") as g:
        c = g.start("ro", "embed", read_only=True)
        code = g.wrapped("ro").wait(timeout=120)["StatusCode"]
        err = g.wrapped("ro").logs(stdout=False, stderr=True).decode(errors="replace").strip()
        assert code == 2 and "--tmpfs /tmp" in err and "Traceback" not in err and len(err.splitlines()) == 1, err
        c.stop()
        g.containers.pop("ro")
        g.start("embed", "embed", ports=(8082,), read_only=True, tmpfs={"/tmp": "size=64m"})
        g.wait_healthy("embed", timeout=180)
        url = g.url("embed", 8082)
        assert httpx.get(f"{url}/v1/embed/9079", timeout=10).status_code == 200
        top = httpx.post(f"{url}/v1/logits", timeout=30, content=b"\0" * (640 * 4),
                         headers={"content-type": "application/x-larql-ffn"})
        assert top.status_code == 200, top.text + g.logs("embed")


def test_images_carry_the_same_f16_vindex_as_the_local_reference(images, gemma_f16):
    """The slicer image's Gemma vindex is byte-identical (per its checksums) to the host's f16 one."""
    import json

    raw = dk.client().containers.run(dk.image("slicer"), ["inspect", "--json", "/models/gemma3-270m.vindex"],
                                     remove=True, network_mode="none", labels={dk.LABEL: dk.SESSION})
    info = json.loads(raw)
    assert info["dtype"] == "f16" and info["extract_level"] == "all"
    index = dk.client().containers.run(dk.image("slicer"), [], entrypoint=["cat", "/models/gemma3-270m.vindex/index.json"],
                                       remove=True, network_mode="none", labels={dk.LABEL: dk.SESSION})
    host = json.loads((Path(gemma_f16) / "index.json").read_text())
    assert json.loads(index)["checksums"] == host["checksums"]


# ---- the grid on a private network -----------------------------------------------------------------

@pytest.fixture(scope="module")
def grid(images):
    """router + embed + ffn 0-8 + ffn 9-17 twice + nginx edge, on one private network."""
    with dk.Grid("grid") as g:
        common = {"LARQL_GRID_KEY": GRID_KEY}
        g.start("router", "router", env={**common, "LARQL_HEARTBEAT_INTERVAL": "0.5"}, ports=(9090,))
        g.start("embed", "embed", ports=(8082,), env={
            **common, "LARQL_JOIN": "http://router:9090", "LARQL_PUBLIC_URL": "http://embed:8082"})
        for alias, layers in (("ffn-a", "0-8"), ("ffn-b1", "9-17"), ("ffn-b2", "9-17")):
            g.start(alias, "ffn", ports=(8080,), env={
                **common, "LARQL_LAYERS": layers, "LARQL_JOIN": "http://router:9090",
                "LARQL_PUBLIC_URL": f"http://{alias}:8080"})
        g.wait_healthy("router", "embed", "ffn-a", "ffn-b1", "ffn-b2", timeout=300)
        g.start("edge", "edge", ports=(8080,))
        g.wait_healthy("edge", timeout=120)
        router = g.url("router", 9090)
        deadline = time.monotonic() + 120
        while True:
            view = httpx.get(router + "/v1/grid", timeout=5).json()
            ffn = [m for m in view["members"] if m["capability"] == "ffn" and m["live"]]
            if view["complete"] and view["embed"] >= 1 and len(ffn) == 3:
                break
            assert time.monotonic() < deadline, f"grid incomplete: {view}\n{g.logs('router')}"
            time.sleep(0.5)
        yield g


def _generate(g: dk.Grid, alias: str, tokens: int) -> tuple[int, str, str]:
    return g.run_once(alias, "client", ["generate", "--prompt", PROMPT, "--max-tokens", str(tokens), "--json"],
                      env={"LARQL_FFN": "http://router:9090"}, timeout=600)


def test_golden_prompt_through_the_client_container(grid, reference):
    code, out, err = _generate(grid, "client-golden", 16)
    assert code == 0, err[-3000:]
    res = dk.json_line(out)
    assert res["prompt_ids"] == reference["prompt_ids"]
    assert res["generated_ids"] == reference["greedy16"], (res, reference["greedy16"])
    print(f"\n[containers] golden prompt via the client container: {res['text']!r} in {res['seconds']}s")


def _stats(g: dk.Grid, alias: str) -> dict:
    return httpx.get(g.url(alias, 8080) + "/v1/stats", timeout=5).json()


def test_killing_a_replicated_shard_mid_generation_completes(grid, reference):
    g = grid
    before = {a: _stats(g, a)["requests"] for a in ("ffn-b1", "ffn-b2")}
    result: dict = {}

    def client():
        result["run"] = _generate(g, "client-kill", 32)

    t = threading.Thread(target=client, daemon=True)
    t.start()
    # Layers 9-17 are asked 9 times per token: kill once about 6 tokens have gone through them.
    deadline = time.monotonic() + 300
    while True:
        served = {a: _stats(g, a)["requests"] - before[a] for a in before}
        if sum(served.values()) >= 9 * 6:
            break
        assert t.is_alive(), f"the generation ended before the kill: {result.get('run')}"
        assert time.monotonic() < deadline, f"no FFN traffic in 300s: {served}"
        time.sleep(0.1)
    victim = max(served, key=served.get)  # the replica that is serving the generation
    survivor = "ffn-b2" if victim == "ffn-b1" else "ffn-b1"
    at_kill = _stats(g, survivor)["requests"]
    g.wrapped(victim).kill()  # SIGKILL: a crash, not a clean stop
    t.join(timeout=600)
    assert not t.is_alive(), "the generation did not finish after the kill"
    code, out, err = result["run"]
    assert code == 0, err[-3000:]
    res = dk.json_line(out)
    assert res["generated_ids"] == reference["greedy32"], (res, reference["greedy32"])
    assert _stats(g, survivor)["requests"] > at_kill, "the surviving replica took no traffic after the kill"
    g.wrapped(victim).reload()
    assert g.wrapped(victim).status != "running"
    print(f"\n[containers] killed {victim} after {served} requests; 32 tokens completed via {survivor}")


def test_edge_cache_serves_cached_rows_with_the_embed_container_stopped(grid):
    g = grid
    edge = g.url("edge", 8080)
    ids = (9079, 506, 5279)
    first = {}
    with httpx.Client(timeout=10) as h:
        for i in ids:
            r = h.get(f"{edge}/v1/embed/{i}")
            assert r.status_code == 200, r.text
            assert len(r.content) == 640 * 4
            first[i] = r.content
            assert h.get(f"{edge}/v1/embed/{i}").headers.get("x-cache") == "HIT"
        j = h.get(f"{edge}/v1/embed/{ids[0]}.json")
        assert j.status_code == 200 and j.json()["token_id"] == ids[0]

        g.wrapped("embed").stop(timeout=10)
        try:
            assert h.get(f"{edge}/v1/embed/{ids[0]}", timeout=5).status_code == 200  # any request
            for i in ids:
                r = h.get(f"{edge}/v1/embed/{i}")
                assert r.status_code == 200, r.text
                assert r.headers.get("x-cache") == "HIT"
                assert r.content == first[i]
                assert "immutable" in r.headers.get("cache-control", "")
            assert h.get(f"{edge}/v1/embed/{ids[0]}.json").status_code == 200
            # a row never fetched cannot be served: nginx's own JSON error, not a hang
            miss = h.get(f"{edge}/v1/embed/4242")
            assert miss.status_code == 503 and "error" in miss.json()
        finally:
            g.wrapped("embed").start()


# ---- docker compose up grid --------------------------------------------------------------------------

def test_docker_compose_up_grid(images, reference, tmp_path):
    """`docker compose up grid`, as a user types it (attached): the slicer fills the volumes, every
    service becomes healthy and the grid's own generation succeeds; then one prediction through the
    compose file's client, the published ports (router, edge, Prometheus scraping every role); down."""
    ports = {"LARQL_ROUTER_PUBLISH": dk.free_port(), "LARQL_EMBED_PUBLISH": dk.free_port(),
             "LARQL_EDGE_PUBLISH": dk.free_port(), "LARQL_PROMETHEUS_PUBLISH": dk.free_port()}
    env = {k: str(v) for k, v in ports.items()}
    env.update(LARQL_TAG=dk.TAG, LARQL_GRID_KEY=GRID_KEY, LARQL_DEMO_TOKENS="4")
    log_path = tmp_path / "compose-up.log"
    with dk.compose_project("compose", env) as (compose, cenv):
        project = cenv["COMPOSE_PROJECT_NAME"]
        t0 = time.monotonic()
        with open(log_path, "wb") as log:
            up = subprocess.Popen([*compose, "up", "grid"], stdout=log, stderr=subprocess.STDOUT, cwd=dk.ROOT,
                                  env={**os.environ, **cenv}, stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            deadline = time.monotonic() + 900
            grid_c = None
            while grid_c is None or dk.health(grid_c) != "healthy":
                assert up.poll() is None, f"`docker compose up grid` exited ({up.returncode}):\n{log_path.read_text()[-6000:]}"
                assert time.monotonic() < deadline, f"grid not healthy in 900s:\n{log_path.read_text()[-6000:]}"
                grid_c = grid_c or dk.compose_container(project, "grid")
                if grid_c is not None:
                    assert dk.health(grid_c) not in ("exited", "dead", "unhealthy"), log_path.read_text()[-6000:]
                time.sleep(2)
            up_s = time.monotonic() - t0
            for svc in ("router", "embed", "ffn-a", "ffn-b", "edge", "prometheus"):
                assert dk.health(dk.compose_container(project, svc)) == "healthy", svc
            slicer = dk.compose_container(project, "slicer")
            slicer.reload()
            assert slicer.attrs["State"]["ExitCode"] == 0
            assert "ready" in slicer.logs().decode()
            assert "grid is up" in grid_c.logs().decode()

            # one prediction, through the client container of the compose file
            proc = dk.run([*compose, "--profile", "client", "run", "--rm", "client", "predict", "--prompt", PROMPT,
                           "--top-k", "3", "--json"], timeout=600, env=cenv)
            res = dk.json_line(proc.stdout)
            assert res["prompt_ids"] == reference["prompt_ids"]
            assert res["top_k"][0]["id"] == reference["top1"]

            # the published ports: router, edge cache, Prometheus scraping every role
            host = "http://127.0.0.1"
            assert httpx.get(f"{host}:{ports['LARQL_ROUTER_PUBLISH']}/v1/ready", timeout=5).json()["complete"]
            r = httpx.get(f"{host}:{ports['LARQL_EDGE_PUBLISH']}/v1/embed/{reference['top1']}", timeout=10)
            assert r.status_code == 200 and len(r.content) == 640 * 4
            larql = dk.larql_scrape_targets(f"{host}:{ports['LARQL_PROMETHEUS_PUBLISH']}", 4, timeout=60)
            assert {t["labels"]["job"] for t in larql} == {"larql-embed", "larql-ffn", "larql-router"}
            print(f"\n[containers] docker compose up grid: healthy in {up_s:.0f}s")

            dk.run([*compose, "--profile", "client", "down", "-v", "--timeout", "10"], timeout=300, env=cenv)
            assert dk.compose_container(project, "grid") is None
            up.wait(timeout=120)  # the attached `up` ends when its containers are gone
        finally:
            if up.poll() is None:
                os.killpg(up.pid, signal.SIGTERM)
                try:
                    up.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    os.killpg(up.pid, signal.SIGKILL)
                    up.wait(timeout=30)


# ---- the Varnish edge (docker/Dockerfile.varnish) and LARQL_EDGE=varnish in compose ------------------

def test_varnish_edge_image_caches_rows_of_the_embed_container(images):
    """larql-varnish in front of a real embed container: non-root, healthy, MISS then HIT with the
    origin's bytes, passes what is not a row, and serves cached rows with the embed container stopped."""
    d = dk.client()
    cfg = d.images.get(dk.image("varnish")).attrs["Config"]
    assert cfg["User"] == "10001:10001" and cfg.get("Healthcheck", {}).get("Test")
    bottom = d.images.get("larql-base-varnish:bookworm").attrs["RootFS"]["Layers"][0]
    assert d.images.get(dk.image("varnish")).attrs["RootFS"]["Layers"][0] == bottom
    with dk.Grid("varnish") as g:
        g.start("embed", "embed", ports=(8082,))
        g.wait_healthy("embed", timeout=180)
        g.start("edge", "varnish", ports=(8080,), env={"LARQL_EDGE_UPSTREAMS": "embed:8082"})
        g.wait_healthy("edge", timeout=120)
        edge, origin = g.url("edge", 8080), g.url("embed", 8082)
        ids = (9079, 506)
        with httpx.Client(timeout=30) as h:
            for i in ids:
                first = h.get(f"{edge}/v1/embed/{i}")
                assert first.status_code == 200 and first.headers.get("x-cache") == "MISS", first.text
                assert first.content == h.get(f"{origin}/v1/embed/{i}").content and len(first.content) == 640 * 4
                again = h.get(f"{edge}/v1/embed/{i}")
                assert again.headers.get("x-cache") == "HIT" and again.content == first.content
            j = h.get(f"{edge}/v1/embed/{ids[0]}.json")
            assert j.status_code == 200 and j.json()["token_id"] == ids[0]
            top = h.post(f"{edge}/v1/logits", content=b"\0" * (640 * 4), headers={"content-type": "application/x-larql-ffn"})
            assert top.status_code == 200 and "x-cache" not in top.headers  # passed, never cached
            proc = g.wrapped("edge").top()
            assert {row[proc["Titles"].index("UID")] for row in proc["Processes"]} == {"10001"}, proc

            g.wrapped("embed").stop(timeout=10)
            for i in ids:
                r = h.get(f"{edge}/v1/embed/{i}")
                assert r.status_code == 200 and r.headers.get("x-cache") == "HIT", r.text
            miss = h.get(f"{edge}/v1/embed/4242")  # never fetched, origin gone: the VCL's JSON error
            assert miss.status_code == 503 and "error" in miss.json()


def test_compose_LARQL_EDGE_selects_nginx_or_varnish():
    """The edge service is the nginx template by default and the Varnish one with LARQL_EDGE=varnish;
    the templates themselves never run (scale 0)."""
    import yaml

    compose = [*dk.compose_cmd(), "-f", str(dk.ROOT / "compose.yaml")]
    for kind, image, dockerfile in ((None, "larql-edge", "docker/Dockerfile.edge"),
                                    ("nginx", "larql-edge", "docker/Dockerfile.edge"),
                                    ("varnish", "larql-varnish", "docker/Dockerfile.varnish")):
        env = {"LARQL_EDGE": kind} if kind else {}
        out = subprocess.run([*compose, "config"], capture_output=True, text=True, timeout=120, cwd=dk.ROOT,
                             env={k: v for k, v in {**os.environ, **env}.items() if kind or k != "LARQL_EDGE"})
        assert out.returncode == 0, out.stderr
        services = yaml.safe_load(out.stdout)["services"]
        edge = services["edge"]
        assert edge["image"].split(":")[0] == image, (kind, edge["image"])
        assert edge["build"]["dockerfile"].endswith(dockerfile), (kind, edge["build"])
        assert int(edge.get("scale", 1)) == 1 and not edge.get("profiles")
        assert "embed" in edge["depends_on"] and any(str(p).endswith(":8080") or "8080" in str(p) for p in edge["ports"])
        for template in ("edge-nginx", "edge-varnish"):
            assert int(services[template]["scale"]) == 0, template


def test_docker_compose_edge_varnish_serves_rows(images, tmp_path):
    """`LARQL_EDGE=varnish docker compose up -d edge`: slicer, router, embed and the Varnish edge;
    a row through the published edge port, MISS then HIT; down."""
    port = dk.free_port()
    env = {"LARQL_TAG": dk.TAG, "LARQL_GRID_KEY": GRID_KEY, "LARQL_EDGE": "varnish", "LARQL_EDGE_PUBLISH": str(port),
           "LARQL_ROUTER_PUBLISH": str(dk.free_port()), "LARQL_EMBED_PUBLISH": str(dk.free_port())}
    with dk.compose_project("varnish", env) as (compose, cenv):
        project = cenv["COMPOSE_PROJECT_NAME"]
        dk.run([*compose, "up", "-d", "edge"], timeout=900, env=cenv)
        edge_c = dk.compose_container(project, "edge")
        assert edge_c is not None and edge_c.image.tags[0].startswith("larql-varnish:"), edge_c and edge_c.image.tags
        assert dk.compose_container(project, "edge-nginx") is None and dk.compose_container(project, "edge-varnish") is None
        deadline = time.monotonic() + 300
        while dk.health(edge_c) != "healthy":
            assert dk.health(edge_c) not in ("exited", "dead", "unhealthy"), edge_c.logs().decode()[-3000:]
            assert time.monotonic() < deadline, edge_c.logs().decode()[-3000:]
            time.sleep(2)
        url = f"http://127.0.0.1:{port}/v1/embed/9079"
        first = httpx.get(url, timeout=30)
        assert first.status_code == 200 and first.headers.get("x-cache") == "MISS" and len(first.content) == 640 * 4
        again = httpx.get(url, timeout=30)
        assert again.headers.get("x-cache") == "HIT" and again.content == first.content
