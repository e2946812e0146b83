"""Real grid processes on loopback for the tests: start, wait until ready, always clean up.

Each process runs in its own session (process group) so stopping it also stops anything it
started; `Procs` stops everything it started, even when a test fails. Every wait is bounded.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

GRID_KEY = "test-grid-key-0123456789"  # the tests' key; asserted absent from every log


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env(**extra: str) -> dict[str, str]:
    """The environment of a started role: hermetic (no stray LARQL_* flag twins), 1 BLAS thread."""
    from larql_edge.tools.grid.supervisor import role_env

    return role_env(dict(os.environ), OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1",
                    PYTHONUNBUFFERED="1", **extra)


class Proc:
    def __init__(self, name: str, argv: list[str], port: int | None, env: dict[str, str], logdir: Path):
        self.name, self.argv, self.port = name, argv, port
        self.log_path = logdir / f"{name}.log"
        self._log = open(self.log_path, "wb")
        self.popen = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                      start_new_session=True, stdin=subprocess.DEVNULL)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = 60.0, path: str = "/v1/ready") -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.popen.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.popen.returncode}:\n{self.log()[-3000:]}")
            try:
                if httpx.get(self.url + path, timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"{self.name} not ready after {timeout}s:\n{self.log()[-3000:]}")

    def alive(self) -> bool:
        return self.popen.poll() is None

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Kill the process group (hard by default: a crash, not a clean stop)."""
        if self.popen.poll() is None:
            try:
                os.killpg(self.popen.pid, sig)
            except ProcessLookupError:
                pass
        try:
            self.popen.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(self.popen.pid, signal.SIGKILL)
            self.popen.wait(timeout=10)

    def stop(self) -> None:
        self.kill(signal.SIGTERM)
        if not self._log.closed:
            self._log.close()


class Procs:
    """Starts grid roles; a context manager that stops them all on exit."""

    def __init__(self, logdir: Path | None = None, **env: str):
        self.logdir = Path(logdir or tempfile.mkdtemp(prefix="larql-grid-test-"))
        self.env = child_env(LARQL_GRID_KEY=GRID_KEY, **env)
        self.procs: list[Proc] = []

    def __enter__(self) -> "Procs":
        return self

    def __exit__(self, *exc) -> None:
        self.stop_all()

    def stop_all(self) -> None:
        for p in reversed(self.procs):
            p.stop()

    def start(self, name: str, script: str, *args: str, port: int | None = None, env: dict | None = None,
              with_port: bool = True) -> Proc:
        port = port or free_port()
        argv = [script, *args] + (["--port", str(port)] if with_port else [])
        p = Proc(name, argv, port, dict(self.env, **(env or {})), self.logdir)
        self.procs.append(p)
        return p

    def router(self, *args: str, name: str = "router", port: int | None = None) -> Proc:
        return self.start(name, "larql-router", "--heartbeat-interval", "0.25", *args, port=port)

    def shard(self, vindex: Path, layers: str, router: Proc | None, name: str | None = None, *args: str) -> Proc:
        join = ["--join", router.url] if router is not None else []
        return self.start(name or f"ffn-{layers}", "larql-ffn", str(vindex), "--layers", layers, *join, *args)

    def embed(self, vindex: Path, router: Proc | None, name: str = "embed", *args: str) -> Proc:
        join = ["--join", router.url] if router is not None else []
        return self.start(name, "larql-embed", str(vindex), *join, *args)

    def logs(self) -> str:
        return "\n".join(f"== {p.name}\n{p.log()}" for p in self.procs)


def wait_grid(router_url: str, *, complete: bool = True, embed: int = 0, members: int | None = None,
              timeout: float = 30.0) -> dict:
    """Poll GET /v1/grid until it has full coverage / the embed members / the member count asked."""
    deadline = time.monotonic() + timeout
    view: dict = {}
    while time.monotonic() < deadline:
        try:
            view = httpx.get(router_url + "/v1/grid", timeout=2.0).json()
            if ((not complete or view["complete"]) and view["embed"] >= embed
                    and (members is None or len(view["members"]) == members)):
                return view
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.1)
    raise TimeoutError(f"grid at {router_url} not as expected after {timeout}s: {view}")


def larql(*args: str, timeout: float = 120.0, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["larql", *args], capture_output=True, text=True, timeout=timeout,
                          env=child_env(**(env or {})), stdin=subprocess.DEVNULL)


