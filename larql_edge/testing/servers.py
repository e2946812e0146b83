"""Real servers for tests and benchmarks: in this process (a thread), or as console-script processes.

- `ServerThread(app)`: a Sanic app serving real HTTP on 127.0.0.1 from a thread of this process,
  with its own event loop and every listener run (models load, members join, housekeeping runs).
  What the fast test tier uses: no interpreter start, no second copy of a model in memory.
- `running_server(script, args)`: the console script as a process (through the grid supervisor,
  the one process helper), on a free port, waited for until ready; its log is printed at the end.
"""

from __future__ import annotations

import asyncio
import os
import sys
import tempfile
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from sanic import Sanic

from larql_edge.tools.grid.supervisor import Role, Supervisor, free_port, role_env

# Tests build several apps of the same role in one process; Sanic refuses duplicate names otherwise.
Sanic.test_mode = True
# Sanic compiles its router when a server starts. CPython 3.11 (before 3.11.8, gh-106905) can fail
# compiles run in two threads at once ("AST constructor recursion depth mismatch"): one at a time.
_STARTING = threading.Lock()


class ServerThread:
    """``with ServerThread(app) as s: httpx.get(s.url + "/v1/health")``."""

    def __init__(self, app: Sanic, port: int | None = None, ready_timeout: float = 30.0):
        self.app = app
        app.config.MOTD = False  # its banner asks `uname -p` (a subprocess) for the platform
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.ready_timeout = ready_timeout
        self.loop: asyncio.AbstractEventLoop | None = None  # made (and closed) by the server's own thread
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._server: Any = None
        self._thread = threading.Thread(target=self._run, name=f"server-{app.name}", daemon=True)

    def _run(self) -> None:
        self.loop = loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)

        async def main() -> None:
            with _STARTING:
                self._server = await self.app.create_server(host="127.0.0.1", port=self.port,
                                                            return_asyncio_server=True, access_log=False)
                await self._server.startup()
            await self._server.before_start()
            await self._server.after_start()
            self._ready.set()
            await self._server.serve_forever()

        try:
            loop.run_until_complete(main())
        except asyncio.CancelledError:
            pass
        except BaseException as e:  # reported to the starting thread
            self._error = e
            self._ready.set()
        finally:
            # Whatever is left (a cancelled task's last step, async generators) runs, then the loop
            # and its sockets close: a leaked one would be finalised later, at a random moment.
            try:
                pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
                for t in pending:
                    t.cancel()
                loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
                loop.run_until_complete(loop.shutdown_asyncgens())
            finally:
                loop.close()

    def start(self) -> "ServerThread":
        self._thread.start()
        if not self._ready.wait(self.ready_timeout):
            raise TimeoutError(f"{self.app.name} did not start in {self.ready_timeout:g}s")
        if self._error is not None:
            raise RuntimeError(f"{self.app.name} failed to start: {self._error!r}")
        return self

    def stop(self) -> None:
        if self._server is None or not self._thread.is_alive():
            return

        async def shutdown() -> None:
            await self._server.before_stop()
            self._server.close()
            await self._server.wait_closed()
            await self._server.after_stop()
            for task in asyncio.all_tasks():
                if task is not asyncio.current_task():
                    task.cancel()

        assert self.loop is not None
        asyncio.run_coroutine_threadsafe(shutdown(), self.loop).result(15)
        self._thread.join(15)  # serve_forever was cancelled: the thread closes its loop and ends

    def run(self, coro, timeout: float = 30.0):
        """Run a coroutine on the server's loop (to poke at app state the way a handler would)."""
        assert self.loop is not None, "the server is not running"
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def __enter__(self) -> "ServerThread":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def console_script(name: str) -> list[str]:
    """argv prefix for a console script of this environment (beside this interpreter, or on PATH)."""
    exe = Path(sys.executable).parent / name
    return [str(exe)] if exe.is_file() else [name]


def server_env(**extra: str) -> dict[str, str]:
    """The environment of a started server: no stray LARQL_* flag twins, one BLAS thread."""
    return role_env(dict(os.environ), OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1",
                    PYTHONUNBUFFERED="1", **extra)


def start_server(script: str, args: Sequence[str], *, port: int | None = None, env: dict[str, str] | None = None,
                 log_dir: Path | None = None) -> Role:
    """Start a console-script server on 127.0.0.1 (``port`` or a free one); the caller waits and stops it."""
    port = port or free_port()
    sup = Supervisor(log_dir or Path(tempfile.mkdtemp(prefix=f"{script}-")), server_env(**(env or {})))
    return sup.start(script, console_script(script) + list(args) + ["--host", "127.0.0.1", "--port", str(port)],
                     f"http://127.0.0.1:{port}")


@contextmanager
def running_server(script: str, args: Sequence[str], *, env: dict[str, str] | None = None,
                   ready_path: str = "/v1/ready", timeout: float = 120.0, attempts: int = 3,
                   log_dir: Path | None = None) -> Iterator[Role]:
    """A started, ready console-script server; retried on another port if the one chosen was taken."""
    sup = Supervisor(log_dir or Path(tempfile.mkdtemp(prefix=f"{script}-")), server_env(**(env or {})))
    last: Exception | None = None
    for attempt in range(attempts):
        port = free_port()
        role = sup.start(f"{script}-{attempt}", console_script(script) + list(args) + ["--host", "127.0.0.1", "--port", str(port)],
                         f"http://127.0.0.1:{port}")
        try:
            role.wait_ready(timeout, ready_path)
        except (RuntimeError, TimeoutError) as e:
            role.kill()
            if "address already in use" in role.log().lower():
                last = e
                continue
            print(role.log()[-8000:])
            raise
        try:
            yield role
        finally:
            role.stop()
            print(f"--- {script} log (tail) ---\n{role.log()[-8000:]}")
        return
    raise RuntimeError(f"could not start {script} on a free port: {last}")
