"""larql-serve benchmark: aggregate decode tokens/s and p50/p99 TTFT / inter-token latency at 1, 4, 16, 32
(and --streams ...) concurrent streams, each as a ratio to the 1-stream figures measured in this run;
and the FFN requests per step (the number of layers, whatever the concurrency: continuous batching).

    python benchmarks/serve.py [--model gemma3-270m] [--tokens 32] [--streams 1,4,16,32] [--rounds 3] [--out benchmarks/results/serve.txt]
    python benchmarks/serve.py --part prompt-cache [--out benchmarks/results/serve_prompt_cache.txt]
    python benchmarks/serve.py --structured [--streams 1,8]   # structured output's cost per token
    python benchmarks/serve.py --baseline /work/wt/_base [--baseline-python DIR/.venv/bin/python] [--streams 1,16]

--baseline DIR: two grids side by side, every role of one run from DIR (PYTHONPATH; with DIR's own .venv, or
--baseline-python, its interpreter and entry points, so an older tree keeps the dependencies it declared),
the other's from this tree (--kernel-threads N: its roles'
LARQL_KERNEL_THREADS, for equal threads against a tree whose kernels ignored --blas-threads; --quant:
the vindex form); rounds alternate between them level by level (the same neighbours' load for both), and the table gives
each level for both with the ratio this / baseline, and the per-step breakdown: lm_head (the embed server's
product + top-k), FFN (the shards' compute), attention (larql-serve's own layers), hops and the rest (the
step's wall time minus those: network, parsing, queueing, the scheduler).

--part prompt-cache: the time to first token of the 5th turn of a multi-turn conversation (each turn re-sends
the whole history, as a chat client does) on a larql-serve with its prefix cache and on one without
(--prefix-cache-mb 0), same grid, turns alternating between the two; the ratio cached / uncached.

``--structured``: the same streams with and without ``response_format`` (a JSON schema whose replies
run long: a list of at least 64 strings), alternating in each round; tok/s with the schema as a ratio
to tok/s without it at the same level, in this run (results/serve_structured.txt).

Router, embed server, two FFN shards and larql-serve run as local processes on loopback, 1 BLAS thread
each (as `larql-grid up` starts them). The clients are SSE streams (httpx, asyncio) with different
prompts; every stream asks for --tokens greedy tokens (EOS ignored: ``stop`` none, max_tokens counted).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

for _v in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_v] = "1"

import httpx  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent

from larql_edge.format.layers import split_even  # noqa: E402
from larql_edge.format.vindex import Vindex  # noqa: E402
from larql_edge.tools.grid.cli import role_vindexes  # noqa: E402
from larql_edge.tools.grid.supervisor import Supervisor, pick_ports, role_env  # noqa: E402

SUBJECTS = ["the river", "a small town", "the old library", "winter mornings", "the harbour", "a mountain road",
            "the market", "an orchestra", "the first train", "a quiet garden", "the lighthouse", "a long letter",
            "the bakery", "a summer storm", "the museum", "a chess game", "the bridge", "an island", "the forest",
            "a school trip", "the castle", "a rainy night", "the observatory", "a street band", "the vineyard",
            "a festival", "the glacier", "a sailing boat", "the desert", "an old clock", "the canal", "a new city"]


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


# --structured: a schema whose replies run for the whole --tokens (one stays inside the list).
LONG_SCHEMA = {"type": "object", "properties": {"notes": {"type": "array", "items": {"type": "string", "maxLength": 40},
                                                          "minItems": 64}},
               "required": ["notes"], "additionalProperties": False}


async def one_stream(client: httpx.AsyncClient, url: str, model: str, i: int, tokens: int,
                     extra: dict | None = None) -> dict:
    body = {"model": model, "prompt": f"Write a few sentences about {SUBJECTS[i % len(SUBJECTS)]}.", "max_tokens": tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}, **(extra or {})}
    t0 = time.perf_counter()
    stamps: list[float] = []
    usage = None
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            d = json.loads(line[6:])
            if d.get("usage"):
                usage = d["usage"]
            if d.get("choices") and d["choices"][0].get("text"):
                stamps.append(time.perf_counter())
    assert usage is not None
    return {"t0": t0, "stamps": stamps, "tokens": usage["completion_tokens"]}


async def round_of(url: str, model: str, streams: int, tokens: int, extra: dict | None = None) -> dict:
    limits = httpx.Limits(max_connections=streams + 4, max_keepalive_connections=streams + 4)
    async with httpx.AsyncClient(timeout=900, limits=limits) as client:
        t0 = time.perf_counter()
        results = await asyncio.gather(*(one_stream(client, url, model, i, tokens, extra) for i in range(streams)))
        wall = time.perf_counter() - t0
    ttft = [r["stamps"][0] - r["t0"] for r in results if r["stamps"]]
    itl = [b - a for r in results for a, b in zip(r["stamps"], r["stamps"][1:], strict=False)]
    first = min(r["stamps"][0] for r in results if r["stamps"])
    last = max(r["stamps"][-1] for r in results if r["stamps"])
    decode_tokens = sum(max(0, r["tokens"] - 1) for r in results)
    return {"streams": streams, "wall": wall, "tokens": sum(r["tokens"] for r in results),
            "decode_tps": decode_tokens / max(1e-9, last - first), "agg_tps": sum(r["tokens"] for r in results) / wall,
            "ttft_p50": pct(ttft, 50), "ttft_p99": pct(ttft, 99), "itl_p50": pct(itl, 50), "itl_p99": pct(itl, 99)}


TURNS = ["Tell me about the old lighthouse on the cliff.", "Who kept it in the winter?", "What did they eat there?",
         "Did ships still pass in the storms?", "How does the story end?"]


def conversation_ttft(url: str, model: str, tokens: int, opening: str) -> tuple[float, int]:
    """Five turns of one conversation (a transcript: the history, then the new question); the 5th turn's
    time to first token and its cached prompt tokens."""
    history = opening
    ttft, cached = 0.0, 0
    with httpx.Client(timeout=600) as client:
        for q in TURNS:
            history += f"\nUser: {q}\nAssistant:"
            body = {"model": model, "prompt": history, "max_tokens": tokens, "temperature": 0, "stream": True,
                    "stream_options": {"include_usage": True}}
            t0 = time.perf_counter()
            first, parts = None, []
            with client.stream("POST", url + "/v1/completions", json=body) as r:
                if r.status_code != 200:
                    raise RuntimeError(f"HTTP {r.status_code}: {r.read()[:300]!r}")
                for line in r.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if chunk["choices"] and chunk["choices"][0]["text"]:
                        first = first or time.perf_counter()
                        parts.append(chunk["choices"][0]["text"])
                    if chunk.get("usage"):
                        cached = chunk["usage"]["prompt_tokens_details"]["cached_tokens"]
            ttft = (first or time.perf_counter()) - t0
            history += "".join(parts)
    return ttft, cached


def prompt_cache_part(sup, paths, router_url: str, ports: tuple[int, int], common: list[str], model: str,
                      rounds: int, say) -> None:
    host = common[1]
    servers = {}
    for label, extra, p in (("cache on", [], ports[0]), ("cache off", ["--prefix-cache-mb", "0"], ports[1])):
        servers[label] = sup.start(f"serve-{label.replace(' ', '-')}", [
            "larql-serve", str(paths["client"]), "--ffn", router_url, "--port", str(p), *common, "--max-active", "2",
            "--context", "2048", "--served-model-name", model, *extra], f"http://{host}:{p}")
    sup.wait_ready(list(servers.values()), time.monotonic() + 600)
    opening = ("This is a conversation between a curious user and a helpful assistant who knows the history of "
               "the coast, its lighthouses, their keepers and the ships that passed them. ") * 4
    for s in servers.values():
        conversation_ttft(s.url, model, 4, "Warm-up. ")
    got: dict[str, list[tuple[float, int]]] = {k: [] for k in servers}
    for i in range(rounds):
        for label, s in servers.items():  # the same conversation on both, alternating: the same neighbours' load
            got[label].append(conversation_ttft(s.url, model, 24, f"[{i}] " + opening))
    on = statistics.median(t for t, _ in got["cache on"])
    off = statistics.median(t for t, _ in got["cache off"])
    say(f"prompt caching: TTFT of the 5th turn of a {len(TURNS)}-turn conversation (24 greedy tokens per reply), "
        f"medians of {rounds} conversations; load average {os.getloadavg()[0]:.2f}")
    say(f"  cache on:  {on * 1e3:8.0f} ms  (cached prompt tokens at turn 5: {[c for _, c in got['cache on']]})")
    say(f"  cache off: {off * 1e3:8.0f} ms  (cached: {[c for _, c in got['cache off']]})")
    say(f"  ratio on / off: {on / off:.2f} (target <= 0.3); per conversation: "
        + ", ".join(f"{a[0] / b[0]:.2f}" for a, b in zip(got["cache on"], got["cache off"], strict=True)))


def metric_sum(url: str, name: str) -> float:
    """The sum of a histogram's ``_sum`` samples (all labels) in a server's /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(smp.value for fam in text_string_to_metric_families(text) for smp in fam.samples if smp.name == name + "_sum")


