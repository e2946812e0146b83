"""What every server's `main` does around its app: one set of server flags, BLAS pinning, logging,
and running Sanic."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
from collections.abc import Callable
from functools import partial

from sanic import Sanic

from larql_edge.config import Flags, export_blas_threads, kernel_threads
from larql_edge.errors import SetupError
from larql_edge.net.tls import Reloader, TlsSettings, add_tls_flags, client_context, server_context
from larql_edge.service._app import DRAIN_S

log = logging.getLogger("larql.tls")
TLS_POLL_S = 2.0  # how often a server looks for renewed certificate files (cert-manager rewrites a mounted Secret)


def add_server_flags(flags: Flags, port: int, workers: bool = False) -> None:
    """``--host --port --blas-threads --log-level --access-log`` (and ``--workers``), the TLS flags
    (`larql_edge.net.tls`), each with its twin."""
    flags.add("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    flags.add("--port", type=int, default=port, help="port to listen on")
    if workers:
        flags.add("--workers", type=int, default=1, help="worker processes (each maps the same files; metrics add up)")
    flags.add("--blas-threads", type=int, default=1,
              help="BLAS and kernel threads per process (processes sharing a machine must not oversubscribe it; "
                   "LARQL_KERNEL_THREADS sets the kernels' alone)")
    flags.add("--log-level", default="info", help="debug, info, warning or error")
    flags.add("--drain-seconds", type=float, default=DRAIN_S,
              help="on SIGTERM, how long requests in flight have to finish before they are cut")
    flags.switch("--access-log", help="log every request")
    add_tls_flags(flags, server=True)


def pin_blas(threads: int | None) -> None:
    """Limit BLAS/OpenMP threads now (threadpoolctl) and for any process we start (env), and the
    compact kernels' threads with them (one knob, one pool: ``--blas-threads 1`` means one thread of
    products per process) unless ``LARQL_KERNEL_THREADS`` names its own count.

    Why the kernels follow: the roles of a grid share the machine; a product split over two threads
    on a busy 2-core box waits for the second thread to be scheduled (measured: a 1-row lm_head 8 ms on
    one thread, 23 ms on two, load ~11; docs/DESIGN.md §9)."""
    if not threads or threads <= 0:
        return
    export_blas_threads(threads)
    if kernel_threads() is None:
        os.environ["LARQL_KERNEL_THREADS"] = str(threads)  # read by the kernels' first product, and children's
        kernels = sys.modules.get("larql_edge.model.kernels")  # not imported here: the router has no kernels
        if kernels is not None:
            kernels.set_threads(threads)
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
          drain: float = DRAIN_S, tls: TlsSettings | None = None) -> None:
    """Run the app ``factory()`` builds. One worker is one process (what a supervisor stops by its
    pid); more run under Sanic's worker manager, each worker building its own app. SIGTERM drains
    for at most ``drain`` seconds (`make_app`). With ``tls`` serving, the port speaks TLS only, and
    the certificate is reloaded on SIGHUP or when its files change."""
    factory = partial(_with_drain, factory, drain)
    if tls is not None and tls.serving:
        if workers > 1:
            # Sanic hands each worker a copy of the context: a reload or a client CA would not reach them.
            raise SetupError("TLS with --workers > 1 is not supported: run one worker per process")
        app = factory()
        ctx = server_context(tls)
        _install_reload(app, Reloader(tls, [ctx], [client_context()]))
        app.run(host=host, port=port, single_process=True, access_log=access_log, motd=False, ssl=ctx)
        return
    if workers <= 1:
        app = factory()
        if tls is not None and tls.ca:
            # plain HTTP here, https:// upstreams: their CA file is still watched
            _install_reload(app, Reloader(tls, [], [client_context()]))
        app.run(host=host, port=port, single_process=True, access_log=access_log, motd=False)
        return
    from sanic.worker.loader import AppLoader

    loader = AppLoader(factory=partial(factory))
    app = loader.load()
    app.prepare(host=host, port=port, workers=workers, access_log=access_log, motd=False)
    Sanic.serve(primary=app, app_loader=loader)


def _install_reload(app: Sanic, reloader: Reloader) -> None:
    """SIGHUP reloads at once; a poll catches renewed files (certificate, key and CA files). Either
    way only new connections see it."""
    app.ctx.tls_reloader = reloader

    async def poll() -> None:
        while True:
            await asyncio.sleep(TLS_POLL_S)
            reloader.check()

    @app.after_server_start
    async def _start_tls_reload(app):
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGHUP, reloader.reload)
        app.ctx.tls_poll = loop.create_task(poll())

    @app.before_server_stop
    async def _stop_tls_reload(app):
        app.ctx.tls_poll.cancel()
        asyncio.get_running_loop().remove_signal_handler(signal.SIGHUP)


def _with_drain(factory: Callable[[], Sanic], drain: float) -> Sanic:
    app = factory()
    app.config.GRACEFUL_SHUTDOWN_TIMEOUT = max(0.0, drain)
    return app
