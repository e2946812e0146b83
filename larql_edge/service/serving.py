"""What every grid role's `main` does around its app: BLAS pinning, logging, and running Sanic."""

from __future__ import annotations

import logging
import os
import sys

from sanic import Sanic

from larql_edge.config import Flags


def add_server_flags(flags: Flags, port: int) -> None:
    flags.add("--host", default="127.0.0.1", help="address to listen on")
    flags.add("--port", type=int, default=port, help="port to listen on")
    flags.add("--blas-threads", type=int, default=1,
              help="BLAS threads for this process (processes sharing a machine must not oversubscribe it)")
    flags.add("--log-level", default="info", help="debug, info, warning or error")


def pin_blas(threads: int | None) -> None:
    """Limit BLAS/OpenMP threads now (threadpoolctl) and for any child we might start (env)."""
    if not threads or threads <= 0:
        return
    for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = str(threads)
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


def run(app: Sanic, host: str, port: int) -> None:
    # One process per role: the grid scales by starting more roles, not more workers, and a
    # single process is what the supervisor (larql-grid, tests) can stop by its id.
    app.run(host=host, port=port, single_process=True, access_log=False, motd=False)