def ffn_requests(shard_urls: list[str]) -> int:
    return sum(int(httpx.get(u + "/v1/stats", timeout=10).json()["requests"]) for u in shard_urls)


def start_grid(sup, tag: str, tree: str, paths, ranges, host: str, ports: list[int], max_active: int, model: str,
               bindir: Path | None = None, serve_extra: list[str] | None = None, kernel_env: dict | None = None):
    """Router, embed server, two FFN shards and larql-serve with every role importing from ``tree``; with
    ``bindir`` (a virtual environment's bin folder) the roles run that environment's interpreter and entry
    points, so an older tree runs with the dependencies it declared (numba, say)."""
    rp, ep, sv, *sp = ports
    env = {"PYTHONPATH": tree, **(kernel_env or {})}
    if bindir is not None:
        env.update(PATH=f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}", VIRTUAL_ENV=str(bindir.parent))
    cmd = lambda name: str(bindir / name) if bindir is not None else name  # noqa: E731
    url = lambda p: f"http://{host}:{p}"  # noqa: E731
    common = ["--host", host, "--blas-threads", "1"]
    router = sup.start(f"router-{tag}", [cmd("larql-router"), "--port", str(rp), *common], url(rp), env=env)
    embed = sup.start(f"embed-{tag}", [cmd("larql-embed"), str(paths["embed"]), "--port", str(ep), *common, "--join",
                                       url(rp)], url(ep), env=env)
    shards = [sup.start(f"ffn-{tag}-{r}", [cmd("larql-ffn"), str(paths["ffn"]), "--layers", str(r), "--port", str(p),
                                           *common, "--join", url(rp)], url(p), env=env)
              for r, p in zip(ranges, sp, strict=True)]
    return {"router": router, "embed": embed, "shards": shards, "serve_argv": (
        [cmd("larql-serve"), str(paths["client"]), "--ffn", router.url, "--port", str(sv), *common, "--max-active",
         str(max_active), "--max-queue", "0", "--context", "512", "--served-model-name", model, *(serve_extra or [])],
        url(sv), env)}


