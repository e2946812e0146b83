"""Benchmark of the two hand-written HTTP/1.1 clients against maintained ones, in one run.

    python benchmarks/h1_clients.py [--requests 1500] [--rounds 3] [--loop uvloop|asyncio] \\
        [--out benchmarks/results/h1_clients.txt]

A real Sanic server (one process, like every role; uvloop, access log off) answers like an FFN
shard: ``POST /v1/walk-ffn`` with a binary body of one hidden-640 position (2,576 bytes) gets a
reply of the same size, and ``POST /v1/walk-ffn-64k`` gets a 64 KiB reply. The server is pinned to
one core and this process to the other, so the figures are the client's cost plus one loopback
round trip.

Synchronous (the attention-only client, ``larql_edge.net.h1_sync.HttpClient``, one keep-alive
connection) against ``httpx.Client``, a ``urllib3`` pool and bare ``http.client``. Asynchronous
(the router, ``larql_edge.net.h1_async.H1Pool``) against ``httpx.AsyncClient``,
``aiohttp.ClientSession``, ``httpcore.AsyncConnectionPool`` and a minimal ``asyncio.Protocol``
client that parses with ``httptools``; sequentially and with 8 and 32 requests in flight.

Figures per client: per-request latency p50/p99, requests/s and this process's CPU time per
request (the least noise-sensitive figure on a shared machine). Rounds are interleaved (each round
runs every client once, in a rotated order); each figure is the median over rounds, and the
requests/s spread over rounds is printed so "within noise" can be judged. Ratios are against our
client in the same run: ``p50 x`` > 1 and ``req/s x`` < 1 mean ours is faster.
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import os
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

REPO = Path(__file__).resolve().parent.parent

import numpy as np  # noqa: E402  (after the BLAS pin above)
from _support import save_keeping_earlier  # noqa: E402  (benchmarks/ is the script's folder)

from larql_edge.wire import ffn as ffn_wire  # noqa: E402

HIDDEN = 640
BIG = 64 << 10
CT = ffn_wire.CONTENT_TYPE
HEADERS = {"content-type": CT, "accept": CT}
CASES = (("2.5 KB reply", "/v1/walk-ffn"), ("64 KB reply", "/v1/walk-ffn-64k"))

lines: list[str] = []


def say(text: str = "") -> None:
    print(text, flush=True)
    lines.append(text)


def request_body() -> bytes:
    x = np.random.default_rng(0).standard_normal((1, HIDDEN)).astype(np.float32)
    return ffn_wire.encode_request(3, x)


# ---------------------------------------------------------------- the server (a child process)


def serve(port: int, cpu: int | None) -> None:
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
    from sanic import Sanic
    from sanic.response import raw, text

    x = np.random.default_rng(1).standard_normal((1, HIDDEN)).astype(np.float32)
    small = ffn_wire.encode_response(3, x, 0.1)
    big = bytes(range(256)) * (BIG // 256)
    app = Sanic("h1_bench")
    app.config.KEEP_ALIVE_TIMEOUT = 75

    @app.get("/ready")
    async def ready(request):
        return text("ok")

    @app.post("/v1/walk-ffn")
    async def walk(request):
        return raw(small, content_type=CT)

    @app.post("/v1/walk-ffn-64k")
    async def walk_big(request):
        return raw(big, content_type=CT)

    app.run(host="127.0.0.1", port=port, single_process=True, access_log=False, motd=False)


def start_server(cpu: int | None) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = [sys.executable, __file__, "--serve", str(port)] + (["--server-cpu", str(cpu)] if cpu is not None else [])
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"benchmark server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/ready", timeout=1) as r:
                if r.status == 200:
                    return proc, url
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise TimeoutError("benchmark server not ready after 60 s")


# ---------------------------------------------------------------- measurement


class Run:
    def __init__(self, lat_ns: list[int], wall: float, cpu: float):
        lat = sorted(lat_ns)
        self.p50 = lat[len(lat) // 2] / 1e3
        self.p99 = lat[min(len(lat) - 1, int(len(lat) * 0.99))] / 1e3
        self.rps = len(lat) / wall
        self.cpu_us = cpu / len(lat) * 1e6


def check(body: bytes, want: int) -> None:
    if len(body) != want:
        raise RuntimeError(f"reply of {len(body)} bytes, expected {want}")


def time_sync(call, n: int, want: int) -> Run:
    for _ in range(min(100, n)):  # warm: connection open, caches hot
        check(call(), want)
    lat = []
    c0, t0 = time.process_time(), time.perf_counter()
    for _ in range(n):
        t = time.perf_counter_ns()
        body = call()
        lat.append(time.perf_counter_ns() - t)
        check(body, want)
    return Run(lat, time.perf_counter() - t0, time.process_time() - c0)


async def time_async(call, n: int, want: int, inflight: int) -> Run:
    for _ in range(min(100, n)):
        check(await call(), want)
    await asyncio.gather(*(call() for _ in range(inflight)))  # open the pool's connections
    lat: list[int] = []

    async def worker(k: int) -> None:
        for _ in range(k):
            t = time.perf_counter_ns()
            body = await call()
            lat.append(time.perf_counter_ns() - t)
            check(body, want)

    c0, t0 = time.process_time(), time.perf_counter()
    await asyncio.gather(*(worker(n // inflight) for _ in range(inflight)))
    return Run(lat, time.perf_counter() - t0, time.process_time() - c0)


# ---------------------------------------------------------------- synchronous clients


def sync_clients(url: str, path: str, body: bytes) -> dict:
    """name -> (call, close); every call returns the reply body."""
    from larql_edge.net.h1_sync import HttpClient

    host, port = url.removeprefix("http://").split(":")
    out = {}

    ours = HttpClient(timeout=30)
    out["ours (h1_sync)"] = (lambda: ours.request("POST", url + path, content=body, headers=HEADERS).content, ours.close)

    conn = http.client.HTTPConnection(host, int(port), timeout=30)

    def bare() -> bytes:
        conn.request("POST", path, body=body, headers=HEADERS)
        return conn.getresponse().read()

    out["http.client bare"] = (bare, conn.close)

    import httpx

    hx = httpx.Client(timeout=30)
    out["httpx.Client"] = (lambda: hx.post(url + path, content=body, headers=HEADERS).content, hx.close)

    try:
        import urllib3
    except ImportError:
        say("    (urllib3 not installed: skipped)")
    else:
        pool = urllib3.HTTPConnectionPool(host, int(port), maxsize=1, retries=False, timeout=30)
        out["urllib3 pool"] = (lambda: pool.request("POST", path, body=body, headers=HEADERS).data, pool.close)
    return out


# ---------------------------------------------------------------- asynchronous clients


class HttptoolsPool:
    """A minimal keep-alive client: asyncio.Protocol transports, replies parsed by httptools (llhttp).

    Only what the benchmark needs (POST, Content-Length or chunked replies, a timeout; no TLS, no
    HEAD, no retry); it is here to tell whether a maintained parser under our own pool would be
    worth having. (httptools cannot be told that a reply answers a HEAD, and has no "end of
    input" call for close-delimited bodies: a full client would work around both.)"""

    class Proto(asyncio.Protocol):
        def __init__(self):
            import httptools

            self.parser = httptools.HttpResponseParser(self)
            self.transport = None
            self.waiter: asyncio.Future | None = None
            self.parts: list[bytes] = []
            self.lost = False

        def connection_made(self, transport):
            self.transport = transport

        def data_received(self, data):
            try:
                self.parser.feed_data(data)
            except Exception as e:  # noqa: BLE001 - any parse error fails the request
                if self.waiter and not self.waiter.done():
                    self.waiter.set_exception(e)

        def connection_lost(self, exc):
            self.lost = True
            if self.waiter and not self.waiter.done():
                self.waiter.set_exception(ConnectionError("connection lost"))

        def on_body(self, chunk):
            self.parts.append(chunk)

        def on_message_complete(self):
            body, self.parts = b"".join(self.parts), []
            if self.waiter and not self.waiter.done():
                self.waiter.set_result((self.parser.get_status_code(), body, self.parser.should_keep_alive()))

    def __init__(self, host: str, port: int):
        self.host, self.port = host, port
        self.idle: list[HttptoolsPool.Proto] = []

    async def post(self, path: str, body: bytes, headers: dict[str, str]) -> bytes:
        p = self.idle.pop() if self.idle else None
        if p is None or p.lost:
            _, p = await asyncio.get_running_loop().create_connection(self.Proto, self.host, self.port)
        head = f"POST {path} HTTP/1.1\r\nhost: {self.host}:{self.port}\r\n" + "".join(
            f"{k}: {v}\r\n" for k, v in headers.items()) + f"content-length: {len(body)}\r\n\r\n"
        p.waiter = asyncio.get_running_loop().create_future()
        p.transport.write(head.encode("latin-1") + body)
        async with asyncio.timeout(30):  # a bound on the reply, as every other client here has
            _, content, keep = await p.waiter
        if keep:
            self.idle.append(p)
        else:
            p.transport.close()
        return content

    async def aclose(self) -> None:
        for p in self.idle:
            p.transport.close()
        self.idle.clear()


async def async_clients(url: str, path: str, body: bytes) -> dict:
    """name -> (call, aclose); every call returns the reply body."""
    from larql_edge.net.h1_async import H1Pool

    host, port = url.removeprefix("http://").split(":")
    out = {}
    ours = H1Pool(timeout=30)

    async def call_ours() -> bytes:
        return (await ours.request("POST", url + path, content=body, headers=HEADERS)).content

    out["ours (h1_async)"] = (call_ours, ours.aclose)

    import httpx

    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
    hx = httpx.AsyncClient(timeout=30, limits=limits)

    async def call_httpx() -> bytes:
        return (await hx.post(url + path, content=body, headers=HEADERS)).content

    out["httpx.AsyncClient"] = (call_httpx, hx.aclose)

    try:
        import aiohttp
    except ImportError:
        say("    (aiohttp not installed: skipped; pip install aiohttp)")
    else:
        session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=64), timeout=aiohttp.ClientTimeout(total=30))

        async def call_aiohttp() -> bytes:
            async with session.post(url + path, data=body, headers=HEADERS) as r:
                return await r.read()

        out["aiohttp.ClientSession"] = (call_aiohttp, session.close)

    import httpcore

    core = httpcore.AsyncConnectionPool(max_connections=64, max_keepalive_connections=64)
    core_headers = list(HEADERS.items())

    async def call_httpcore() -> bytes:
        return (await core.request("POST", url + path, headers=core_headers, content=body)).content

    out["httpcore pool"] = (call_httpcore, core.aclose)

    try:
        import httptools  # noqa: F401
    except ImportError:
        say("    (httptools not installed: skipped)")
    else:
        ht = HttptoolsPool(host, int(port))
        out["httptools + Protocol"] = (lambda: ht.post(path, body, HEADERS), ht.aclose)
    return out


