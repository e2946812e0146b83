"""The largest legal request to each server: its memory bound, and health staying responsive during it.

    python benchmarks/largest_request.py [--model gemma3-270m] [--seconds 20] [--clients 8] [--hogs 0]
                                         [--out benchmarks/results/largest_request.txt]

For the embed server, an FFN shard, the router and larql-serve (real processes on loopback, Gemma 3
270M f16 slices), the largest requests their published limits allow (read from each one's
``/v1/stats``) are sent by ``--clients`` concurrent clients for ``--seconds`` each, while another
connection polls ``/v1/health`` every 10 ms (``--hogs N``: beside N CPU hogs). For the router, no
member may be marked failed by it (its own overload is not a member's failure). Reported: request
size and time, the server's RSS before and at its peak (sampled every 20 ms; the bound it must stay
under is stated), and health p50/p99/max during the load. Compute runs off
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
from larql_edge.testing.load import cpu_hogs  # noqa: E402
from larql_edge.tools.grid.supervisor import Supervisor, pick_ports, role_env  # noqa: E402
from larql_edge.tools.slicer.cache import cached_slice, cached_vindex  # noqa: E402
from larql_edge.wire import embed as ew  # noqa: E402
from larql_edge.wire import ffn as fw  # noqa: E402

HOST = "127.0.0.1"
BIN = fw.CONTENT_TYPE
HEALTH_P99_BOUND_MS = 250.0  # what the verdict holds each server to while its largest request runs



def load(role, requests: list[tuple], seconds: float, clients: int) -> dict:
    """Send ``requests`` (method, path, body, headers[, expected status]) in a loop from ``clients``
    clients for ``seconds``; poll health; sample RSS."""
    stop = threading.Event()
    times: list[float] = []
    health: list[float] = []
    rss = [tree_rss(role.popen.pid)]
    errors: list[str] = []

    def send(i: int) -> None:
        # As long as the servers' own response timeout: the largest request queued behind seven others
        # on a loaded host takes minutes, and a client giving up is reported, never silently dropped.
        c = HttpClient(timeout=900.0)
        try:
            while not stop.is_set():
                for method, path, body, headers, *expect in requests:
                    t0 = time.perf_counter()
                    try:
                        r = c.request(method, role.url + path, content=body, headers=headers)
                    except Exception as e:  # noqa: BLE001 - a timeout or a cut connection is a result too
                        errors.append(f"{path} {type(e).__name__}: {e}")
                        stop.set()
                        return
                    times.append(time.perf_counter() - t0)
                    if r.status_code != (expect[0] if expect else 200):
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

    threads = [threading.Thread(target=send, args=(i,)) for i in range(clients)]
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
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--hogs", type=int, default=0, help="CPU hogs (stress-ng) beside the servers")
    ap.add_argument("--only", default="embed,ffn,router,serve", help="the servers to load, comma-separated")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "largest_request.txt"))
    args = ap.parse_args()
    lines: list[str] = []

    def say(s: str = "") -> None:
        print(s, flush=True)
        lines.append(s)

    full = cached_vindex(args.model, dtype="f16", log=lambda m: None)
    embed_v, ffn_v = cached_slice(full, ROLE_PRESETS["embed"]), cached_slice(full, ROLE_PRESETS["ffn"])
    attn_v = cached_slice(full, ROLE_PRESETS["serve"])
    k = args.clients
    vx = Vindex.open(full)
    hidden, n = vx.hidden_size, vx.num_layers
    env = role_env(dict(os.environ), LARQL_GRID_KEY="bench-key", PYTHONUNBUFFERED="1")
    sup = Supervisor(Path(tempfile.mkdtemp(prefix="larql-largest-")), env)
    common = ["--host", HOST, "--blas-threads", "1"]
    rp, ep, sp, vp = pick_ports(HOST, [19790, 19791, 19792, 19793])
    u = lambda p: f"http://{HOST}:{p}"  # noqa: E731
    say(f"larql-edge largest legal requests: {args.model}, f16 slices, {args.seconds:g} s per server, {k} clients"
        + (f", {args.hogs} CPU hogs beside" if args.hogs else ""))
    say(f"  {time.strftime('%Y-%m-%d %H:%M')}, load average {os.getloadavg()[0]:.1f}; health polled every 10 ms; "
        f"verdict: health p99 <= {HEALTH_P99_BOUND_MS:g} ms and RSS within the stated bound")
    say("")
    ok = True
    hogs = cpu_hogs(args.hogs, limit_s=3600)  # stops by itself if this run dies without its finally
    hogs.__enter__()
    try:
        router = sup.start("router", ["larql-router", "--port", str(rp), *common], u(rp))
        embed = sup.start("embed", ["larql-embed", str(embed_v), "--port", str(ep), *common, "--join", u(rp)], u(ep))
        shard = sup.start("ffn", ["larql-ffn", str(ffn_v), "--port", str(sp), *common, "--join", u(rp)], u(sp))
        serve = sup.start("serve", ["larql-serve", str(attn_v), "--port", str(vp), *common, "--ffn", u(rp)], u(vp))
        sup.wait_ready(sup.roles, time.monotonic() + 900)
        c = HttpClient()
        while not json.loads(c.request("GET", router.url + "/v1/grid").content)["complete"]:
            time.sleep(0.2)
        el = json.loads(c.request("GET", embed.url + "/v1/stats").content)["limits"]
        fl = json.loads(c.request("GET", shard.url + "/v1/stats").content)["limits"]
        vl = json.loads(c.request("GET", serve.url + "/v1/stats").content)["limits"]
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
        # serve: the largest body (4 MiB of prompt: refused before tokenizing, a 400) and the longest
        # prompt its context takes (tokenized, prefilled, one token generated)
        long_text = ("The history of the city begins with a small settlement on the river. " * 100_000)
        fits = long_text[: vl["context"] * 2]  # ~2 characters a token in this text: over, then trimmed below
        tok = vx.load_tokenizer()
        while len(tok.encode(fits).ids) > vl["context"] - 8:
            fits = fits[: int(len(fits) * 0.9)]
        huge = long_text[: vl["max_body_bytes"] - 200]
        serve_reqs = [
            ("POST", "/v1/completions", json.dumps({"prompt": huge, "max_tokens": 1}).encode(),
             {"content-type": "application/json"}, 400),
            ("POST", "/v1/completions", json.dumps({"prompt": fits, "max_tokens": 1, "temperature": 0}).encode(),
             {"content-type": "application/json"}),
        ]
        reply = len(ids) * hidden * 4  # the largest embed reply: one per client can be in flight at once
        cases = [
            ("embed server", embed, embed_reqs,
             f"/v1/embed {len(ids)} ids (reply {len(ids) * hidden * 4 / 2**20:.1f} MB), /v1/token/encode "
             f"{len(text):,} chars, /v1/logits 1 residual (raw f32[{vx.vocab_size:,}])",
             (k + 2) * reply + (16 << 20),
             f"{k} clients x one {reply / 2**20:.0f} MB reply being sent, + the one being built and joined, + 16 MB of logits"),
            ("FFN shard", shard, ffn_reqs,
             f"/v1/walk-ffn {wide.shape[0]} rows x {n} layers and {deep.shape[0]} rows x {deep_layers} layers "
             f"(replies {fl['max_rows_x_layers'] * hidden * 4 / 2**20:.0f} MB = max_reply_bytes)",
             k * 4 * fl["max_reply_bytes"], f"{k} clients x (input + reply + per-chunk activations)"),
            ("router", router, ffn_reqs[:1],
             f"/v1/walk-ffn {wide.shape[0]} rows x {n} layers, fanned out to the shard",
             k * 3 * fl["max_reply_bytes"], f"{k} clients x (request + member reply + own reply)"),
            ("larql-serve", serve, serve_reqs,
             f"/v1/completions: a {len(huge) / 2**20:.1f} MB prompt (400 before tokenizing) and a "
             f"{len(tok.encode(fits).ids)}-token one (context {vl['context']}), 1 token",
             k * 16 * vl["max_body_bytes"], f"{k} clients x (body + parsed text + tokens)"),
        ]
        only = set(args.only.split(","))
        keys = {"embed server": "embed", "FFN shard": "ffn", "router": "router", "larql-serve": "serve"}
        for name, role, reqs, what, bound, why in [c for c in cases if keys[c[0]] in only]:
            def failures() -> dict[str, int]:
                grid = json.loads(HttpClient().request("GET", router.url + "/v1/grid").content)
                return {m["url"]: m["failures"] for m in grid["members"]}

            before = failures()
            r = load(role, reqs, args.seconds, k)
            grew = r["rss_peak"] - r["rss_start"]
            failed = [u for u, n in failures().items() if n > before.get(u, 0)]  # marked failed during this case
            verdict = (not r["errors"] and r["health_p99_ms"] <= HEALTH_P99_BOUND_MS and grew <= bound and not failed)
            ok &= verdict
            say(f"{name}: {what}")
            say(f"  {r['requests']} requests, p50 {r['req_p50_ms']:.0f} ms; RSS {r['rss_start'] / 2**20:.0f} MB -> peak "
                f"{r['rss_peak'] / 2**20:.0f} MB (+{grew / 2**20:.0f} MB; bound +{bound / 2**20:.0f} MB: {why})")
            say(f"  health during it: p50 {r['health_p50_ms']:.1f} ms, p99 {r['health_p99_ms']:.1f} ms, max "
                f"{r['health_max_ms']:.1f} ms over {r['health_n']} polls -> {'PASS' if verdict else 'FAIL'}"
                + (f"  errors: {r['errors']}" if r["errors"] else "")
                + (f"  members the router marked failed: {failed}" if failed else ""))
            say("")
        say(f"load average at end {os.getloadavg()[0]:.1f}")
    finally:
        sup.stop_all()
        hogs.__exit__(None, None, None)
    save_keeping_earlier(args.out, lines)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
