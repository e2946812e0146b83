"""Real nginx and varnishd in front of embed servers, for tests and benchmarks.

    with running_edge("nginx", [origin_url]) as edge:        # or "varnish"
        httpx.get(edge.url + "/v1/embed/5")

Each proxy runs from Debian's package (``apt-get install nginx varnish``; ``scripts/setup test``
installs them) as a foreground process in its own process group, on 127.0.0.1 and a free port,
with a fresh temp folder for its cache, pid file, work dir and logs. The shipped configs
(``deploy/nginx/nginx.conf``, ``deploy/varnish/default.vcl``) are used as they are except for the
listen port and the upstream addresses, which are the only things templated in. Startup waits for
the port (and, with ``wait_origin``, for the origin's /v1/ready through the proxy); any failure
raises with the proxy's logs. Stopping is always done: SIGTERM, then SIGKILL of the whole group.

How the processes run, unprivileged-friendly:
- nginx: ``nginx -p PREFIX/ -c PREFIX/nginx.conf -e PREFIX/logs/error.log -g 'daemon off;'``; every
  path of the shipped config is prefix-relative. As root, nginx hands cache and temp folders to
  its worker user, so the prefix is made world-traversable (0755).
- varnishd: ``varnishd -F -j none -a 127.0.0.1:PORT -f VCL -n WORKDIR -s malloc,64m -T none``;
  ``-j none`` keeps every varnishd process as the calling user (root or not), so nothing needs to
  be readable by Varnish's own users.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from larql_edge.tools.grid.supervisor import free_port

REPO = Path(__file__).resolve().parents[2]  # the source checkout: deploy/ is not part of the wheel
NGINX_CONF = REPO / "deploy" / "nginx" / "nginx.conf"
VARNISH_VCL = REPO / "deploy" / "varnish" / "default.vcl"
KINDS = ("nginx", "varnish")


def find_program(name: str) -> str | None:
    """``nginx`` / ``varnishd`` live in /usr/sbin, which is not on every user's PATH."""
    return shutil.which(name) or next((p for p in (f"/usr/sbin/{name}", f"/usr/local/sbin/{name}") if os.access(p, os.X_OK)), None)


def require_program(name: str) -> str:
    path = find_program(name)
    if path is None:
        pkg = "varnish" if name == "varnishd" else name
        raise FileNotFoundError(f"{name} not found: apt-get install {pkg} (scripts/setup test installs it)")
    return path


def _hostport(upstream: str) -> tuple[str, str]:
    u = re.sub(r"^https?://", "", upstream).rstrip("/")
    host, _, port = u.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"upstream {upstream!r}: want host:port or http://host:port")
    return host, port


# -- templating: the port and the upstreams, nothing else ------------------------------------------

def render_nginx(text: str, port: int, upstreams: Sequence[str], host: str = "127.0.0.1") -> str:
    """The shipped nginx.conf with ``listen 8080;`` and the upstream ``server`` line rewritten."""
    text, n = re.subn(r"(?m)^(\s*)listen\s+8080;", rf"\g<1>listen {host}:{port};", text)
    if n != 1:
        raise ValueError(f"nginx.conf: expected one 'listen 8080;' line, found {n}")

    def servers(m: re.Match) -> str:
        indent, params = m.group(1), m.group(2) or ""
        return "\n".join(f"{indent}server {':'.join(_hostport(u))}{params};" for u in upstreams)

    text, n = re.subn(r"(?m)^(\s*)server\s+127\.0\.0\.1:8082((?:\s+[^;\s]+)*);", servers, text)
    if n != 1:
        raise ValueError(f"nginx.conf: expected one 'server 127.0.0.1:8082 ...;' upstream line, found {n}")
    return text


