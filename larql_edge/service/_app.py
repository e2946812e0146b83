"""The app factory every larql-edge server is built from.

`make_app` gives a role a Sanic app that already has what every server needs: the error envelope,
the request metrics under the role's prefix (plus its in-flight and memory gauges), the ops routes
(`larql_edge.service._ops`), a ``Server-Timing`` header on every reply, a compute pool for work that
must not run on the event loop, and the body and keep-alive limits. The role adds its own
blueprints and fills in its `Hooks`.
"""

from __future__ import annotations

import time

from sanic import Sanic

from larql_edge.net.hops import SERVER_TIMING, server_timing_value

from ._compute import Compute
from ._envelope import ErrorBody, install_error_envelope
from ._ops import Hooks
from ._ops import bp as ops_bp
from .metrics import Metrics

# Clients hold one connection for a whole generation (a request per layer per token): keep it open.
KEEP_ALIVE_S = 75


def make_app(name: str, role: str, hooks: Hooks, *, max_body: int, access_log: bool = False,
             compute_threads: int = 1, metrics: Metrics | None = None, error_body: ErrorBody | None = None) -> Sanic:
    app = Sanic(name)
    app.config.REQUEST_MAX_SIZE = max_body
    app.config.KEEP_ALIVE_TIMEOUT = KEEP_ALIVE_S
    app.config.ACCESS_LOG = access_log
    app.config.MOTD = False
    app.ctx.hooks = hooks
    app.ctx.draining = False
    app.ctx.compute = compute = Compute(compute_threads, name=f"{role}-compute")
    app.ctx.metrics = metrics = metrics or Metrics(role)
    metrics.track_inflight(lambda: hooks.inflight())
    install_error_envelope(app, error_body)
    metrics.install(app)
    app.blueprint(ops_bp)

    @app.on_response(priority=-999)
    async def _server_timing(request, response):
        # Every server says what it spent on a request, so a client can tell its network time from
        # the server's (`larql generate --timings`). Sanic stamps perf_counter() when the handler starts.
        t0 = getattr(request.stream, "perft0", None)
        if t0 is not None:
            response.headers[SERVER_TIMING] = server_timing_value(time.perf_counter() - t0)

    @app.before_server_stop
    async def _stop_compute(app_):
        compute.shutdown()

    return app
