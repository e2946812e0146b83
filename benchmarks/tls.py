"""What TLS costs per hop, on loopback, with keep-alive (the handshake paid once per connection): one run.

    python benchmarks/tls.py [--requests 400] [--rounds 3] [--out benchmarks/results/tls.txt]

Real processes (started through the grid supervisor): a ``larql-ffn`` shard serving layer 0 of
Gemma 3 270M (f32) and a ``larql-router`` with that shard as its static member, in three modes
started side by side: plain HTTP, TLS, and mutual TLS (``--tls-client-ca`` on both servers). The
certificates are made at run time (`larql_edge.testing.certs`, ECDSA P-256).

Per mode, from this process with the attention-only client's HTTP client (``h1_sync``, one
kept-alive connection per server), p50 and p99 of:
- ``GET /v1/health`` on the shard: the transport alone;
- ``POST /v1/walk-ffn`` of one position (2.5 KB each way) to the shard: one hop;
- the same through the router: two hops (client -> router over ``h1_async``'s pool -> shard);
- a new connection for every request (the handshake each time): what keep-alive saves.
Rounds are interleaved (each round runs every mode once, in a rotated order); figures are the
median over rounds. Ratios are against plain HTTP in the same run; "+us" is the added time.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402

from benchmarks._support import tree_cpu  # noqa: E402
from larql_edge.net import tls  # noqa: E402
from larql_edge.net.h1_sync import HttpClient  # noqa: E402
from larql_edge.testing.certs import Pki  # noqa: E402
from larql_edge.testing.servers import console_script, server_env  # noqa: E402
from larql_edge.tools.grid.supervisor import Supervisor, free_port  # noqa: E402
from larql_edge.wire import ffn as ffn_wire  # noqa: E402

KEY = "bench-grid-key-0123456789"
CT = {"content-type": ffn_wire.CONTENT_TYPE, "accept": ffn_wire.CONTENT_TYPE}
lines: list[str] = []


def say(text: str = "") -> None:
    print(text, flush=True)
    lines.append(text)


def timed(fn, n: int, pids: list[int]) -> tuple[list[float], float, float]:
    """Latencies (us), then this process's and the servers' CPU us per request: on a shared, loaded
    machine CPU time is the figure least disturbed by other work."""
    out = []
    c0, s0 = time.process_time(), sum(tree_cpu(p) for p in pids)
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e6)
    c1, s1 = time.process_time(), sum(tree_cpu(p) for p in pids)
    return out, (c1 - c0) * 1e6 / n, (s1 - s0) * 1e6 / n


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


CASES = ("health, shard", "walk-ffn, shard (1 hop)", "walk-ffn, router (2 hops)", "health, new connection each")


def run_mode(m: dict, body: bytes, requests: int) -> dict[str, tuple[list[float], float, float]]:
    """Every case once against one mode's shard and router, on one kept-alive client."""
    c = HttpClient(timeout=30)
    s_url, r_url = m["shard"].url, m["router"].url

    def walk(url: str) -> None:
        r = c.request("POST", url + "/v1/walk-ffn", content=body, headers=CT)
        assert r.status_code == 200, r.text

    def fresh() -> None:
        once = HttpClient(timeout=30)
        try:
            assert once.request("GET", s_url + "/v1/health").status_code == 200
        finally:
            once.close()

    for _ in range(20):  # warm: connections open, caches hot
        walk(s_url)
        walk(r_url)
    fns = {CASES[0]: lambda: c.request("GET", s_url + "/v1/health"), CASES[1]: lambda: walk(s_url),
           CASES[2]: lambda: walk(r_url), CASES[3]: fresh}
    pids = {CASES[2]: [m["shard"].pid, m["router"].pid]}
    out = {case: timed(fn, requests // 4 if case == CASES[3] else requests, pids.get(case, [m["shard"].pid]))
           for case, fn in fns.items()}
    c.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=str(REPO / "benchmarks/results/tls.txt"))
    args = ap.parse_args()

    from larql_edge.tools.slicer.cache import cached_vindex

    vindex = cached_vindex("gemma3-270m", level="all", dtype="f32", quant="none", log=lambda m: None)
    root = Path(tempfile.mkdtemp(prefix="larql-tls-bench-"))
    pki = Pki(root / "pki")
    server, client = pki.issue("server"), pki.issue("client")
    verify = tls.make_client_context(tls.TlsSettings(str(client.cert), str(client.key), ca=str(pki.ca)))
    tls.configure_client(tls.TlsSettings(str(client.cert), str(client.key), ca=str(pki.ca)))
    sup = Supervisor(root / "logs", server_env(LARQL_GRID_KEY=KEY), verify=verify)
    modes: dict[str, dict] = {}
    t_start = time.perf_counter()
    say(f"benchmarks/tls.py: {os.cpu_count()} cores, load average at start {os.getloadavg()[0]:.2f}; "
        f"python {sys.version.split()[0]}, {tls.client_context().protocol.name}; certificates ECDSA P-256")
    try:
        for mode in ("plain", "tls", "mtls"):
            env = {}
            if mode != "plain":
                env = {"LARQL_TLS_CERT_FILE": str(server.cert), "LARQL_TLS_KEY_FILE": str(server.key),
                       "LARQL_TLS_CA_FILE": str(pki.ca)}
            if mode == "mtls":
                env["LARQL_TLS_CLIENT_CA_FILE"] = str(pki.ca)
            scheme = "http" if mode == "plain" else "https"
            sp, rp = free_port(), free_port()
            shard = sup.start(f"ffn-{mode}", [*console_script("larql-ffn"), str(vindex), "--layers", "0-0",
                                              "--port", str(sp)], f"{scheme}://127.0.0.1:{sp}", env=env)
            router = sup.start(f"router-{mode}", [*console_script("larql-router"), "--shards", f"0-0={shard.url}",
                                                  "--port", str(rp)], f"{scheme}://127.0.0.1:{rp}", env=env)
            modes[mode] = {"shard": shard, "router": router}
        for m in modes.values():
            m["shard"].wait_ready(600)
            m["router"].wait_ready(120)
        body = ffn_wire.encode_request(0, np.random.default_rng(0).standard_normal((1, 640)).astype(np.float32))
        results: dict[tuple[str, str], list[tuple[list[float], float, float]]] = {}
        for rnd in range(args.rounds):
            order = list(modes)[rnd % 3:] + list(modes)[:rnd % 3]
            for mode in order:
                for case, got in run_mode(modes[mode], body, args.requests).items():
                    results.setdefault((mode, case), []).append(got)
        say(f"{args.rounds} interleaved rounds x {args.requests} requests per case (a quarter for new connections); "
            "median over rounds")
        say("")
        say("CPU us/req: this client's, and the servers' (the shard; the router and the shard for 2 hops)")
        say(f"{'case':30} {'mode':6} {'p50 us':>8} {'p99 us':>8} {'p50 x':>6} {'+us p50':>8} "
            f"{'client CPU':>10} {'x':>5} {'server CPU':>10} {'x':>5}")
        for case in CASES:
            base: tuple[float, float, float] | None = None
            for mode in modes:
                rounds = results[(mode, case)]
                p50 = statistics.median(pct(r[0], 0.5) for r in rounds)
                p99 = statistics.median(pct(r[0], 0.99) for r in rounds)
                ccpu = statistics.median(r[1] for r in rounds)
                scpu = statistics.median(r[2] for r in rounds)
                base = base or (p50, ccpu, scpu)
                say(f"{case:30} {mode:6} {p50:8.0f} {p99:8.0f} {p50 / base[0]:6.2f} {p50 - base[0]:+8.0f} "
                    f"{ccpu:10.0f} {ccpu / base[1]:5.2f} {scpu:10.0f} {scpu / base[2]:5.2f}")
            say("")
    finally:
        sup.stop_all()
    say(f"(took {time.perf_counter() - t_start:.0f} s; load average at end {os.getloadavg()[0]:.2f})")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