def baseline_bindir(args) -> Path | None:
    """The baseline's interpreter folder: --baseline-python's, else DIR/.venv's when DIR has one, else None
    (this interpreter, the baseline's code on PYTHONPATH)."""
    py = args.baseline_python or (str(Path(args.baseline) / ".venv" / "bin" / "python")
                                  if (Path(args.baseline) / ".venv" / "bin" / "python").exists() else None)
    if py is None:
        return None
    bindir = Path(py).absolute().parent
    missing = [n for n in ("larql-router", "larql-embed", "larql-ffn", "larql-serve") if not (bindir / n).exists()]
    if missing:
        raise SystemExit(f"serve.py: {bindir} has no {', '.join(missing)}: install the baseline tree into that "
                         "environment (pip install -e DIR)")
    return bindir


def measured_round(g: dict, model: str, n: int, tokens: int) -> dict:
    """One round of ``n`` streams on grid ``g``, with the per-step breakdown from the roles' metrics (ms)."""
    serve, embed, shards = g["serve"], g["embed"], g["shards"]

    def snap() -> dict:
        return {"steps": httpx.get(serve.url + "/v1/stats").json()["scheduler"]["steps"],
                "head": metric_sum(embed.url, "larql_embed_logits_batch_duration_seconds"),
                "ffn": sum(metric_sum(s.url, "larql_ffn_layer_duration_seconds") for s in shards),
                "attention": metric_sum(serve.url, "larql_serve_local_seconds"),
                "hops": metric_sum(serve.url, "larql_serve_hop_network_seconds")}

    a = snap()
    r = asyncio.run(round_of(serve.url, model, n, tokens))
    b = snap()
    steps = max(1, b["steps"] - a["steps"])
    for k in ("head", "ffn", "attention", "hops"):
        r[k + "_ms"] = (b[k] - a[k]) / steps * 1e3
    r["step_ms"] = r["wall"] / steps * 1e3
    r["rest_ms"] = r["step_ms"] - r["head_ms"] - r["ffn_ms"] - r["attention_ms"]
    return r


