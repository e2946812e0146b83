"""The embed server's Sanic app, built by a factory (one call per worker process).

The app listens at once and loads its models in a background thread: ``/v1/health`` answers
immediately, ``/v1/ready`` and the model routes answer 503 until everything is loaded, then the
first worker prints the banner ending in ``Ready.``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from pathlib import Path

from sanic import Sanic

from larql_edge.roles.embed.banner import banner
from larql_edge.roles.embed.batcher import LogitsBatcher
from larql_edge.roles.embed.config import EmbedConfig
from larql_edge.roles.embed.openapi import openapi_spec
from larql_edge.roles.embed.registry import ModelRegistry
from larql_edge.roles.embed.routes import BLUEPRINTS
from larql_edge.roles.embed.routes.service import ready, stats
from larql_edge.service import Hooks, Metrics, make_app, pin_blas
from larql_edge.service.identity import vindex_hash
from larql_edge.service.membership import install_membership

log = logging.getLogger("larql.embed")

APP_NAME = "larql-embed"


class EmbedMetrics:
    """The role's own series on top of the request metrics every role has."""

    def __init__(self, metrics: Metrics):
        self.metrics = metrics
        self.hits = metrics.counter("hot_cache_hits", "Embedding lookups served from the L1 hot cache", ("model",))
        self.misses = metrics.counter("hot_cache_misses", "Embedding lookups decoded from the f16 table", ("model",))
        self.entries = metrics.gauge("hot_cache_entries", "Rows held in the L1 hot cache", ("model",), mode="livesum")
        self.batch = metrics.histogram(
            "logits_batch_size",
            "Residuals multiplied together in one lm_head product",
            ("model",),
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256),
        )
        self.batch_duration = metrics.histogram(
            "logits_batch_duration_seconds", "Time of one batched lm_head product and its post-processing", ("model",)
        )
        self.info = metrics.gauge(
            "model_info",
            "Served model (value 1) with its identity in labels",
            ("model_id", "model", "family", "embeddings_sha256", "dtype", "lm_head_tied", "hidden_size", "vocab_size"),
            mode="max",
        )

    def attach(self, m) -> None:
        """Wire one loaded model's hot cache to the metrics (its counters are flushed, not bumped)."""
        hits, misses, entries = self.hits.labels(m.id), self.misses.labels(m.id), self.entries.labels(m.id)
        cache = m.store.cache
        seen = {"hits": 0, "misses": 0}

        def flush() -> None:
            h, mi = cache.hits, cache.misses
            if h > seen["hits"]:
                hits.inc(h - seen["hits"])
            if mi > seen["misses"]:
                misses.inc(mi - seen["misses"])
            seen["hits"], seen["misses"] = h, mi
            entries.set(len(cache))

        self.metrics.add_flusher(flush)
        self.info.labels(
            m.id, m.name, m.spec.family.name, m.sha256, m.store.storage_dtype, str(m.tied).lower(),
            str(m.hidden_size), str(m.vocab_size),
        ).set(1)  # fmt: skip

    def on_batch(self, m):
        size, duration = self.batch.labels(m.id), self.batch_duration.labels(m.id)

        def record(n: int, seconds: float) -> None:
            size.observe(n)
            duration.observe(seconds)

        return record


def _first_worker() -> bool:
    name = os.environ.get("SANIC_WORKER_NAME", "")
    return not name or name.endswith("-0-0")


def create_app(cfg: EmbedConfig) -> Sanic:
    registry = ModelRegistry(cfg)

    def inflight() -> int:
        return sum(m.batcher.pending for m in registry.models.values() if m.ready)

    hooks = Hooks(ready=lambda: ready(registry), stats=stats, inflight=inflight, openapi=openapi_spec())
    default_hash = vindex_hash(next(iter(registry.models.values())).vindex)  # the model the grid serves
    app = make_app(APP_NAME, "embed", hooks, max_body=cfg.limits.max_body, access_log=cfg.access_log,
                   identity=lambda: default_hash)
    app.ctx.cfg = cfg
    app.ctx.registry = registry
    app.ctx.embed_metrics = em = EmbedMetrics(app.ctx.metrics)
    for bp in BLUEPRINTS:
        app.blueprint(bp)

    @app.before_server_start
    async def _setup(app_):
        pin_blas(cfg.blas_threads)

    @app.after_server_start
    async def _load(app_):
        app_.ctx.loader = asyncio.get_running_loop().create_task(_load_models(app_, cfg, registry, em))

    if _first_worker():  # one worker joins: members are identified by public URL
        _join_grid(app, cfg, registry, inflight)
    return app


def _join_grid(app: Sanic, cfg: EmbedConfig, registry: ModelRegistry, inflight) -> None:
    if cfg.grid is None:
        return
    m = next(iter(registry.models.values()))  # the default model is the one the grid serves
    ident = {"model": m.vindex.model, "num_layers": m.vindex.num_layers, "hidden_size": m.vindex.hidden_size,
             "vindex_hash": vindex_hash(m.vindex)}
    install_membership(app, cfg.grid, "embed", describe_fn=lambda: dict(ident, inflight=inflight()),
                       ready_fn=lambda: registry.ready)


async def _load_models(app: Sanic, cfg: EmbedConfig, registry: ModelRegistry, em: EmbedMetrics) -> None:
    loop = asyncio.get_running_loop()
    cache = Path(cfg.lm_head_cache) if cfg.lm_head_cache else None
    done = loop.create_future()

    def work() -> None:
        ok = False
        try:
            ok = registry.load_all(cfg.hot_cache, cache, cfg.lm_head_format)
        finally:
            loop.call_soon_threadsafe(done.set_result, ok)

    # A plain thread, not the compute executor: loading may take seconds and must not delay it.
    threading.Thread(target=work, name="load-models", daemon=True).start()
    if not await done:
        log.error("not ready: %s", registry.error)
        app.ctx.failed = f"loading failed for good: {registry.error}"  # /v1/health: 503, so it is restarted
        return
    for m in registry.models.values():
        em.attach(m)
        m.batcher = LogitsBatcher(
            m.head.logits,
            app.ctx.compute,
            max_batch=cfg.limits.max_batch,
            max_wait=cfg.limits.batch_wait_ms / 1e3,
            on_batch=em.on_batch(m),
        )
    registry.ready = True
    if _first_worker():
        print(banner(cfg, list(registry.models.values())), flush=True)
    else:
        log.info("worker ready")
