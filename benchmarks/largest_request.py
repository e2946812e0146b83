"""The largest legal request to each server: its memory bound, and health staying responsive during it.

    python benchmarks/largest_request.py [--model gemma3-270m] [--seconds 20] [--out benchmarks/results/largest_request.txt]

For the embed server, an FFN shard and the router (real processes on loopback, Gemma 3 270M f16
slices), the largest requests their published limits allow (read from each one's ``/v1/stats``) are
sent by two concurrent clients for ``--seconds`` each, while a third connection polls ``/v1/health``
every 10 ms. Reported: request size and time, the server's RSS before and at its peak (sampled every
20 ms; the bound it must stay under is stated), and health p50/p99/max during the load. Compute runs off
the event loop, so health must stay in milliseconds while the largest request runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

for _v in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_v] = "1"
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
from _support import save_keeping_earlier, tree_rss  # noqa: E402  (benchmarks/ is the script's folder)

from larql_edge.format.presets import ROLE_PRESETS  # noqa: E402
from larql_edge.format.vindex import Vindex  # noqa: E402
from larql_edge.net.h1_sync import HttpClient  # noqa: E402
from larql_edge.tools.grid.supervisor import Supervisor, pick_ports, role_env  # noqa: E402
from larql_edge.tools.slicer.cache import cached_slice, cached_vindex  # noqa: E402
from larql_edge.wire import embed as ew  # noqa: E402
from larql_edge.wire import ffn as fw  # noqa: E402

HOST = "127.0.0.1"
BIN = fw.CONTENT_TYPE
HEALTH_P99_BOUND_MS = 250.0  # what the verdict holds each server to while its largest request runs



def load(role, requests: list[tuple[str, str, bytes, dict]], seconds: float) -> dict:
    """Send ``requests`` in a loop from 2 clients for ``seconds``; poll health; sample RSS."""
    stop = threading.Event()
    times: list[float] = []
    health: list[float] = []
    rss = [tree_rss(role.popen.pid)]
    errors: list[str] = []

    def send(i: int) -> None:
        c = HttpClient(timeout=300.0)
        try:
            while not stop.is_set():
                for method, path, body, headers in requests:
                    t0 = time.perf_counter()
                    r = c.request(method, role.url + path, content=body, headers=headers)
                    times.append(time.perf_counter() - t0)
                    if r.status_code != 200:
                        errors.append(f"{path} {r.status_code} {r.content[:200]!r}")
                        stop.set()
        finally:
            c.close()

    def poll() -> None:
        c = HttpClient(timeout=30.0)
        try:
            while not stop.is_set():
                t0 = time.perf_counter()
                r = c.request("GET", role.url + "/v1/health")
                health.append(time.perf_counter() - t0)
                if r.status_code != 200:
                    errors.append(f"health {r.status_code}")
                time.sleep(0.01)
        finally:
            c.close()

    def sample() -> None:
        while not stop.is_set():
            rss.append(tree_rss(role.popen.pid))
            time.sleep(0.02)

    threads = [threading.Thread(target=send, args=(i,)) for i in range(2)]
    threads += [threading.Thread(target=poll), threading.Thread(target=sample)]
    for t in threads:
        t.start()
    time.sleep(seconds)
    stop.set()
    for t in threads:
        t.join()
    h = sorted(health)
    return {"requests": len(times), "req_p50_ms": statistics.median(times) * 1e3 if times else float("nan"),
            "rss_start": rss[0], "rss_peak": max(rss), "health_p50_ms": statistics.median(h) * 1e3,
            "health_p99_ms": h[int(0.99 * (len(h) - 1))] * 1e3, "health_max_ms": h[-1] * 1e3, "health_n": len(h),
            "errors": errors[:3]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "largest_request.txt"))
    args = ap.parse_args()
    lines: list[str] = []

    def say(s: str = "") -> None:
        print(s, flush=True)
        lines.append(s)

    full = cached_vindex(args.model, dtype="f16", log=lambda m: None)
    embed_v, ffn_v = cached_slice(full, ROLE_PRESETS["embed"]), cached_slice(full, ROLE_PRESETS["ffn"])
    vx = Vindex.open(full)
    hidden, n = vx.hidden_size, vx.num_layers
    env = role_env(dict(os.environ), LARQL_GRID_KEY="bench-key", PYTHONUNBUFFERED="1")
    sup = Supervisor(Path(tempfile.mkdtemp(prefix="larql-largest-")), env)
    common = ["--host", HOST, "--blas-threads", "1"]
    rp, ep, sp = pick_ports(HOST, [19790, 19791, 19792])
    u = lambda p: f"http://{HOST}:{p}"  # noqa: E731
    say(f"larql-edge largest legal requests: {args.model}, f16 slices, {args.seconds:g} s per server, 2 clients")
    say(f"  {time.strftime('%Y-%m-%d %H:%M')}, load average {os.getloadavg()[0]:.1f}; health polled every 10 ms; "
        f"verdict: health p99 <= {HEALTH_P99_BOUND_MS:g} ms and RSS within the stated bound")
    say("")
    ok = True
    try:
        router = sup.start("router", ["larql-router", "--port", str(rp), *common], u(rp))
        embed = sup.start("embed", ["larql-embed", str(embed_v), "--port", str(ep), *common, "--join", u(rp)], u(ep))
        shard = sup.start("ffn", ["larql-ffn", str(ffn_v), "--port", str(sp), *common, "--join", u(rp)], u(sp))
        sup.wait_ready(sup.roles, time.monotonic() + 900)
        c = HttpClient()
        while not json.loads(c.request("GET", router.url + "/v1/grid").content)["complete"]:
            time.sleep(0.2)
        el = json.loads(c.request("GET", embed.url + "/v1/stats").content)["limits"]
        fl = json.loads(c.request("GET", shard.url + "/v1/stats").content)["limits"]
        c.close()
        rng = np.random.default_rng(0)

        ids = rng.integers(0, vx.vocab_size, el["max_tokens_per_request"])
        text = ("The history of the city begins with a small settlement on the river. " * 2000)[: el["max_text_chars"]]
        embed_reqs = [
            ("POST", "/v1/embed", ew.encode_embed_request(ids), {"content-type": BIN}),
            ("POST", "/v1/token/encode", json.dumps({"text": text}).encode(), {"content-type": "application/json"}),
            ("POST", "/v1/logits", ew.encode_logits_request(rng.standard_normal(hidden).astype(np.float32)),
             {"content-type": BIN, "accept": BIN}),
        ]
        per_layers = fl["max_rows_x_layers"] // n
        wide = rng.standard_normal((min(per_layers, fl["max_rows"]), hidden)).astype(np.float32)
        deep_layers = max(1, fl["max_rows_x_layers"] // fl["max_rows"])
        deep = rng.standard_normal((fl["max_rows"], hidden)).astype(np.float32)
        ffn_reqs = [
            ("POST", "/v1/walk-ffn", fw.encode_request(list(range(n)), wide), {"content-type": BIN}),
            ("POST", "/v1/walk-ffn", fw.encode_request(list(range(deep_layers)), deep), {"content-type": BIN}),
        ]
        cases = [
            ("embed server", embed, embed_reqs,
             f"/v1/embed {len(ids)} ids (reply {len(ids) * hidden * 4 / 2**20:.1f} MB), /v1/token/encode "
             f"{len(text):,} chars, /v1/logits 1 residual (raw f32[{vx.vocab_size:,}])",
             64 << 20, "reply buffers of one request per client"),
            ("FFN shard", shard, ffn_reqs,
             f"/v1/walk-ffn {wide.shape[0]} rows x {n} layers and {deep.shape[0]} rows x {deep_layers} layers "
             f"(replies {fl['max_rows_x_layers'] * hidden * 4 / 2**20:.0f} MB = max_reply_bytes)",
             2 * 4 * fl["max_reply_bytes"], "2 clients x (input + reply + per-chunk activations)"),
            ("router", router, ffn_reqs[:1],
             f"/v1/walk-ffn {wide.shape[0]} rows x {n} layers, fanned out to the shard",
             2 * 3 * fl["max_reply_bytes"], "2 clients x (request + member reply + own reply)"),
        ]
        for name, role, reqs, what, bound, why in cases:
            r = load(role, reqs, args.seconds)
            grew = r["rss_peak"] - r["rss_start"]
            verdict = (not r["errors"] and r["health_p99_ms"] <= HEALTH_P99_BOUND_MS and grew <= bound)
            ok &= verdict
            say(f"{name}: {what}")
            say(f"  {r['requests']} requests, p50 {r['req_p50_ms']:.0f} ms; RSS {r['rss_start'] / 2**20:.0f} MB -> peak "
                f"{r['rss_peak'] / 2**20:.0f} MB (+{grew / 2**20:.0f} MB; bound +{bound / 2**20:.0f} MB: {why})")
            say(f"  health during it: p50 {r['health_p50_ms']:.1f} ms, p99 {r['health_p99_ms']:.1f} ms, max "
                f"{r['health_max_ms']:.1f} ms over {r['health_n']} polls -> {'PASS' if verdict else 'FAIL'}"
                + (f"  errors: {r['errors']}" if r["errors"] else ""))
            say("")
        say(f"load average at end {os.getloadavg()[0]:.1f}")
    finally:
        sup.stop_all()
    save_keeping_earlier(args.out, lines)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