def compare_part(args, paths, levels: list[int], n_layers: int, say) -> None:
    ranges = split_even(n_layers, 2)
    host = "127.0.0.1"
    ports = pick_ports(host, [19690, 19682, 19600, 19680, 19681, 19790, 19782, 19700, 19780, 19781])
    env = role_env(dict(os.environ), LARQL_GRID_KEY="bench-key", PYTHONUNBUFFERED="1")
    sup = Supervisor(Path(tempfile.mkdtemp(prefix="larql-bench-serve-")), env)
    here = str(ROOT)
    trees = {"baseline": str(Path(args.baseline).resolve()), "this": here}
    try:
        bindirs = {"baseline": baseline_bindir(args), "this": None}
        extra: dict[str, list[str]] = {"baseline": [], "this": shlex.split(args.serve_args)}
        # --kernel-threads: both trees' kernels at that many threads (LARQL_KERNEL_THREADS, which --blas-threads 1
        # leaves alone; the roles' environment drops an exported one): d8dfbd4's numba kernels split products
        # over every CPU whatever either says, a later tree's follow it
        kernel_env = {"LARQL_KERNEL_THREADS": str(args.kernel_threads)} if args.kernel_threads else None
        grids = {tag: start_grid(sup, tag, tree, paths, ranges, host, ports[5 * i: 5 * i + 5], max(levels), args.model,
                                 bindirs[tag], extra[tag], kernel_env)
                 for i, (tag, tree) in enumerate(trees.items())}
        sup.wait_ready(sup.roles, time.monotonic() + 900)
        for g in grids.values():
            while not (st := httpx.get(g["router"].url + "/v1/grid").json())["complete"] or not st["embed"]:
                time.sleep(0.2)
            argv, u, env_ = g["serve_argv"]
            g["serve"] = sup.start(f"serve-{len(sup.roles)}", argv, u, env=env_)
        sup.wait_ready([g["serve"] for g in grids.values()], time.monotonic() + 600)
        for g in grids.values():
            asyncio.run(round_of(g["serve"].url, args.model, 2, 4))  # warm-up
        say(f"larql-serve, this tree ({here}) against the baseline ({trees['baseline']}): {args.model}, {n_layers} layers, "
            f"FFN on 2 shards, {args.tokens} greedy tokens per stream, {os.cpu_count()} CPUs, 1 BLAS thread per process; "
            f"two grids side by side, rounds alternating; kernel threads "
            f"{args.kernel_threads or 'as --blas-threads (1)'}"
            f"{'; its larql-serve also ' + args.serve_args if args.serve_args else ''}; "
            f"load average before: {os.getloadavg()[0]:.2f}")
        say(f"interpreters: this {sys.executable}; baseline {bindirs['baseline'] or sys.executable}; vindexes: "
            + ", ".join(f"{k} {v}" for k, v in paths.items()))
        say("")
        runs: dict[tuple[str, int], list[dict]] = {(t, n): [] for t in grids for n in levels}
        for _ in range(args.rounds):
            for n in levels:
                for tag, g in grids.items():
                    runs[(tag, n)].append(measured_round(g, args.model, n, args.tokens))
        say(f"{'streams':>7} {'tree':>8} {'agg tok/s':>10} {'decode tok/s':>12} {'ITL p50':>8} {'step ms':>8} {'lm_head':>8} "
            f"{'FFN':>7} {'attn':>7} {'hops':>7} {'rest':>7}   (ms per step)")
        keys = ("agg_tps", "decode_tps", "itl_p50", "step_ms", "head_ms", "ffn_ms", "attention_ms", "hops_ms", "rest_ms")
        for n in levels:
            med = {t: {k: statistics.median(r[k] for r in runs[(t, n)]) for k in keys} for t in grids}
            for t in grids:
                r = med[t]
                say(f"{n:>7} {t:>8} {r['agg_tps']:>10.1f} {r['decode_tps']:>12.1f} {r['itl_p50'] * 1e3:>6.0f}ms "
                    f"{r['step_ms']:>8.1f} {r['head_ms']:>8.1f} {r['ffn_ms']:>7.1f} {r['attention_ms']:>7.1f} "
                    f"{r['hops_ms']:>7.1f} {r['rest_ms']:>7.1f}")
            per_round = [a["agg_tps"] / b["agg_tps"] for a, b in zip(runs[("this", n)], runs[("baseline", n)], strict=True)]
            say(f"{n:>7}    ratio  agg {med['this']['agg_tps'] / med['baseline']['agg_tps']:.2f}x  decode "
                f"{med['this']['decode_tps'] / med['baseline']['decode_tps']:.2f}x  (agg per round: "
                + ", ".join(f"{x:.2f}" for x in per_round) + ")")
        say(f"(medians of {args.rounds} rounds per level and tree; load average after: {os.getloadavg()[0]:.2f})")
        for tag, g in grids.items():
            spec = httpx.get(g["serve"].url + "/v1/stats").json()["scheduler"].get("speculation") or {}
            if "drafted_tokens" in spec:  # a tree with speculation: what its drafts did over every round
                say(f"speculation, {tag}: drafted {spec['drafted_tokens']}, accepted {spec['accepted_tokens']}"
                    + (f", withheld {spec['withheld_tokens']} (learnt step cost {spec['step_cost_ms']} ms)"
                       if "withheld_tokens" in spec else ""))
        say("lm_head: the embed server's logits_batch_duration per step; FFN: the shards' layer_duration per step; attn:")
        say("larql-serve's local_seconds (its layers' norms, projections, attention) per step; hops: its hop_network_seconds")
        say("per step (network and queueing of the FFN/embed/logits hops, overlapping nothing: steps are sequential); rest:")
        say("step ms - lm_head - FFN - attn (the hops, parsing and the scheduler).")
    finally:
        sup.stop_all()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--vindex", default=None, help="one vindex for every role (default: the cached slices)")
    ap.add_argument("--quant", choices=["none", "q4k", "gguf"], default="none",
                    help="the cached vindex's form (as larql-grid up --quant): none (f16), q4k or gguf (the tied "
                         "lm_head then multiplied as Q8_0)")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--streams", default="1,4,16,32")
    ap.add_argument("--rounds", type=int, default=3, help="rounds through every level (medians reported)")
    ap.add_argument("--out", default=None,
                    help="default: benchmarks/results/serve.txt (serve_structured.txt, serve_prompt_cache.txt)")
    ap.add_argument("--structured", action="store_true",
                    help="structured output's cost: tok/s with and without a JSON schema (default streams 1,8)")
    ap.add_argument("--baseline", default=None,
                    help="a checkout to compare with (e.g. /work/wt/_base): two grids, rounds alternating, ratios")
    ap.add_argument("--kernel-threads", type=int, default=None,
                    help="with --baseline: LARQL_KERNEL_THREADS for both trees' roles (the code before --blas-threads "
                         "capped the kernels split its products over every CPU: 2 here; equal threads compare)")
    ap.add_argument("--baseline-python", default=None,
                    help="the baseline's interpreter (its venv's bin holds the larql-* entry points); default: "
                         "DIR/.venv/bin/python when it exists, else this interpreter")
    ap.add_argument("--serve-args", default="",
                    help="with --baseline: more larql-serve arguments for this tree's grid (e.g. --no-speculate; "
                         "--baseline . --baseline-python .venv/bin/python then compares one option on one tree)")
    ap.add_argument("--part", choices=["streams", "prompt-cache"], default="streams",
                    help="prompt-cache: the 5th turn's TTFT with the prefix cache on vs off")
    args = ap.parse_args()
    if args.structured and args.streams == "1,4,16,32":
        args.streams = "1,8"
    args.out = args.out or str(ROOT / "benchmarks" / "results" / (
        "serve_structured.txt" if args.structured else "serve_prompt_cache.txt" if args.part == "prompt-cache"
        else "serve.txt"))
    levels = [int(x) for x in args.streams.split(",")]
    paths = role_vindexes(args.model, args.vindex, log=lambda m: None, quant=args.quant)
    n_layers = Vindex.open(paths["ffn"]).num_layers
    if args.baseline:
        out: list[str] = []

        def say_(s: str = "") -> None:
            print(s, flush=True)
            out.append(s)

        if args.out.endswith("serve.txt"):
            args.out = str(ROOT / "benchmarks" / "results" / "serve-vs-baseline.txt")
        try:
            compare_part(args, paths, levels, n_layers, say_)
        finally:
            from _support import save_keeping_earlier

            save_keeping_earlier(args.out, out)
            print(f"written to {args.out} (earlier runs kept)")
        return 0
    ranges = split_even(n_layers, 2)
    host = "127.0.0.1"
    rp, ep, sv, sv2, *sp = pick_ports(host, [19690, 19682, 19600, 19601, 19680, 19681])
    env = role_env(dict(os.environ), LARQL_GRID_KEY="bench-key", PYTHONUNBUFFERED="1")
    sup = Supervisor(Path(tempfile.mkdtemp(prefix="larql-bench-serve-")), env)
    url = lambda p: f"http://{host}:{p}"  # noqa: E731
    common = ["--host", host, "--blas-threads", "1"]
    lines: list[str] = []

    def say(s: str = "") -> None:
        print(s, flush=True)
        lines.append(s)

    try:
        router = sup.start("router", ["larql-router", "--port", str(rp), *common], url(rp))
        embed = sup.start("embed", ["larql-embed", str(paths["embed"]), "--port", str(ep), *common, "--join", url(rp)], url(ep))
        shards = [sup.start(f"ffn-{r}", ["larql-ffn", str(paths["ffn"]), "--layers", str(r), "--port", str(p), *common,
                                         "--join", url(rp)], url(p), layers=str(r)) for r, p in zip(ranges, sp, strict=True)]
        deadline = time.monotonic() + 900
        sup.wait_ready(sup.roles, deadline)
        while not httpx.get(router.url + "/v1/grid").json()["complete"] or not httpx.get(router.url + "/v1/grid").json()["embed"]:
            time.sleep(0.2)
        if args.part == "prompt-cache":
            prompt_cache_part(sup, paths, router.url, (sv, sv2), common, args.model, args.rounds, say)
            return 0
        serve = sup.start("serve", ["larql-serve", str(paths["client"]), "--ffn", router.url, "--port", str(sv), *common,
                                    "--max-active", str(max(levels)), "--max-queue", "0", "--context", "512",
                                    "--served-model-name", args.model], url(sv))
        sup.wait_ready([serve], time.monotonic() + 600)
        asyncio.run(round_of(serve.url, args.model, 2, 4))  # warm-up: connections, the lm_head, the kernels
        if args.structured:
            structured(say, serve.url, args, levels, n_layers)
        else:
            say(f"larql-serve benchmark: {args.model}, {n_layers} layers, FFN on 2 shards ({', '.join(map(str, ranges))}), "
                f"{args.tokens} greedy tokens per stream, {os.cpu_count()} CPUs, 1 BLAS thread per process; "
                f"load average before: {os.getloadavg()[0]:.2f} (a shared machine: others' work slows every row)")
            say("")
            say(f"{'streams':>7} {'agg tok/s':>10} {'x 1':>6} {'decode tok/s':>12} {'x 1':>6} {'TTFT p50':>9} {'p99':>7} "
                f"{'ITL p50':>8} {'p99':>7} {'FFN req/step':>12} {'head ms/step':>12} {'FFN ms/step':>11} {'step ms':>8}")
            # Rounds cycle through every level (1, 4, 16, ...; again), and each level's figures are the medians
            # over its rounds: the ratios compare levels measured under the same neighbours' load.
            runs: dict[int, list[dict]] = {n: [] for n in levels}
            for _ in range(args.rounds):
                for n in levels:
                    s0 = httpx.get(serve.url + "/v1/stats").json()["scheduler"]["steps"]
                    f0 = ffn_requests([s.url for s in shards])
                    h0 = metric_sum(embed.url, "larql_embed_logits_batch_duration_seconds")
                    c0 = sum(metric_sum(s.url, "larql_ffn_layer_duration_seconds") for s in shards)
                    r = asyncio.run(round_of(serve.url, args.model, n, args.tokens))
                    steps = max(1, httpx.get(serve.url + "/v1/stats").json()["scheduler"]["steps"] - s0)
                    r["per_step"] = (ffn_requests([s.url for s in shards]) - f0) / steps
                    r["head_ms"] = (metric_sum(embed.url, "larql_embed_logits_batch_duration_seconds") - h0) / steps * 1e3
                    r["ffn_ms"] = (sum(metric_sum(s.url, "larql_ffn_layer_duration_seconds") for s in shards) - c0) / steps * 1e3
                    r["step_ms"] = r["wall"] / steps * 1e3
                    runs[n].append(r)
            med = {n: {k: statistics.median(r[k] for r in rs) for k in rs[0] if isinstance(rs[0][k], (int, float))}
                   for n, rs in runs.items()}
            base = med[levels[0]]
            for n in levels:
                r = med[n]
                say(f"{n:>7} {r['agg_tps']:>10.1f} {r['agg_tps'] / base['agg_tps']:>6.2f} {r['decode_tps']:>12.1f} "
                    f"{r['decode_tps'] / base['decode_tps']:>6.2f} {r['ttft_p50'] * 1e3:>7.0f}ms {r['ttft_p99'] * 1e3:>5.0f}ms "
                    f"{r['itl_p50'] * 1e3:>6.0f}ms {r['itl_p99'] * 1e3:>5.0f}ms {r['per_step']:>12.2f} {r['head_ms']:>12.1f} "
                    f"{r['ffn_ms']:>11.1f} {r['step_ms']:>8.1f}")
            say(f"(medians of {args.rounds} rounds per level; the ratios per round at the largest level: "
                + ", ".join(f"{x['decode_tps'] / y['decode_tps']:.2f}" for x, y in zip(runs[levels[-1]], runs[levels[0]], strict=True))
                + ")")
            say(f"load average after: {os.getloadavg()[0]:.2f}")
            say("")
            say("agg tok/s: completion tokens / wall time of the round (prefill included); decode tok/s: tokens after")
            say("the first / (last token - first token of the round); ratios against the 1-stream row of this run.")
            say(f"FFN req/step: walk-ffn requests the shards answered / scheduler steps (one per layer: {n_layers}).")
            say("head ms/step: the embed server's lm_head product + top-k per step (its logits_batch_duration); FFN ms/step:")
            say("the shards' FFN compute per step (layer_duration); step ms: round wall time / steps. What is left of a")
            say("step is larql-serve's attention (one thread) and the hops. Steps run one after another, so the step time is")
            say("their sum: the lm_head (262144 x 640, ~4-5 ms per row on these 2 cores) grows with the rows and bounds the")
            say("aggregate rate at 16+ streams, the FFN next; neither is shared with another step (2 cores, all roles).")
    finally:
        sup.stop_all()
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text("\n".join(lines) + "\n")
        print(f"written to {args.out}")
    return 0


