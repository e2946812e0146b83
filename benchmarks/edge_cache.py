"""Edge cache: cached GET /v1/embed/{id} through the shipped nginx and varnish configs, against nginx
serving a static file of the same size; then the hit ratio under a Zipf token distribution.

    python benchmarks/edge_cache.py                     # Gemma 3 270M f16 vindex, writes nothing
    python benchmarks/edge_cache.py --out benchmarks/results/edge_cache.txt

Throughput: `wrk` with the same threads/connections/duration for every target, the targets
in an order rotated every round (the machine is shared); the ratio to the static baseline is taken
per round and the median reported. Targets: nginx serving a
static file (the baseline, a config mirroring the shipped one's http settings), the shipped nginx
config (cache hit), the shipped VCL (cache hit), and, for context, the embed server itself.
The embed server runs with 1 BLAS thread. Everything listens on 127.0.0.1.

Hit ratio: token ids drawn from a Zipf distribution over the vocabulary (p(rank) ~ rank^-s, ranks
mapped to ids by a fixed random permutation), sent through fresh proxies: a warm-up phase, then a
measured phase counting X-Cache: HIT. "ideal" is the share of measured requests whose id was asked
before (what an unbounded cache that never evicts could reach on the same sequence).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import tempfile
import threading
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import httpx  # noqa: E402
import numpy as np  # noqa: E402
from _support import tree_cpu  # noqa: E402  (benchmarks/ is the script's folder)

from larql_edge.testing.edge import NginxEdge, VarnishEdge, require_program  # noqa: E402
from larql_edge.testing.servers import running_server  # noqa: E402

BINARY = "application/x-larql-ffn"

# The static baseline: the shipped config's main/http settings, a `root` instead of the proxy.
STATIC_CONF = """
worker_processes auto;
pid nginx.pid;
pcre_jit on;
error_log logs/error.log warn;
events {{ worker_connections 4096; }}
http {{
    client_body_temp_path client_body_temp;
    proxy_temp_path proxy_temp;
    fastcgi_temp_path fastcgi_temp;
    uwsgi_temp_path uwsgi_temp;
    scgi_temp_path scgi_temp;
    default_type application/octet-stream;
    server_tokens off;
    sendfile on;
    tcp_nopush on;
    tcp_nodelay on;
    keepalive_timeout 65s;
    keepalive_requests 100000;
    open_file_cache max=20000 inactive=60s;
    open_file_cache_valid 60s;
    log_format larql '$remote_addr [$time_local] "$request" $status $body_bytes_sent '
                     'cache=$upstream_cache_status upstream=$upstream_addr '
                     'rt=$request_time urt=$upstream_response_time';
    access_log logs/access.log larql buffer=64k flush=1s;
    server {{
        listen 127.0.0.1:{port};
        root {root};
        location / {{ }}
    }}
}}
"""


def wrk(url: str, threads: int, connections: int, duration: int, pid: int | None = None) -> dict:
    cpu0 = tree_cpu(pid) if pid else 0.0
    out = subprocess.run(
        [require_program("wrk"), f"-t{threads}", f"-c{connections}", f"-d{duration}s", "--latency", url],
        capture_output=True, text=True, timeout=duration + 60,
    ).stdout
    cpu = tree_cpu(pid) - cpu0 if pid else float("nan")
    n = int(re.search(r"(\d+) requests in", out).group(1))
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))
    bad = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", out)
    p50 = re.search(r"50%\s+([\d.]+\w+)", out)
    p99 = re.search(r"99%\s+([\d.]+\w+)", out)
    return {"rps": rps, "cpu_us": cpu / max(n, 1) * 1e6, "non2xx": int(bad.group(1)) if bad else 0, "p50": p50.group(1) if p50 else "?",
            "p99": p99.group(1) if p99 else "?"}


def zipf_ids(n: int, vocab: int, s: float, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    ranks = np.arange(1, vocab + 1, dtype=np.float64)
    p = ranks**-s
    p /= p.sum()
    perm = rng.permutation(vocab)  # rank -> token id
    return perm[rng.choice(vocab, size=n, p=p)]


def drive(url: str, ids: np.ndarray, workers: int) -> tuple[int, int]:
    """GET every id (binary) with `workers` keep-alive clients; returns (hits, non-200)."""
    hits = [0] * workers
    bad = [0] * workers

    def run(w: int) -> None:
        with httpx.Client(timeout=30, headers={"Accept": BINARY}) as c:
            for tid in ids[w::workers]:
                r = c.get(f"{url}/v1/embed/{int(tid)}")
                if r.status_code != 200:
                    bad[w] += 1
                elif r.headers.get("x-cache") == "HIT":
                    hits[w] += 1

    threads = [threading.Thread(target=run, args=(w,)) for w in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(hits), sum(bad)


def ideal_hits(warm: np.ndarray, measured: np.ndarray) -> int:
    seen = set(int(t) for t in warm)
    hits = 0
    for t in measured:
        t = int(t)
        hits += t in seen
        seen.add(t)
    return hits


def default_vindex() -> Path:
    from larql_edge.tools.slicer.cache import cached_vindex

    return cached_vindex("gemma3-270m", level="all", dtype="f16", log=lambda m: None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vindex", type=Path, help="vindex to serve (default: the cached Gemma 3 270M f16)")
    ap.add_argument("--token", type=int, default=1000, help="token id of the cached row under load")
    ap.add_argument("--threads", type=int, default=1, help="wrk threads")
    ap.add_argument("--connections", type=int, default=32, help="wrk connections")
    ap.add_argument("--duration", type=int, default=5, help="seconds per wrk run")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--zipf-s", type=float, default=1.0, help="Zipf exponent")
    ap.add_argument("--zipf-warmup", type=int, default=50000)
    ap.add_argument("--zipf-requests", type=int, default=20000)
    ap.add_argument("--zipf-workers", type=int, default=4)
    ap.add_argument("--out", type=Path, help="also write the report here")
    args = ap.parse_args()

    vindex = args.vindex or default_vindex()
    lines: list[str] = []

    def say(s: str = "") -> None:
        print(s, flush=True)
        lines.append(s)

    with running_server("larql-embed", [str(vindex), "--blas-threads", "1"],
                        env={"OPENBLAS_NUM_THREADS": "1"}) as origin, tempfile.TemporaryDirectory() as tmp:
        model = httpx.get(origin.url + "/v1/models").json()["models"][0]
        vocab, hidden = model["vocab_size"], model["hidden_size"]
        row = httpx.get(f"{origin.url}/v1/embed/{args.token}", headers={"Accept": BINARY}).content
        assert len(row) == hidden * 4
        root = Path(tmp) / "static"
        (root / "v1" / "embed").mkdir(parents=True)
        (root / "v1" / "embed" / str(args.token)).write_bytes(row)  # same path, same bytes
        os.chmod(tmp, 0o755)

        static = NginxEdge([], conf_text=lambda port: STATIC_CONF.format(port=port, root=root))
        edges = {"nginx static file": static,
                 "nginx cache hit": NginxEdge([origin.url]),
                 "varnish cache hit": VarnishEdge([origin.url], storage="malloc,256m")}
        try:
            for e in edges.values():
                e.start()
            for name, e in edges.items():
                if name != "nginx static file":
                    e.wait_origin()
                for _ in range(2):
                    r = httpx.get(f"{e.url}/v1/embed/{args.token}")
                assert r.status_code == 200 and r.content == row, (name, r.status_code)
                assert name == "nginx static file" or r.headers["x-cache"] == "HIT", name
            targets = {name: f"{e.url}/v1/embed/{args.token}" for name, e in edges.items()}
            targets["embed server (no cache)"] = f"{origin.url}/v1/embed/{args.token}"
            pids = {name: e.proc.pid for name, e in edges.items()}
            pids["embed server (no cache)"] = origin.pid

            say(f"# edge_cache  model={model['model']}  hidden={hidden} (row {len(row)} B)  vocab={vocab}  "
                f"cores={os.cpu_count()} (shared)  embed server: 1 worker, 1 BLAS thread")
            say(f"# wrk -t{args.threads} -c{args.connections} -d{args.duration}s, {args.rounds} rounds (order rotated each round), "
                f"median; GET /v1/embed/{args.token} (binary), all on 127.0.0.1")
            for url in targets.values():  # warm every target (files, connections, JIT of nothing) alike
                wrk(url, args.threads, args.connections, 1)
            runs: dict[str, list[dict]] = {k: [] for k in targets}
            names = list(targets)
            for i in range(args.rounds):
                for name in names[i % len(names):] + names[: i % len(names)]:  # rotate the order each round
                    runs[name].append(wrk(targets[name], args.threads, args.connections, args.duration, pids[name]))
            for name, rs in runs.items():
                med = statistics.median(r["rps"] for r in rs)
                # Each round's ratio against that round's static run (close in time: less noise from
                # whatever else the shared machine runs), then the median over rounds.
                ratios = [r["rps"] / b["rps"] for r, b in zip(rs, runs["nginx static file"], strict=True)]
                mid = sorted(rs, key=lambda r: r["rps"])[len(rs) // 2]
                bad = sum(r["non2xx"] for r in rs)
                each = ", ".join(f"{r['rps']:.0f}" for r in rs)
                cpu = statistics.median(r["cpu_us"] for r in rs)
                say(f"{name:<24} {med:8.0f} req/s  {statistics.median(ratios):5.2f}x static  "
                    f"server CPU {cpu:6.1f} us/req  p50 {mid['p50']:>8} p99 {mid['p99']:>8}  rounds: {each}"
                    + (f"  NON-2xx: {bad}" if bad else ""))
            say("target: cache hit >= 0.80x static (req/s: median of per-round ratios to the static run of the same round;")
            say("        server CPU: CPU time of the serving processes per request, median over rounds, steadier on a busy machine)")
        finally:
            for e in edges.values():
                e.stop()
                e.cleanup()

        # -- Zipf hit ratio, on fresh proxies ----------------------------------------------------------
        ids = zipf_ids(args.zipf_warmup + args.zipf_requests, vocab, args.zipf_s, seed=8)
        warm, measured = ids[: args.zipf_warmup], ids[args.zipf_warmup:]
        ideal = ideal_hits(warm, measured) / len(measured)
        say()
        say(f"# Zipf s={args.zipf_s} over {vocab} ids: warm-up {len(warm)} requests, then {len(measured)} measured "
            f"({len(set(ids.tolist()))} distinct ids in all); {args.zipf_workers} keep-alive clients")
        for name, e in (("nginx", NginxEdge([origin.url])), ("varnish", VarnishEdge([origin.url], storage="malloc,256m"))):
            try:
                e.start()
                e.wait_origin()
                _, bad_w = drive(e.url, warm, args.zipf_workers)
                hits, bad = drive(e.url, measured, args.zipf_workers)
            finally:
                e.stop()
                e.cleanup()
            say(f"{name:<8} hit ratio after warm-up {hits / len(measured):6.3f}   (ideal {ideal:.3f}; non-200: {bad_w + bad})")

    if args.out:
        args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
