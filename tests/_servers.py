"""Start a real server (a console script) as a subprocess for a test, and stop it cleanly.

    with running_server("larql-embed", [str(vindex), "--blas-threads", "1"]) as srv:
        httpx.get(srv.url + "/v1/stats")

The server gets 127.0.0.1 and a free port (``--host``/``--port`` are appended), its stdout and
stderr go to a log file, and the helper waits for ``ready_path`` to answer 200. If it never does,
or the process dies, the error carries the log's tail. Stopping sends SIGINT (Sanic's graceful
shutdown), then SIGKILL to the process group after a grace period; the log tail is printed at
teardown, which pytest shows only for failing tests. Reusable for every role (embed, FFN, router).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def console_script(name: str, module: str | None = None) -> list[str]:
    """argv prefix for a console script of this environment (falls back to ``python -m module``)."""
    exe = Path(sys.executable).parent / name
    if exe.is_file():
        return [str(exe)]
    if module:
        return [sys.executable, "-m", module]
    raise FileNotFoundError(f"{name} is not installed (pip install -e . --no-deps)")


class ServerProcess:
    def __init__(self, argv: Sequence[str], port: int, env: dict[str, str] | None = None, ready_path: str = "/v1/ready"):
        self.argv = list(argv)
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.ready_path = ready_path
        self.env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", **(env or {})}
        self._log = tempfile.NamedTemporaryFile(prefix="server-", suffix=".log", delete=False)
        self.log_path = Path(self._log.name)
        self.proc: subprocess.Popen | None = None

    def start(self) -> "ServerProcess":
        self.proc = subprocess.Popen(
            self.argv,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=self.env,
            start_new_session=True,  # its own process group: workers are stopped with it
        )
        return self

    def logs(self, tail: int = 8000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-tail:]
        except OSError:
            return ""

    def wait_ready(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.logs()}")
            try:
                if httpx.get(self.url + self.ready_path, timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"server not ready after {timeout:.0f} s:\n{self.logs()}")

    def stop(self, grace: float = 10.0) -> int | None:
        p = self.proc
        if p is None:
            return None
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGINT)
                p.wait(grace)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(5)
            except ProcessLookupError:
                pass
        self._log.close()
        return p.returncode

    def cleanup(self) -> None:
        self.log_path.unlink(missing_ok=True)


@contextmanager
def running_server(
    script: str,
    args: Sequence[str],
    *,
    module: str | None = None,
    env: dict[str, str] | None = None,
    ready_path: str = "/v1/ready",
    timeout: float = 120.0,
    attempts: int = 3,
) -> Iterator[ServerProcess]:
    """A started, ready server; retried on another port if the chosen one was taken meanwhile."""
    last: Exception | None = None
    for _ in range(attempts):
        port = free_port()
        srv = ServerProcess(
            console_script(script, module) + list(args) + ["--host", "127.0.0.1", "--port", str(port)],
            port,
            env,
            ready_path,
        ).start()
        try:
            srv.wait_ready(timeout)
        except (RuntimeError, TimeoutError) as e:
            srv.stop()
            if "address already in use" in srv.logs().lower():
                last = e
                srv.cleanup()
                continue
            print(srv.logs())
            srv.cleanup()
            raise
        try:
            yield srv
        finally:
            srv.stop()
            print(f"--- {script} log (tail) ---\n{srv.logs()}")
            srv.cleanup()
        return
    raise RuntimeError(f"could not start {script} on a free port: {last}")