def render_vcl(text: str, upstreams: Sequence[str]) -> str:
    """The shipped VCL with backend ``embed1``'s host/port set; extra upstreams get copies of its block."""
    m = re.search(r"(?ms)^backend embed1 \{.*?^\}\n", text)
    if m is None:
        raise ValueError("default.vcl: no 'backend embed1 { ... }' block")
    if "larql.add_backend(embed1);" not in text:
        raise ValueError("default.vcl: no 'larql.add_backend(embed1);' line")
    blocks, adds = [], []
    for i, u in enumerate(upstreams, 1):
        host, port = _hostport(u)
        b = m.group(0).replace("backend embed1 ", f"backend embed{i} ")
        b, nh = re.subn(r'\.host = "[^"]*";', f'.host = "{host}";', b)
        b, np_ = re.subn(r'\.port = "[^"]*";', f'.port = "{port}";', b)
        if nh != 1 or np_ != 1:
            raise ValueError("default.vcl: backend embed1 must have one .host and one .port")
        blocks.append(b)
        adds.append(f"larql.add_backend(embed{i});")
    text = text[: m.start()] + "\n".join(blocks) + text[m.end():]
    return text.replace("larql.add_backend(embed1);", "\n    ".join(adds))


# -- processes --------------------------------------------------------------------------------------