# ---------------------------------------------------------------- report


def report(title: str, results: dict[str, list[Run]]) -> dict[str, float]:
    say(title)
    say(f"    {'client':24s} {'p50 us':>8s} {'p99 us':>8s} {'req/s':>8s} {'CPU us/req':>10s}"
        f" {'p50 x':>6s} {'req/s x':>7s} {'CPU x':>6s}   req/s of each round")
    base = None
    ratios = {}
    for name, runs in results.items():
        p50 = statistics.median(r.p50 for r in runs)
        p99 = statistics.median(r.p99 for r in runs)
        rps = statistics.median(r.rps for r in runs)
        cpu = statistics.median(r.cpu_us for r in runs)
        if base is None:
            base = (p50, rps, cpu)
        rx = rps / base[1]
        ratios[name] = rx
        rounds = ", ".join(f"{r.rps:,.0f}" for r in runs)
        say(f"    {name:24s} {p50:8.0f} {p99:8.0f} {rps:8,.0f} {cpu:10.0f} {p50 / base[0]:6.2f} {rx:7.2f}"
            f" {cpu / base[2]:6.2f}   {rounds}")
    say("")
    return ratios


def rotated(names: list[str], k: int) -> list[str]:
    k %= len(names)
    return names[k:] + names[:k]


