"""Real grid processes on loopback for the tests: start, wait until ready, always clean up.

Every process is started through the grid supervisor (`larql_edge.tools.grid.supervisor`, the one
process helper), in its own session so stopping it stops what it started; `Procs` stops everything
it started, even when a test fails. Every wait is bounded.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from larql_edge.testing.servers import console_script, server_env
from larql_edge.tools.grid.supervisor import Role, Supervisor, free_port

GRID_KEY = "test-grid-key-0123456789"  # the tests' key; asserted absent from every log

__all__ = ["GRID_KEY", "Procs", "Role", "free_port", "server_env", "wait_grid", "start_grid", "larql", "StubEmbed"]


class Procs:
    """Starts grid roles; a context manager that stops them all on exit."""

    def __init__(self, logdir: Path | None = None, **env: str):
        self.sup = Supervisor(Path(logdir or tempfile.mkdtemp(prefix="larql-grid-test-")),
                              server_env(LARQL_GRID_KEY=GRID_KEY, **env))
        self.procs = self.sup.roles

    def __enter__(self) -> "Procs":
        return self

    def __exit__(self, *exc) -> None:
        self.stop_all()

    def stop_all(self) -> None:
        self.sup.stop_all()

    def start(self, name: str, script: str, *args: str, port: int | None = None, env: dict | None = None,
              with_port: bool = True) -> Role:
        port = port or free_port()
        argv = [*console_script(script), *args] + (["--port", str(port)] if with_port else [])
        return self.sup.start(name, argv, f"http://127.0.0.1:{port}", env=env)

    def router(self, *args: str, name: str = "router", port: int | None = None) -> Role:
        return self.start(name, "larql-router", "--heartbeat-interval", "0.25", *args, port=port)

    def shard(self, vindex: Path, layers: str, router: Role | None, name: str | None = None, *args: str) -> Role:
        join = ["--join", router.url] if router is not None else []
        return self.start(name or f"ffn-{layers}", "larql-ffn", str(vindex), "--layers", layers, *join, *args)

    def embed(self, vindex: Path, router: Role | None, name: str = "embed", *args: str) -> Role:
        join = ["--join", router.url] if router is not None else []
        return self.start(name, "larql-embed", str(vindex), *join, *args)

    def logs(self) -> str:
        return "\n".join(f"== {p.name}\n{p.log()}" for p in self.procs)


def wait_grid(router_url: str, *, complete: bool = True, embed: int = 0, members: int | None = None,
              timeout: float = 30.0, verify=True) -> dict:
    """Poll GET /v1/grid until it has full coverage / the embed members / the member count asked."""
    deadline = time.monotonic() + timeout
    view: dict = {}
    while time.monotonic() < deadline:
        try:
            view = httpx.get(router_url + "/v1/grid", timeout=2.0, verify=verify).json()
            if ((not complete or view["complete"]) and view["embed"] >= embed
                    and (members is None or len(view["members"]) == members)):
                return view
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.1)
    raise TimeoutError(f"grid at {router_url} not as expected after {timeout}s: {view}")


def wait_metrics(url: str, *names: str, timeout: float = 30.0, until=None) -> str:
    """GET /metrics until every series named is in it (and ``until(text)`` holds): a reply's figures
    reach Prometheus at a flush, which every scrape also makes, so this is a wait on the condition
    in place of sleeping past the 1 s flusher."""
    deadline = time.monotonic() + timeout
    text = ""
    while time.monotonic() < deadline:
        text = httpx.get(url + "/metrics", timeout=10).text
        if all(n in text for n in names) and (until is None or until(text)):
            return text
        time.sleep(0.05)
    return text  # the caller's assertions say what is missing


def larql(*args: str, timeout: float = 120.0, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*console_script("larql"), *args], capture_output=True, text=True, timeout=timeout,
                          env=server_env(**(env or {})), stdin=subprocess.DEVNULL)


PY = sys.executable


class StubEmbed:
    """A minimal embed server in a thread, written from the wire spec (DESIGN.md §1) over the local
    model code: POST /v1/embed and /v1/logits (binary), GET /v1/embed/{id}, /v1/token/encode,
    /v1/ready, /v1/stats. It lets the router proxy and the remote providers be tested on their own.
    """

    def __init__(self, vindex: Path, larql_logits: bool = False):
        """``larql_logits``: answer /v1/logits as LARQL's server does, top-k JSON only (never raw f32)."""
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        from larql_edge.errors import WireError
        from larql_edge.format.vindex import Vindex
        from larql_edge.model.forward import LocalEmbed, LocalHead
        from larql_edge.model.spec import ModelSpec
        from larql_edge.wire import embed as ew

        vx = Vindex.open(vindex)
        spec = ModelSpec.from_index(vx.index)
        emb, head = LocalEmbed(vx, spec), LocalHead(vx, spec)
        self.requests: list[str] = []
        stub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            # The head and the body are two writes: with Nagle's algorithm the body waited for the
            # client's delayed ACK of the head, ~40 ms a reply (2.8 s of a 3 s test).
            disable_nagle_algorithm = True

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
                        import json as j

                        import numpy as np

                        ctype = self.headers.get("content-type", "")
                        if ctype.startswith("application/json"):
                            req = j.loads(body)
                            h, k = np.asarray(req["residual"], np.float32), int(req.get("top_k", 5))
                        else:
                            h, k = ew.decode_logits_request(body, spec.hidden_size), 5
                        logits = head.logits(h[None])[0]
                        if not larql_logits and not ctype.startswith("application/json"):
                            return self._send(200, ew.encode_logits_response(logits))
                        p = np.exp(logits - logits.max())
                        p /= p.sum()
                        top = [{"token_id": int(i), "token": "", "prob": float(p[i])} for i in np.argsort(-p)[:k]]
                        return self._send(200, j.dumps({"top_k": top, "latency_ms": 0.1}).encode(), "application/json")
                except (ValueError, WireError) as e:
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


