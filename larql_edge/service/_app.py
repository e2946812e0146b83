"""The app factory every larql-edge server is built from.

`make_app` gives a role a Sanic app that already has what every server needs: the error envelope,
the request metrics under the role's prefix (plus its in-flight and memory gauges), the ops routes
(`larql_edge.service._ops`), a compute pool for work that must not run on the event loop, and the
body and keep-alive limits. The role adds its own blueprints and fills in its `Hooks`.
"""

from __future__ import annotations

from collections.abc import Callable

from sanic import Sanic

from larql_edge.wire import VINDEX_HEADER

from ._compute import Compute
from ._envelope import ErrorBody, install_error_envelope
from ._ops import Hooks
from ._ops import bp as ops_bp
from .metrics import Metrics

# Clients hold one connection for a whole generation (a request per layer per token): keep it open.
KEEP_ALIVE_S = 75


def make_app(name: str, role: str, hooks: Hooks, *, max_body: int, access_log: bool = False,
             compute_threads: int = 1, metrics: Metrics | None = None, error_body: ErrorBody | None = None,
             identity: Callable[[], str | None] | None = None) -> Sanic:
    """``identity()``: the id of the vindex this server answers from, sent on every reply
    (``X-Larql-Vindex``), so a client can refuse to mix two builds of a model in one answer."""
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
    if identity is not None:
        @app.on_response
        async def _identity(request, response):
            ident = identity()
            if ident:
                response.headers[VINDEX_HEADER] = ident

    @app.before_server_stop
    async def _stop_compute(app_):
        compute.shutdown()

    return app
