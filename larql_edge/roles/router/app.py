"""The router's app: membership, FFN routing and the embed proxy, on the service toolkit."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from sanic import Sanic
from sanic.request import Request

from larql_edge.errors import TransportError
from larql_edge.service import Hooks, Metrics, make_app
from larql_edge.service.identity import rss_bytes

from .embed_proxy import bp as embed_bp
from .grid_routes import bp as grid_bp
from .openapi import openapi_spec
from .registry import Registry, model_facts
from .upstream import Upstream
from .walk import bp as walk_bp

log = logging.getLogger("larql.router")


@dataclass(frozen=True)
class Limits:
    """What the router accepts (published in /v1/stats)."""

    max_body: int = 64 << 20  # a walk-ffn request it forwards (members bound their own, lower)
    max_reply_bytes: int = 64 << 20  # what one request may ask back (rows x layers x hidden x 4)
    max_grid_body: int = 64 << 10  # join, heartbeat, leave: small JSON objects
    # Shorter than a client's own timeout (30 s by default), so the router fails over to another
    # replica before the client gives up on the router.
    upstream_timeout: float = 10.0
    # ...plus this much per row x layer a request asks a member to compute: the largest legal batch
    # (26,214 row-layers on Gemma) takes ~5-11 s on a loaded 2-core machine, which a flat 10 s
    # turned into a "member failed" for a request the member was serving correctly.
    upstream_ms_per_row: float = 1.0
    # Past the deadline above, a member that still heartbeats is not failed (slow is not broken):
    # the request moves to another live replica, or without one is waited for up to this long
    # (under RESPONSE_TIMEOUT_S, so the router's reply is always its own).
    upstream_max_wait: float = 600.0

    def hop_timeout(self, row_layers: int) -> float:
        """Seconds the router waits for a member's reply to a request of ``row_layers`` rows x layers."""
        return self.upstream_timeout + max(0, row_layers) * self.upstream_ms_per_row / 1e3

    def as_json(self) -> dict:
        return {"max_body_bytes": self.max_body, "max_reply_bytes": self.max_reply_bytes,
                "max_layers_per_request": "the model's layers, each named once",
                "max_grid_body_bytes": self.max_grid_body, "upstream_timeout_s": self.upstream_timeout,
                "upstream_ms_per_row_layer": self.upstream_ms_per_row, "upstream_max_wait_s": self.upstream_max_wait}


class RouterMetrics(Metrics):
    """larql_router_*: the shared request series plus the grid's own."""

    def __init__(self):
        super().__init__("router")
        self.upstream = self.histogram("upstream_duration_seconds", "time of one request to a member", ["capability"])
        self.failures = self.counter("upstream_failures", "requests a member failed", ["capability", "reason"])
        self.slow = self.counter("upstream_slow", "replies past their deadline from members still heartbeating "
                                 "(moved to another replica, or waited for: not failures)", ["capability", "outcome"])
        self.retries = self.counter("retries", "requests re-routed to another replica")
        self.joins = self.counter("membership", "join/heartbeat/leave outcomes", ["route", "result"])
        self.evictions = self.counter("evictions", "members evicted for missing heartbeats")
        self.members = self.gauge("members", "registered members", ["capability"])
        self.uncovered = self.gauge("layers_uncovered", "layers no live FFN member serves")


def create_app(registry: Registry, grid_key: str, limits: Limits | None = None, name: str = "larql_router") -> Sanic:
    limits = limits or Limits()

    def stats(request: Request) -> dict:
        v = registry.view()
        # LARQL's client reads hidden_size (and its servers' stats carry layers, family, vocab_size).
        return {"mode": "router", "model": v["model"], "num_layers": v["num_layers"], "layers": v["num_layers"],
                "hidden_size": v["hidden_size"], **v["facts"],
                "members": len(v["members"]), "gaps": v["gaps"], "complete": v["complete"],
                "inflight": upstream.inflight, "slow_replies": upstream.slow, "memory_mb": round(rss_bytes() / 2**20, 1),
                "limits": limits.as_json()}

    def ready() -> dict:
        # Ready = accepting joins and requests. Whether every layer is served is /v1/grid's
        # "complete": members join after the router is up, so they cannot be a condition of it.
        v = registry.view()
        return {"ready": True, "complete": v["complete"], "gaps": v["gaps"], "embed": v["embed"]}

    metrics = RouterMetrics()
    hooks = Hooks(ready=ready, stats=stats, inflight=lambda: upstream.inflight, openapi=openapi_spec())
    app = make_app(name, "router", hooks, max_body=limits.max_body, metrics=metrics)
    app.ctx.registry = registry
    app.ctx.grid_key = grid_key.encode()
    # The pool opens connections lazily, inside the server's loop: it can be made before the server.
    app.ctx.limits = limits
    app.ctx.upstream = upstream = Upstream(registry, limits.upstream_timeout, metrics, max_reply=limits.max_reply_bytes + (1 << 16),
                                           max_wait=limits.upstream_max_wait)
    for bp in (grid_bp, walk_bp, embed_bp):
        app.blueprint(bp)

    @app.after_server_start
    async def _tasks(app_):
        app_.ctx.housekeeping = asyncio.get_running_loop().create_task(_housekeeping(app_, registry, metrics))

    @app.after_server_stop  # after the drain: a walk still in flight keeps its upstream connections
    async def _close(app_):
        task = getattr(app_.ctx, "housekeeping", None)
        if task is not None:
            task.cancel()
        await upstream.close()

    return app


async def _housekeeping(app: Sanic, registry: Registry, metrics: RouterMetrics) -> None:
    """Evict members whose heartbeats stopped; probe static members; refresh the gauges."""
    period = max(0.05, registry.heartbeat_interval / 2)
    loop = asyncio.get_running_loop()
    while True:
        try:
            for m in registry.evict_stale():
                metrics.evictions.inc()
                log.warning("evicted %s %s at %s: no heartbeat for %.1fs", m.capability, m.id, m.url, registry.evict_after)
            await _probe_static(app, registry)
            for cap in ("ffn", "embed"):
                metrics.members.labels(cap).set(sum(1 for m in registry.members.values() if m.capability == cap))
            metrics.uncovered.set(sum(len(g) for g in registry.gaps()))
        except asyncio.CancelledError:
            raise
        except Exception:  # housekeeping must outlive any one bad round
            log.exception("housekeeping round failed")
        t0 = loop.time()
        await asyncio.sleep(period)
        # Later than asked: this router was stalled (or starved of CPU) meanwhile; heartbeats that
        # arrived then are still unread, so that time is not the members' silence.
        registry.note_stall(loop.time() - t0 - period)


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
        m.facts = model_facts(s) or m.facts
        m.rss_bytes = int((s.get("memory_mb") or 0) * 2**20)
        if m.consecutive_failures:
            m.consecutive_failures, m.down_until = 0, 0.0