def start_grid(procs: Procs, vindex: Path, ranges: list[str], *, replicas: int = 1, embed_vindex: Path | None = None,
               router_port: int | None = None, router_args: tuple[str, ...] = (), timeout: float = 120.0) -> dict:
    """Embed server + router + shards (each range ``replicas`` times), all joined; waits for full coverage."""
    router = procs.router(*router_args, port=router_port)
    router.wait_ready(30)
    embed = procs.start("embed", "larql-embed", str(embed_vindex or vindex), "--blas-threads", "1", "--hot-cache", "64",
                        "--join", router.url)
    shards = {rng: [procs.shard(vindex, rng, router, f"ffn-{rng}-{i}") for i in range(replicas)] for rng in ranges}
    for group in shards.values():
        for s in group:
            s.wait_ready(timeout)
    embed.wait_ready(timeout)
    wait_grid(router.url, embed=1, timeout=timeout)
    return {"router": router, "embed": embed, "shards": shards}


def remote_args(**kw):
    from larql_edge.net.remote import RemoteSettings

    return RemoteSettings(**{"timeout": 20.0, "retries": 4, **kw})


class _Captured:
    def __init__(self):
        self.lines: list[str] = []

    @property
    def text(self) -> str:
        return "\n".join(self.lines)


class capture_logs:
    """Everything larql-edge logs (the ``larql.*`` loggers) while the block runs, as text."""

    def __init__(self, level: int = 10):
        import logging

        self.level = level
        self.out = _Captured()
        out = self.out

        class _Handler(logging.Handler):
            def emit(self, record):
                out.lines.append(f"{record.levelname} {record.name}: {record.getMessage()}")

        self.handler = _Handler(level)

    def __enter__(self) -> _Captured:
        import logging

        log = logging.getLogger("larql")
        self._old = log.level
        log.setLevel(self.level)
        log.addHandler(self.handler)
        return self.out

    def __exit__(self, *exc) -> None:
        import logging

        log = logging.getLogger("larql")
        log.removeHandler(self.handler)
        log.setLevel(self._old)
