"""The app factory every larql-edge server is built from.

`make_app` gives a role a Sanic app that already has what every server needs: the error envelope,
the request metrics under the role's prefix (plus its in-flight and memory gauges), the ops routes
(`larql_edge.service._ops`), a ``Server-Timing`` header on every reply, a compute pool for work that
must not run on the event loop, and the body and keep-alive limits. The role adds its own
blueprints and fills in its `Hooks`.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from sanic import Sanic

from larql_edge.net.hops import SERVER_TIMING, server_timing_value
from larql_edge.wire import VINDEX_HEADER

from ._compute import Compute
from ._envelope import MAX_HEAD_BYTES, ErrorBody, install_error_envelope
from ._ops import Hooks
from ._ops import bp as ops_bp
from .metrics import Metrics

# Clients hold one connection for a whole generation (a request per layer per token): keep it open.
KEEP_ALIVE_S = 75
# SIGTERM drains: what is in flight then has this long to finish (serve: its sequences, then Sanic's
# wait for the connections), after which it is cut. Kubernetes' default grace is 30 s. Each server's
# --drain-seconds sets it (app.config.GRACEFUL_SHUTDOWN_TIMEOUT).
DRAIN_S = 10.0
# A request queued behind others for the compute thread (or, at the router, behind the work it has in
# flight to a member) waits its turn: Sanic's default 60 s cut answered eight concurrent largest
# requests on a busy host with 503s. Every wait inside is bounded on its own (compute per request, the
# router's hop timeouts), so this only catches a handler that never ends.
RESPONSE_TIMEOUT_S = 900


def make_app(name: str, role: str, hooks: Hooks, *, max_body: int, access_log: bool = False,
             compute_threads: int = 1, metrics: Metrics | None = None, error_body: ErrorBody | None = None,
             identity: Callable[[], str | None] | None = None) -> Sanic:
    """``identity()``: the id of the vindex this server answers from, sent on every reply
    (``X-Larql-Vindex``), so a client can refuse to mix two builds of a model in one answer."""
    app = Sanic(name)
    app.config.REQUEST_MAX_SIZE = max_body
    app.config.REQUEST_MAX_HEADER_SIZE = MAX_HEAD_BYTES  # Sanic's most (8 KB by default): a GET's query string
    app.config.KEEP_ALIVE_TIMEOUT = KEEP_ALIVE_S
    app.config.ACCESS_LOG = access_log
    app.config.MOTD = False
    app.config.GRACEFUL_SHUTDOWN_TIMEOUT = DRAIN_S
    app.config.RESPONSE_TIMEOUT = RESPONSE_TIMEOUT_S
    app.ctx.hooks = hooks
    app.ctx.draining = False
    app.ctx.compute = compute = Compute(compute_threads, name=f"{role}-compute")
    app.ctx.metrics = metrics = metrics or Metrics(role)
    metrics.track_inflight(lambda: hooks.inflight())
    install_error_envelope(app, error_body)
    metrics.install(app)
    app.blueprint(ops_bp)
    # SIGTERM (or SIGINT) drains, first of every stop listener: readiness goes false at once, the
    # routers are left, the role finishes what it holds (`Hooks.drain`), and every reply from now on
    # closes its connection, so a client's next request goes elsewhere (or, refused, is retried)
    # instead of keeping a busy keep-alive connection here until it is cut. Sanic then closes the
    # listener and the idle connections and waits up to DRAIN_S for the busy ones.
    async def _drain(app_):
        app_.ctx.draining = True
        membership = getattr(app_.ctx, "membership", None)
        if membership is not None:
            await membership.handover()  # --handover-seconds: a successor joins the routers first
            membership.stop()  # its task leaves the routers now; its own stop listener awaits it
        if hooks.drain is not None:
            await hooks.drain(app_.config.GRACEFUL_SHUTDOWN_TIMEOUT)

    app.register_listener(_drain, "before_server_stop", priority=1_000_000)

    # One response middleware for what every reply carries (each middleware is a coroutine per
    # request: on a 1-row FFN hop that is measurable, benchmarks/ffn_profile.py).
    @app.on_response(priority=-999)
    async def _every_reply(request, response):
        if request.app.ctx.draining:
            request.stream.keep_alive = False
        headers = response.headers
        if identity is not None:
            ident = identity()
            if ident:
                headers[VINDEX_HEADER] = ident
        # Every server says what it spent on a request, so a client can tell its network time from
        # the server's (`larql generate --timings`). Sanic stamps perf_counter() when the handler starts.
        t0 = getattr(request.stream, "perft0", None)
        if t0 is not None:
            headers[SERVER_TIMING] = server_timing_value(time.perf_counter() - t0)

    @app.after_server_stop
    async def _stop_compute(app_):
        compute.shutdown()  # after the connections: a request still in flight keeps its compute thread

    return app
