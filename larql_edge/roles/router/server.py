"""The router's HTTP app: membership, FFN routing, the embed proxy, and its own health and metrics."""

from __future__ import annotations

import asyncio
import logging

from sanic import Sanic
from sanic.request import Request
from sanic.response import HTTPResponse, json

from larql_edge.service.identity import rss_bytes
from larql_edge.service.envelope import install_error_envelope
from larql_edge.service.metrics import Metrics
from larql_edge.roles.router import embed_proxy, grid_routes, walk
from larql_edge.service.h1 import TransportError
from larql_edge.roles.router.registry import Registry
from larql_edge.roles.router.upstream import Upstream

log = logging.getLogger("larql.router")
MAX_BODY = 256 << 20


class RouterMetrics(Metrics):
    """larql_router_*: the shared request series plus the grid's own."""

    def __init__(self):
        super().__init__("router")
        self.upstream = self.histogram("upstream_duration_seconds", "time of one request to a member", ["capability"])
        self.failures = self.counter("upstream_failures", "requests a member failed", ["capability", "reason"])
        self.retries = self.counter("retries", "requests re-routed to another replica")
        self.joins = self.counter("membership", "join/heartbeat/leave outcomes", ["route", "result"])
        self.evictions = self.counter("evictions", "members evicted for missing heartbeats")
        self.members = self.gauge("members", "registered members", ["capability"])
        self.uncovered = self.gauge("layers_uncovered", "layers no live FFN member serves")


def create_app(registry: Registry, grid_key: str, upstream_timeout: float = 60.0, name: str = "larql_router") -> Sanic:
    app = Sanic(name)
    app.config.REQUEST_MAX_SIZE = MAX_BODY
    app.config.KEEP_ALIVE_TIMEOUT = 75
    install_error_envelope(app)
    metrics = RouterMetrics()
    metrics.install(app)
    app.ctx.registry = registry
    # The pool opens connections lazily, inside the server's loop: it can be made before the server.
    app.ctx.upstream = upstream = Upstream(registry, upstream_timeout, metrics)

    @app.after_server_start
    async def _tasks(app, _loop=None):
        app.ctx.housekeeping = asyncio.get_running_loop().create_task(_housekeeping(app, registry, metrics))

    @app.before_server_stop
    async def _close(app, _loop=None):
        task = getattr(app.ctx, "housekeeping", None)
        if task is not None:
            task.cancel()
        await upstream.close()

    grid_routes.install(app, registry, grid_key, metrics)
    walk.install(app, registry, upstream, metrics)
    embed_proxy.install(app, registry, upstream)

    @app.get("/v1/stats")
    async def stats(request: Request) -> HTTPResponse:
        v = registry.view()
        return json({"mode": "router", "model": v["model"], "num_layers": v["num_layers"],
                     "members": len(v["members"]), "gaps": v["gaps"], "complete": v["complete"],
                     "memory_mb": round(rss_bytes() / 2**20, 1)})

    @app.get("/v1/health")
    async def health(request: Request) -> HTTPResponse:
        return json({"status": "ok"})

    @app.get("/v1/ready")
    async def ready(request: Request) -> HTTPResponse:
        # Ready = accepting joins and requests. Whether every layer is served is /v1/grid's
        # "complete": members join after the router is up, so they cannot be a condition of it.
        v = registry.view()
        return json({"ready": True, "complete": v["complete"], "gaps": v["gaps"], "embed": v["embed"]})

    return app


async def _housekeeping(app: Sanic, registry: Registry, metrics: RouterMetrics) -> None:
    """Evict members whose heartbeats stopped; probe static members; refresh the gauges."""
    period = max(0.05, registry.heartbeat_interval / 2)
    while True:
        try:
            for m in registry.evict_stale():
                metrics.evictions.inc()
                log.warning("evicted %s %s at %s: no heartbeat for %.1fs", m.capability, m.id, m.url, registry.evict_after)
            await _probe_static(app, registry)
            for cap in ("ffn", "embed"):
                metrics.members.labels(cap).set(sum(1 for m in registry.members.values() if m.capability == cap))
            v = registry.view()
            metrics.uncovered.set(sum(len(range(int(g.split("-")[0]), int(g.split("-")[1]) + 1)) for g in v["gaps"]))
        except asyncio.CancelledError:
            raise
        except Exception:  # housekeeping must outlive any one bad round
            log.exception("housekeeping round failed")
        await asyncio.sleep(period)


async def _probe_static(app: Sanic, registry: Registry) -> None:
    """Static members (flags) do not heartbeat: learn their model from /v1/stats and notice failures."""
    static = [m for m in registry.members.values() if m.static]
    if not static:
        return
    pool = app.ctx.upstream.pool
    now = registry.clock()
    for m in static:
        if m.model and now - m.last_seen < registry.heartbeat_interval:
            continue
        try:
            r = await pool.request("GET", m.url + "/v1/stats", timeout=2.0)
            s = r.json()
            if not isinstance(s, dict):
                raise ValueError("not an object")
        except (TransportError, ValueError):
            registry.failed(m)
            continue
        m.last_seen = registry.clock()
        m.model = str(s.get("model") or m.model)
        m.num_layers = s.get("num_layers") or m.num_layers
        m.hidden_size = s.get("hidden_size") or m.hidden_size
        m.rss_bytes = int((s.get("memory_mb") or 0) * 2**20)
        if m.consecutive_failures:
            m.consecutive_failures, m.down_until = 0, 0.0
