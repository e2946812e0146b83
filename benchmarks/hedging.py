"""Hedged hops: p99 token latency with one slow replica, against no slow replica, in the same run.

    python benchmarks/hedging.py [--model gemma3-270m] [--tokens 100] [--rounds 3] [--slow-ms 50] [--out ...]

The grid (processes on loopback, 1 BLAS thread each): router, embed server, layers 0-8 on two replicas
(each behind its own delay proxy, which it announces as its public URL, so the router and the
clients reach it through the proxy) and layers 9-17 on one shard. The attention-only client takes
the direct data path (shards learned from the router's /v1/topology). A "slow replica" is a proxy
adding ``--slow-ms`` to every round trip (half each way). Scenarios, each a fresh client, greedy
decode of ``--tokens`` tokens after a warm-up, per-token wall times; rounds interleave them:

- no slow replica (the baseline), hedging on;
- one replica slow from the start, hedging on and off;
- the replica the client prefers turns slow mid-run (after the warm-up), hedging on and off.

Targets (issue 18): with hedging, p99 at most 1.5x the baseline's p99 and hedges at most 10% of hops.
Figures are ratios against the baseline measured in this run: the machine is shared.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import time
from pathlib import Path

for _v in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_v] = "1"

import httpx  # noqa: E402
import numpy as np  # noqa: E402
from threadpoolctl import threadpool_limits  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent

from larql_edge.format.layers import split_even  # noqa: E402
from larql_edge.format.vindex import Vindex  # noqa: E402
from larql_edge.net.remote import RemoteSettings  # noqa: E402
from larql_edge.roles.client._build import build_remote  # noqa: E402
from larql_edge.tools.delay_proxy import DelayProxy  # noqa: E402
from larql_edge.tools.grid.cli import role_vindexes  # noqa: E402
from larql_edge.tools.grid.supervisor import Supervisor, pick_ports, role_env  # noqa: E402

PROMPT = "The history of the city begins with a small settlement on the river, where"


def decode_times(model, ids: list[int], tokens: int, warmup: int, on_warm=None) -> tuple[list[float], list[int]]:
    """Per-token wall times (seconds) of ``tokens`` greedy decode steps after ``warmup`` steps."""
    cache = model.new_cache()
    logits = model.next_logits(ids, cache)
    out, times = [], []
    for i in range(warmup + tokens):
        if i == warmup and on_warm is not None:
            on_warm()
        t0 = time.perf_counter()
        tok = int(np.argmax(logits))
        out.append(tok)
        logits = model.next_logits([tok], cache)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return times, out


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs) * 1e3, q))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--vindex", default=None)
    ap.add_argument("--tokens", type=int, default=100, help="measured decode tokens per scenario and round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--slow-ms", type=float, default=50.0, help="added to every round trip to the slow replica")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "hedging.txt"))
    args = ap.parse_args()
    threadpool_limits(1)
    lines: list[str] = []

    def say(s: str = "") -> None:
        print(s, flush=True)
        lines.append(s)

    paths = role_vindexes(args.model, args.vindex, log=lambda m: None)
    n_layers = Vindex.open(paths["client"]).num_layers
    first, second = split_even(n_layers, 2)
    host = "127.0.0.1"
    rp, ep, a1, a2, bp, p1, p2 = pick_ports(host, [19790, 19782, 19780, 19781, 19783, 19784, 19785])
    env = role_env(dict(os.environ), LARQL_GRID_KEY="bench-key", PYTHONUNBUFFERED="1")
    sup = Supervisor(Path(tempfile.mkdtemp(prefix="larql-bench-hedge-")), env)
    url = lambda p: f"http://{host}:{p}"  # noqa: E731
    common = ["--host", host, "--blas-threads", "1"]
    proxies = {url(p1): DelayProxy((host, p1), (host, a1)), url(p2): DelayProxy((host, p2), (host, a2))}
    stack = contextlib.ExitStack()
    try:
        for px in proxies.values():
            stack.enter_context(px.running())  # a thread each
        router = sup.start("router", ["larql-router", "--port", str(rp), *common], url(rp))
        sup.start("embed", ["larql-embed", str(paths["embed"]), "--port", str(ep), *common, "--join", url(rp)], url(ep))
        for name, port, public, rng in (("ffn-a1", a1, p1, first), ("ffn-a2", a2, p2, first), ("ffn-b", bp, bp, second)):
            sup.start(name, ["larql-ffn", str(paths["ffn"]), "--layers", str(rng), "--port", str(port), *common,
                             "--join", url(rp), "--public-url", url(public)], url(port))
        deadline = time.monotonic() + 900
        sup.wait_ready(sup.roles, deadline)
        while not ((v := httpx.get(router.url + "/v1/grid").json())["complete"] and v["embed"] >= 1
                   and len(v["members"]) == 4):
            if time.monotonic() > deadline:
                raise TimeoutError("grid not complete")
            time.sleep(0.2)

        ids = Vindex.open(paths["client"]).load_tokenizer().encode(PROMPT).ids
        half = args.slow_ms / 2 / 1e3

        def run(hedge: bool, slow: str | None, midway: bool = False) -> dict:
            for px in proxies.values():
                px.delay = 0.0
            model = build_remote(Vindex.open(paths["client"]), RemoteSettings(ffn=router.url, timeout=120.0, hedge=hedge))
            ffn = model.ffn_provider
            if slow == "first":
                proxies[url(p1)].delay = half

            def turn_slow() -> None:  # the replica the client now prefers for layers 0-8
                ema = ffn.path.ema
                preferred = min(proxies, key=lambda u: ema.get(u, float("inf")))
                proxies[preferred].delay = half

            calls0 = ffn.calls
            times, out = decode_times(model, ids, args.tokens, args.warmup, turn_slow if midway else None)
            st = ffn.hedger.stats() if ffn.hedger is not None else {"hedges_sent": 0, "hedges_won": 0}
            if ffn.hedger is not None:
                ffn.hedger.close()
            return {"times": times, "sent": st["hedges_sent"], "won": st["hedges_won"], "hops": ffn.calls - calls0,
                    "out": out}

        s_ms = f"{args.slow_ms:g}"
        scenarios = [("no slow replica, hedging on", True, None, False),
                     ("no slow replica, hedging off", False, None, False),
                     (f"one replica +{s_ms} ms from the start, hedging on", True, "first", False),
                     (f"one replica +{s_ms} ms from the start, hedging off", False, "first", False),
                     (f"preferred replica turns +{s_ms} ms mid-run, hedging on", True, None, True),
                     (f"preferred replica turns +{s_ms} ms mid-run, hedging off", False, None, True)]
        acc: dict[str, dict] = {sc[0]: {"times": [], "sent": 0, "won": 0, "hops": 0} for sc in scenarios}
        reference = None
        for rnd in range(args.rounds):  # rounds interleave the scenarios: machine noise hits them alike
            for name, hedge, slow, midway in scenarios:
                got = run(hedge, slow, midway)
                reference = reference or got["out"]
                if got["out"] != reference:
                    raise AssertionError(f"{name}: tokens differ from the first run's")
                a = acc[name]
                a["times"] += got["times"]
                for k in ("sent", "won", "hops"):
                    a[k] += got[k]
                print(f"  (round {rnd + 1}, {name}: p99 {pct(got['times'], 99):.1f} ms, {got['sent']} hedges)",
                      file=sys.stderr, flush=True)
        rows = [{"name": n, "p50": pct(a["times"], 50), "p99": pct(a["times"], 99), "max": max(a["times"]) * 1e3,
                 "rate": len(a["times"]) / sum(a["times"]), **{k: a[k] for k in ("sent", "won", "hops")}}
                for n, a in acc.items()]
        base = rows[0]

        say(f"larql-edge hedged hops: {args.model} ({n_layers} layers), per scenario {args.rounds} rounds x "
            f"{args.tokens} decode tokens (each after {args.warmup} warm-up tokens, a fresh client), per-token wall time")
        say(f"  grid on loopback: router + embed + layers {first} on 2 replicas (each behind a delay proxy) + "
            f"layers {second} on 1; the client takes the direct data path")
        say(f"  machine: {os.cpu_count()} cores (shared), every process 1 BLAS thread")
        say("")
        say(f"{'scenario':<58} {'p50 ms':>7} {'p99 ms':>7} {'max ms':>7} {'p99/base':>9} {'tok/s':>6} "
            f"{'hedges':>7} {'won':>5} {'% hops':>7}")
        for r in rows:
            share = 100.0 * r["sent"] / max(1, r["hops"])
            say(f"{r['name']:<58} {r['p50']:7.1f} {r['p99']:7.1f} {r['max']:7.1f} {r['p99'] / base['p99']:8.2f}x "
                f"{r['rate']:6.1f} {r['sent']:7d} {r['won']:5d} {share:6.2f}%")
        say("")
        worst = max(r["p99"] / base["p99"] for r in rows if "hedging on" in r["name"])
        share = max(100.0 * r["sent"] / max(1, r["hops"]) for r in rows if "hedging on" in r["name"])
        say(f"With hedging: worst p99 {worst:.2f}x the baseline's (target <= 1.5x); hedges at most {share:.2f}% of "
            "FFN hops (target <= 10%). Output identical in every scenario.")
    finally:
        sup.stop_all()
        stack.close()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines) + "\n")
    print(f"\n(saved to {args.out})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