class EdgeProcess:
    """One proxy process (and its children) with its own temp folder; see the module doc."""

    kind = "edge"

    def __init__(self, upstreams: Sequence[str], port: int | None = None, keep_dir: bool = False):
        self.upstreams = list(upstreams)
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.dir = Path(tempfile.mkdtemp(prefix=f"larql-{self.kind}-"))
        self.dir.chmod(0o755)
        self.keep_dir = keep_dir
        self.proc: subprocess.Popen | None = None
        self._out_path = self.dir / "process.log"
        self._out: Any = None

    # subclasses: argv(), log_files()
    def argv(self) -> list[str]:
        raise NotImplementedError

    def log_files(self) -> list[Path]:
        return [self._out_path]

    def logs(self, tail: int = 6000) -> str:
        parts = []
        for p in self.log_files():
            try:
                parts.append(f"--- {p.name}\n{p.read_text(errors='replace')[-tail:]}")
            except OSError:
                pass
        return "\n".join(parts)

    def start(self, timeout: float = 60.0) -> "EdgeProcess":
        argv = self.argv()
        self._out = open(self._out_path, "wb")
        self.proc = subprocess.Popen(argv, stdout=self._out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     start_new_session=True, cwd=self.dir)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.kind} exited with {self.proc.returncode}: {' '.join(argv)}\n{self.logs()}")
            if self._listening():
                return self
            time.sleep(0.05)
        raise TimeoutError(f"{self.kind} not listening on {self.port} after {timeout}s\n{self.logs()}")

    def _listening(self) -> bool:
        """Our process (or one of its children) listens on the port: a connect alone could reach another's socket."""
        import psutil

        if self.proc is None:
            return False
        try:
            root = psutil.Process(self.proc.pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return False
        for p in procs:
            try:
                if any(c.status == psutil.CONN_LISTEN and c.laddr.port == self.port for c in p.net_connections("tcp")):
                    return True
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        return False

    def wait_origin(self, timeout: float = 60.0, path: str = "/v1/ready") -> None:
        """Wait until the origin answers ``path`` with 200 *through* the proxy (e.g. Varnish's probe is healthy)."""
        deadline = time.monotonic() + timeout
        last = None
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"{self.kind} exited with {self.proc.returncode}\n{self.logs()}")
            try:
                r = httpx.get(self.url + path, timeout=2.0)
                if r.status_code == 200:
                    return
                last = f"{r.status_code} {r.text[:200]}"
            except httpx.HTTPError as e:
                last = repr(e)
            time.sleep(0.1)
        raise TimeoutError(f"origin not ready through {self.kind} after {timeout}s (last: {last})\n{self.logs()}")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, grace: float = 10.0) -> None:
        p = self.proc
        if p is not None and p.poll() is None:
            for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
                try:
                    os.killpg(p.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    p.wait(wait)
                    break
                except subprocess.TimeoutExpired:
                    continue
        if p is not None:
            # Workers of the group that outlived their master (never expected): don't leak them.
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        if self._out is not None:
            self._out.close()
            self._out = None

    def cleanup(self) -> None:
        if not self.keep_dir:
            shutil.rmtree(self.dir, ignore_errors=True)


class NginxEdge(EdgeProcess):
    kind = "nginx"

    def __init__(self, upstreams: Sequence[str], port: int | None = None,
                 conf_text: Callable[[int], str] | None = None, **kw):
        """``conf_text(port)``: a whole config to run instead of the shipped one (the benchmark's static baseline)."""
        super().__init__(upstreams, port, **kw)
        (self.dir / "logs").mkdir()
        if conf_text is not None:
            text = conf_text(self.port)
        else:
            text = render_nginx(NGINX_CONF.read_text(), self.port, self.upstreams)
        self.conf = self.dir / "nginx.conf"
        self.conf.write_text(text)

    def argv(self) -> list[str]:
        return [require_program("nginx"), "-p", f"{self.dir}/", "-c", str(self.conf),
                "-e", str(self.dir / "logs" / "error.log"), "-g", "daemon off;"]

    def log_files(self) -> list[Path]:
        return [self._out_path, self.dir / "logs" / "error.log"]

    def access_log(self) -> str:
        # nginx buffers the access log (flush=1s): callers that need it should wait or stop first.
        try:
            return (self.dir / "logs" / "access.log").read_text(errors="replace")
        except OSError:
            return ""


class VarnishEdge(EdgeProcess):
    kind = "varnish"

    def __init__(self, upstreams: Sequence[str], port: int | None = None, storage: str = "malloc,64m",
                 params: Sequence[str] = (), **kw):
        super().__init__(upstreams, port, **kw)
        self.vcl = self.dir / "default.vcl"
        self.vcl.write_text(render_vcl(VARNISH_VCL.read_text(), self.upstreams))
        self.storage = storage
        self.params = list(params)

    def argv(self) -> list[str]:
        argv = [require_program("varnishd"), "-F", "-j", "none", "-a", f"127.0.0.1:{self.port}",
                "-f", str(self.vcl), "-n", str(self.dir / "work"), "-s", self.storage, "-T", "none"]
        for p in self.params:
            argv += ["-p", p]
        return argv


def make_edge(kind: str, upstreams: Sequence[str], **kw) -> EdgeProcess:
    if kind == "nginx":
        return NginxEdge(upstreams, **kw)
    if kind == "varnish":
        return VarnishEdge(upstreams, **kw)
    raise ValueError(f"unknown edge {kind!r} (one of {KINDS})")


@contextmanager
def running_edge(kind: str, upstreams: Sequence[str], *, wait_origin: bool = True, timeout: float = 60.0,
                 attempts: int = 3, **kw) -> Iterator[EdgeProcess]:
    """A started proxy in front of ``upstreams``, stopped (and its temp folder removed) on exit.

    Retried on another free port when the chosen one was taken in the meantime.
    """
    for attempt in range(attempts):
        edge = make_edge(kind, upstreams, **kw)
        try:
            edge.start()
        except (RuntimeError, TimeoutError):
            in_use = "in use" in edge.logs().lower()
            edge.stop()
            if in_use and "port" not in kw and attempt + 1 < attempts:
                edge.cleanup()
                continue
            print(f"--- {kind} logs ---\n{edge.logs()}")
            edge.cleanup()
            raise
        break
    try:
        if wait_origin:
            edge.wait_origin(timeout)
        yield edge
    except BaseException:
        print(f"--- {kind} logs ---\n{edge.logs()}")
        raise
    finally:
        edge.stop()
        edge.cleanup()


# -- config checks (the shipped files, unmodified) -----------------------------------------------

def nginx_check(conf: Path = NGINX_CONF) -> subprocess.CompletedProcess:
    """``nginx -t`` on ``conf`` as it is, with a throwaway prefix (holding logs/) for its relative paths."""
    prefix = Path(tempfile.mkdtemp(prefix="larql-nginx-t-"))
    try:
        prefix.chmod(0o755)
        (prefix / "logs").mkdir()
        return subprocess.run([require_program("nginx"), "-t", "-p", f"{prefix}/", "-c", str(conf),
                               "-e", str(prefix / "logs" / "error.log")],
                              capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    finally:
        shutil.rmtree(prefix, ignore_errors=True)


def varnish_check(vcl: Path = VARNISH_VCL) -> subprocess.CompletedProcess:
    """``varnishd -C`` on ``vcl`` as it is (compiles the VCL to C; prints the C on stderr)."""
    work = Path(tempfile.mkdtemp(prefix="larql-varnish-C-"))
    try:
        return subprocess.run([require_program("varnishd"), "-C", "-j", "none", "-f", str(vcl), "-n", str(work / "w")],
                              capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    finally:
        shutil.rmtree(work, ignore_errors=True)
