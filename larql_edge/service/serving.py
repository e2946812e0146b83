"""What every server's `main` does around its app: one set of server flags, BLAS pinning, logging,
and running Sanic."""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from functools import partial

from sanic import Sanic

from larql_edge.config import Flags, export_blas_threads
from larql_edge.service._app import DRAIN_S


def add_server_flags(flags: Flags, port: int, workers: bool = False) -> None:
    """``--host --port --blas-threads --log-level --access-log`` (and ``--workers``), each with its twin."""
    flags.add("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    flags.add("--port", type=int, default=port, help="port to listen on")
    if workers:
        flags.add("--workers", type=int, default=1, help="worker processes (each maps the same files; metrics add up)")
    flags.add("--blas-threads", type=int, default=1,
              help="BLAS threads per process (processes sharing a machine must not oversubscribe it)")
    flags.add("--log-level", default="info", help="debug, info, warning or error")
    flags.add("--drain-seconds", type=float, default=DRAIN_S,
              help="on SIGTERM, how long requests in flight have to finish before they are cut")
    flags.switch("--access-log", help="log every request")


def pin_blas(threads: int | None) -> None:
    """Limit BLAS/OpenMP threads now (threadpoolctl) and for any process we start (env)."""
    if not threads or threads <= 0:
        return
    export_blas_threads(threads)
    from threadpoolctl import threadpool_limits

    threadpool_limits(threads)


def setup_logging(level: str) -> None:
    # Our loggers only ("larql.*"): Sanic configures and prints its own, and a root handler
    # would print each of its lines twice.
    log = logging.getLogger("larql")
    if not log.handlers:
        h = logging.StreamHandler(sys.stderr)
        h.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        log.addHandler(h)
    log.setLevel(getattr(logging, level.upper(), logging.INFO))
    log.propagate = False


def serve(factory: Callable[[], Sanic], host: str, port: int, workers: int = 1, access_log: bool = False,
          drain: float = DRAIN_S) -> None:
    """Run the app ``factory()`` builds. One worker is one process (what a supervisor stops by its
    pid); more run under Sanic's worker manager, each worker building its own app. SIGTERM drains
    for at most ``drain`` seconds (`make_app`)."""
    factory = partial(_with_drain, factory, drain)
    if workers <= 1:
        factory().run(host=host, port=port, single_process=True, access_log=access_log, motd=False)
        return
    from sanic.worker.loader import AppLoader

    loader = AppLoader(factory=partial(factory))
    app = loader.load()
    app.prepare(host=host, port=port, workers=workers, access_log=access_log, motd=False)
    Sanic.serve(primary=app, app_loader=loader)


def _with_drain(factory: Callable[[], Sanic], drain: float) -> Sanic:
    app = factory()
    app.config.GRACEFUL_SHUTDOWN_TIMEOUT = max(0.0, drain)
    return app