PY = sys.executable


class StubEmbed:
    """A minimal embed server in a thread, written from the wire spec (DESIGN.md §1) over the local
    model code: POST /v1/embed and /v1/logits (binary), GET /v1/embed/{id}, /v1/token/encode,
    /v1/ready, /v1/stats. It lets the router proxy and the remote providers be tested on their own.
    """

    def __init__(self, vindex: Path):
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        from larql_edge.model.forward import LocalEmbed, LocalHead
        from larql_edge.model.spec import ModelSpec
        from larql_edge.wire import embed as ew
        from larql_edge.format.vindex import Vindex

        vx = Vindex.open(vindex)
        spec = ModelSpec.from_index(vx.index)
        emb, head = LocalEmbed(vx, spec), LocalHead(vx, spec)
        self.requests: list[str] = []
        stub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):
                pass

            def _send(self, status, body, ctype="application/x-larql-ffn", headers=None):
                self.send_response(status)
                self.send_header("content-type", ctype)
                self.send_header("content-length", str(len(body)))
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(body)

            def _error(self, status, msg):
                import json as j

                self._send(status, j.dumps({"error": msg}).encode(), "application/json")

            def do_GET(self):
                import json as j

                stub.requests.append(f"GET {self.path}")
                if self.path in ("/v1/ready", "/v1/health"):
                    return self._send(200, b'{"ready": true}', "application/json")
                if self.path == "/v1/stats":
                    return self._send(200, j.dumps({"model": vx.model, "hidden_size": spec.hidden_size}).encode(),
                                      "application/json")
                if self.path.startswith("/v1/embed/"):
                    i = int(self.path.rsplit("/", 1)[1])
                    return self._send(200, ew.encode_row(emb.embed([i])[0]), headers={"etag": f'"row-{i}"'})
                if self.path.startswith("/v1/token/encode"):
                    return self._send(200, b'{"token_ids": [1]}', "application/json")
                return self._error(404, "no route")

            def do_POST(self):
                stub.requests.append(f"POST {self.path}")
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                try:
                    if self.path == "/v1/embed":
                        return self._send(200, ew.encode_embed_response(emb.embed(ew.decode_embed_request(body))))
                    if self.path == "/v1/logits":
                        h = ew.decode_logits_request(body, spec.hidden_size)
                        return self._send(200, ew.encode_logits_response(head.logits(h[None])[0]))
                except ValueError as e:
                    return self._error(400, str(e))
                return self._error(404, "no route")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> "StubEmbed":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()


def embed_can_join() -> bool:
    """Whether larql-embed has the membership flags yet (until then tests register it statically)."""
    r = subprocess.run(["larql-embed", "--help"], capture_output=True, text=True, timeout=60, env=child_env())
    return "--join" in r.stdout


def start_grid(procs: Procs, vindex: Path, ranges: list[str], *, replicas: int = 1, embed_vindex: Path | None = None,
               router_port: int | None = None, timeout: float = 120.0) -> dict:
    """Embed server + router + shards (each range ``replicas`` times), all joined; waits for full coverage."""
    router = procs.router(port=router_port) if embed_can_join() else None
    router_args: list[str] = []
    embed_args = ["--host", "127.0.0.1", "--blas-threads", "1", "--hot-cache", "64"]
    if router is None:  # register the embed server statically on the router instead
        embed = procs.start("embed", "larql-embed", str(embed_vindex or vindex), *embed_args)
        router_args = ["--embed", embed.url]
        router = procs.router(*router_args, port=router_port)
    else:
        router.wait_ready(30)
        embed = procs.start("embed", "larql-embed", str(embed_vindex or vindex), *embed_args, "--join", router.url)
    router.wait_ready(30)
    shards = {}
    for rng in ranges:
        shards[rng] = [procs.shard(vindex, rng, router, f"ffn-{rng}-{i}") for i in range(replicas)]
    for group in shards.values():
        for s in group:
            s.wait_ready(timeout)
    embed.wait_ready(timeout)
    wait_grid(router.url, embed=1, timeout=timeout)
    return {"router": router, "embed": embed, "shards": shards, "router_args": router_args}


def remote_args(**kw):
    import argparse

    base = dict(embed=None, ffn=None, ffn_f16=False, timeout=20.0, retries=4)
    base.update(kw)
    return argparse.Namespace(**base)