def bench_sync(url: str, body: bytes, args) -> None:
    for label, path in CASES:
        want = len(ffn_wire.encode_response(3, np.zeros((1, HIDDEN), np.float32), 0.1)) if path == "/v1/walk-ffn" else BIG
        clients = sync_clients(url, path, body)
        results: dict[str, list[Run]] = {n: [] for n in clients}
        try:
            for r in range(args.rounds):
                for name in rotated(list(clients), r):
                    results[name].append(time_sync(clients[name][0], args.requests, want))
        finally:
            for _, close in clients.values():
                close()
        report(f"Synchronous, sequential, POST {len(body):,} B -> {label} ({args.requests} requests x "
               f"{args.rounds} rounds, one keep-alive connection):", results)


async def bench_async(url: str, body: bytes, args) -> None:
    for label, path in CASES:
        want = len(ffn_wire.encode_response(3, np.zeros((1, HIDDEN), np.float32), 0.1)) if path == "/v1/walk-ffn" else BIG
        for inflight in (1, 8, 32):
            clients = await async_clients(url, path, body)
            results: dict[str, list[Run]] = {n: [] for n in clients}
            try:
                for r in range(args.rounds):
                    for name in rotated(list(clients), r):
                        run = await asyncio.wait_for(time_async(clients[name][0], args.requests, want, inflight), 300)
                        results[name].append(run)
            finally:
                for _, aclose in clients.values():
                    await aclose()
            how = "sequential" if inflight == 1 else f"{inflight} in flight"
            report(f"Asynchronous ({args.loop}), {how}, POST {len(body):,} B -> {label} "
                   f"({args.requests} requests x {args.rounds} rounds):", results)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=1500, help="timed requests per client, case and round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--loop", choices=("uvloop", "asyncio"), default="uvloop",
                    help="event loop of the async clients (the router runs on Sanic's uvloop)")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "h1_clients.txt"))
    ap.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--server-cpu", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        serve(args.serve, args.server_cpu)
        return

    cpus = sorted(os.sched_getaffinity(0))
    server_cpu = client_cpu = None
    if len(cpus) >= 2:
        client_cpu, server_cpu = cpus[0], cpus[1]
        os.sched_setaffinity(0, {client_cpu})
    import httpcore
    import httpx
    import sanic
    import urllib3

    versions = [f"httpx {httpx.__version__}", f"httpcore {httpcore.__version__}", f"urllib3 {urllib3.__version__}",
                f"sanic {sanic.__version__}"]
    for mod in ("aiohttp", "httptools", "uvloop"):
        try:
            versions.append(f"{mod} {__import__(mod).__version__}")
        except ImportError:
            pass
    say("== HTTP/1.1 clients of the hot path: ours against maintained clients, one run ==")
    say(f"machine: {os.cpu_count()} cores, load average at start {os.getloadavg()[0]:.2f}; "
        f"client pinned to CPU {client_cpu}, Sanic server (1 process) pinned to CPU {server_cpu}")
    say(f"python {sys.version.split()[0]}; " + ", ".join(versions))
    say("ratios are against ours in the same table: p50 x > 1 and req/s x < 1 mean ours is faster")
    say("")
    body = request_body()
    t0 = time.perf_counter()
    proc, url = start_server(server_cpu)
    try:
        bench_sync(url, body, args)
        if args.loop == "uvloop":
            import uvloop

            uvloop.run(bench_async(url, body, args))
        else:
            asyncio.run(bench_async(url, body, args))
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
    say(f"(took {time.perf_counter() - t0:.0f} s; load average at end {os.getloadavg()[0]:.2f})")
    save_keeping_earlier(args.out, lines)


if __name__ == "__main__":
    main()