def structured(say, url: str, args, levels: list[int], n_layers: int) -> None:
    """Structured output's cost per token: the same streams with and without response_format, alternating."""
    schema = {"response_format": {"type": "json_schema", "json_schema": {"name": "notes", "schema": LONG_SCHEMA,
                                                                          "strict": True}}}
    asyncio.run(round_of(url, args.model, 1, 4, schema))  # warm-up: the grammar engine's vocabulary index
    say(f"larql-serve structured output: {args.model}, {n_layers} layers, FFN on 2 shards, {args.tokens} greedy tokens "
        f"per stream, {os.cpu_count()} CPUs, 1 BLAS thread per process; load average before: {os.getloadavg()[0]:.2f}")
    say("")
    say(f"{'streams':>7} {'plain tok/s':>11} {'schema tok/s':>12} {'ratio':>6} {'plain ITL p50':>13} {'schema ITL p50':>14}")
    runs: dict[tuple[int, bool], list[dict]] = {(n, s): [] for n in levels for s in (False, True)}
    for _ in range(args.rounds):
        for n in levels:
            for with_schema in (False, True):
                runs[(n, with_schema)].append(asyncio.run(round_of(url, args.model, n, args.tokens,
                                                                   schema if with_schema else None)))
    ratios = []
    for n in levels:
        plain = {k: statistics.median(r[k] for r in runs[(n, False)]) for k in ("decode_tps", "itl_p50", "tokens")}
        sch = {k: statistics.median(r[k] for r in runs[(n, True)]) for k in ("decode_tps", "itl_p50", "tokens")}
        ratios.append(sch["decode_tps"] / plain["decode_tps"])
        say(f"{n:>7} {plain['decode_tps']:>11.1f} {sch['decode_tps']:>12.1f} {ratios[-1]:>6.2f} "
            f"{plain['itl_p50'] * 1e3:>11.0f}ms {sch['itl_p50'] * 1e3:>12.0f}ms   (tokens per round {plain['tokens']:.0f} / "
            f"{sch['tokens']:.0f})")
    say(f"(medians of {args.rounds} rounds, plain and schema alternating in each; load average after: {os.getloadavg()[0]:.2f})")
    say("")
    say("decode tok/s: tokens after the first / (last token - first token of the round); ratio: with the schema /")
    say("without, same level, same run. The schema's cost per token: the mask (llguidance, in the scheduler thread),")
    say("32 KB of bitmask per constrained row to the embed server, its unpack and select before the top k.")


if __name__ == "__main__":
    sys.exit(main())
