"""Local processes of a grid: start, wait until ready, watch, stop cleanly. The one process helper of
larql-edge: `larql-grid up`, the tests and the benchmarks all start their servers through it.

Each role runs in its own session (process group), so Ctrl-C at the terminal reaches only the
supervisor, which then stops the roles in order (members first, so they leave the router cleanly;
the router last) and kills whatever does not stop in time. On Linux a role also gets SIGTERM if
the supervisor dies, even by SIGKILL. Secrets go through the environment, never argv (argv is
visible to every user of the machine through ps).
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

STOP_GRACE_S = 10.0
# LARQL_ variables that mean the same to every role; any other one (LARQL_SHARDS, LARQL_EMBED,
# LARQL_PORT, ...) was set for some single command and must not leak into the roles we start.
SHARED_ENV = ("LARQL_CACHE_DIR", "LARQL_BACKEND", "LARQL_LOG_LEVEL")


def role_env(base: dict[str, str], **extra: str) -> dict[str, str]:
    env = {k: v for k, v in base.items() if not k.startswith("LARQL_") or k in SHARED_ENV}
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)  # each role keeps its own metrics
    env.update(extra)
    return env


def free_port(host: str = "127.0.0.1") -> int:
    """A port the kernel says is free now (another process may take it before we bind: callers
    that start a server on it retry on 'address already in use')."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def port_free(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def pick_ports(host: str, wanted: list[int], taken: set[int] | None = None) -> list[int]:
    """For each wanted port, that port or the next free one not already given out."""
    taken = set(taken or ())
    out = []
    for p in wanted:
        while p in taken or not port_free(host, p):
            p += 1
            if p > 65535:
                raise RuntimeError("no free port left")
        taken.add(p)
        out.append(p)
    return out


def _die_with_parent() -> None:
    """In the child, before exec: get SIGTERM if the supervisor dies (Linux), so that even a
    supervisor killed with SIGKILL leaves no role running."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


@dataclass
class Role:
    name: str
    argv: list[str]
    url: str
    log_path: Path
    popen: subprocess.Popen | None = None
    info: dict = field(default_factory=dict)
    verify: Any = True  # what the probes verify an https:// role with (an ssl.SSLContext for a grid's own CA)

    @property
    def pid(self) -> int | None:
        return self.popen.pid if self.popen else None

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    def running(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def log_tail(self, n: int = 20) -> str:
        return "\n".join(self.log().splitlines()[-n:])

    def wait_ready(self, timeout: float = 60.0, path: str = "/v1/ready") -> None:
        """Until ``path`` answers 200; raises (with the log's tail) if the role exits or time runs out."""
        deadline = time.monotonic() + timeout
        with httpx.Client(timeout=2.0, verify=self.verify) as client:
            while True:
                if not self.running():
                    code = self.popen.returncode if self.popen else None
                    raise RuntimeError(f"{self.name} exited (code {code}) before it was ready:\n{self.log_tail(40)}")
                try:
                    if client.get(self.url + path).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{self.name} not ready after {timeout:g}s:\n{self.log_tail(40)}")
                time.sleep(0.1)

    def send_signal(self, sig: int) -> None:
        """Send ``sig`` to the role's process group (SIGSTOP freezes it, SIGCONT thaws it)."""
        if self.popen is not None and self.popen.poll() is None:
            _signal_group(self.popen, sig)

    def kill(self, sig: int = signal.SIGKILL, wait: float = 10.0) -> None:
        """Stop the role with ``sig`` (hard by default: a crash, not a clean stop) and reap it."""
        if self.popen is None:
            return
        self.send_signal(sig)
        try:
            self.popen.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            _signal_group(self.popen, signal.SIGKILL)
            self.popen.wait(timeout=5)
        _signal_group(self.popen, signal.SIGKILL)  # a role's own children (workers) share its group

    def stop(self, grace: float = STOP_GRACE_S) -> None:
        """SIGTERM (a clean stop: members leave the grid), SIGKILL after ``grace``."""
        self.kill(signal.SIGTERM, wait=grace)


class Supervisor:
    def __init__(self, log_dir: Path, env: dict[str, str], verify: Any = True):
        self.log_dir = Path(log_dir)
        self.env = env
        self.verify = verify
        self.roles: list[Role] = []
        self.log_dir.mkdir(parents=True, exist_ok=True)

    def start(self, name: str, argv: list[str], url: str, env: dict[str, str] | None = None, **info) -> Role:
        role = Role(name, argv, url, self.log_dir / f"{name}.log", info=info, verify=self.verify)
        log = open(role.log_path, "ab")
        try:
            role.popen = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                          env={**self.env, **(env or {})}, start_new_session=True,
                                          preexec_fn=_die_with_parent if sys.platform == "linux" else None)
        finally:
            log.close()  # the child holds its own descriptor
        self.roles.append(role)
        return role

    def wait_ready(self, roles: list[Role], deadline: float, log=None) -> None:
        """Until every role answers 200 on /v1/ready; raises if one exits or time runs out.
        ``log`` gets a line as each role becomes ready (a start can take tens of seconds)."""
        t0 = time.monotonic()
        for r in roles:
            r.wait_ready(max(0.1, deadline - time.monotonic()))
            if log is not None:
                log(f"larql-grid: {r.name} ready ({time.monotonic() - t0:.1f}s)")

    def exited(self) -> list[Role]:
        return [r for r in self.roles if r.popen is not None and r.popen.poll() is not None]

    def stop_all(self, grace: float = STOP_GRACE_S) -> None:
        """SIGTERM every role (members before the router), then SIGKILL what is left after the grace."""
        for r in reversed(self.roles):
            if r.popen is not None and r.running():
                _signal_group(r.popen, signal.SIGTERM)
        deadline = time.monotonic() + grace
        for r in reversed(self.roles):
            if r.popen is None:
                continue
            try:
                r.popen.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal_group(r.popen, signal.SIGKILL)
                r.popen.wait(timeout=5)
            _signal_group(r.popen, signal.SIGKILL)


def _signal_group(p: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(p.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
