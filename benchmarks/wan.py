"""WAN benchmark: decode through the grid when the client is far from it, against the local forward,
with speculative decoding off and on.

    python benchmarks/wan.py [--model gemma3-270m] [--delays 0,2,10,25] [--tokens 16] [--rounds 2]
                             [--spec-tokens 32] [--spec-k 4] [--out benchmarks/results/wan.txt]

A local grid (router + embed server + 2 FFN shards, loopback, 1 BLAS thread each, as `larql-grid
up` starts them) with the project's delay proxy (larql_edge/tools/delay_proxy.py) between the
attention-only client and the router: every byte is delayed by D ms in each direction, so each
request/reply costs 2 x D more. This machine's kernel has no netem, hence the user-space proxy.

For each one-way delay D it reports decode tokens/s (greedy, KV cache, prefill excluded), the
time to first token of a short prompt, and the network round trips per decode token, COUNTED on
the client's HTTP transport (embed lookup, one walk-ffn per layer, logits), next to the local
single-process forward measured in the same run, and the simple model
    seconds per token = (seconds per token at 0 ms) + round trips x 2 x D
so a reader can extrapolate to their own link.

Then, at each delay, speculative decoding (`larql_edge.model.speculative`, n-gram drafts from the
context, adaptive k) against plain decoding ("today"), on two prompt sets: INPUT-GROUNDED (extract,
edit, summarize, continue code: the output copies from the input) and OPEN-ENDED chat. Both decode
the same number of tokens greedily and must give the same tokens (checked); the ratio is on/off
measured in the same run, and the round trips per token are counted on the transport.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

for _v in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_v] = "1"

import httpx  # noqa: E402
import numpy as np  # noqa: E402
from threadpoolctl import threadpool_limits  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from larql_edge.format.layers import split_even  # noqa: E402
from larql_edge.format.vindex import Vindex  # noqa: E402
from larql_edge.model.forward import Transformer  # noqa: E402
from larql_edge.net import h1_sync  # noqa: E402
from larql_edge.net.remote import RemoteSettings  # noqa: E402
from larql_edge.roles.client._build import build_remote  # noqa: E402
from larql_edge.tools.grid.cli import role_vindexes  # noqa: E402
from larql_edge.tools.grid.supervisor import Supervisor, pick_ports, role_env  # noqa: E402

PROMPT = "The capital of France is"

# Prompts whose continuation copies from the input (what n-gram drafting is for).
GROUNDED = [
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n    return a * b\n\n"
    "def div(a, b):\n",
    "Extract the names and cities.\nText: Alice Johnson lives in Berlin. Bob Smith lives in Paris. Carol White "
    "lives in Rome.\nNames and cities:\n- Alice Johnson: Berlin\n-",
    "Fix the spelling.\nInput: The quick brwn fox jumpd over the lazy dog near the river bank.\nOutput: The quick",
]
# Open-ended chat: little to copy.
OPEN_ENDED = [
    "Tell me about your favourite holiday.",
    "Why do people enjoy music?",
    "Write a short poem about the sea.",
]


class CountingTransport:
    """Counts the client's HTTP requests by path: the round trips a token costs, measured."""

    def __init__(self):
        self.counts: Counter[str] = Counter()
        self._orig = h1_sync.HttpClient.request
        counts = self.counts
        orig = self._orig

        def request(client, method, url, *a, **kw):
            counts[url.split("/", 3)[-1].split("?")[0]] += 1
            return orig(client, method, url, *a, **kw)

        h1_sync.HttpClient.request = request

    def close(self) -> None:
        h1_sync.HttpClient.request = self._orig


def timed(tokens_iter) -> tuple[float, list[int]]:
    """(decode seconds after the first token, the tokens) of a token generator."""
    out: list[int] = []
    t1 = 0.0
    for t in tokens_iter:
        if not out:
            t1 = time.perf_counter()
        out.append(int(t))
    return time.perf_counter() - t1, out


def plain(model: Transformer, ids: list[int], tokens: int):
    """Greedy decode of ``tokens`` tokens, one pass each (no pass after the last, as speculation)."""
    cache = model.new_cache()
    tok = int(np.argmax(model.next_logits(ids, cache)))
    for i in range(tokens):
        yield tok
        if i + 1 < tokens:
            tok = int(np.argmax(model.next_logits([tok], cache)))


def decode(model: Transformer, ids: list[int], tokens: int) -> tuple[float, float, list[int]]:
    """(time to first token, decode tokens/s after it, the tokens)."""
    cache = model.new_cache()
    t0 = time.perf_counter()
    logits = model.next_logits(ids, cache)
    ttft = time.perf_counter() - t0
    out = [int(np.argmax(logits))]
    t1 = time.perf_counter()
    for _ in range(tokens):
        logits = model.next_logits([out[-1]], cache)
        out.append(int(np.argmax(logits)))
    return ttft, tokens / (time.perf_counter() - t1), out


@contextlib.contextmanager
def proxy_process(host: str, target_port: int, delay_ms: float, jitter_ms: float):
    """The delay proxy as a process of its own (`python -m larql_edge.tools.delay_proxy`), as a
    network hop is: in this process it would share the GIL with the client's own math."""
    (port,) = pick_ports(host, [19700])
    p = subprocess.Popen([sys.executable, "-m", "larql_edge.tools.delay_proxy", "--listen", f"{host}:{port}",
                          "--target", f"{host}:{target_port}", "--delay-ms", str(delay_ms), "--jitter-ms",
                          str(jitter_ms), "--seed", "1"], stderr=subprocess.PIPE, text=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        line = p.stderr.readline()  # printed once it listens
        if "delay_proxy:" not in line:
            raise RuntimeError(f"delay proxy did not start: {line}{p.stderr.read() if p.poll() is not None else ''}")
        yield f"http://{host}:{port}"
    finally:
        p.terminate()
        p.wait(10)


def speculation(model: Transformer, tok, args, counter: CountingTransport) -> dict:
    """Per prompt set: decode tokens/s off and on, round trips per token, drafts kept."""
    from larql_edge.model import speculative

    out = {}
    for name, prompts in (("input-grounded", GROUNDED), ("open-ended", OPEN_ENDED)):
        t_off = t_on = 0.0
        n_tok = rt_off = rt_on = 0
        stats = speculative.SpecStats()
        for prompt in prompts:
            ids = tok.encode(prompt).ids
            counter.counts.clear()
            dt, want = timed(plain(model, ids, args.spec_tokens))
            rt_off += sum(counter.counts.values())
            counter.counts.clear()
            dt_on, got = timed(speculative.generate(model, ids, args.spec_tokens, stop_ids=[], max_k=args.spec_k,
                                                    stats=stats))
            rt_on += sum(counter.counts.values())
            if got != want:
                raise AssertionError(f"{name} {prompt!r}: speculation changed the tokens: {got} vs {want}")
            t_off, t_on, n_tok = t_off + dt, t_on + dt_on, n_tok + len(want)
        decoded = n_tok - len(prompts)  # the first token of each prompt is the prefill's
        out[name] = {"off": decoded / t_off, "on": decoded / t_on, "rt_off": rt_off / n_tok, "rt_on": rt_on / n_tok,
                     "drafted": stats.drafted, "accepted": stats.accepted,
                     "tokens_per_pass": (stats.tokens - len(prompts)) / max(1, stats.passes)}
    return out


def remote_args(url: str, direct: bool = False) -> RemoteSettings:
    """Through the router by default: the delay proxy sits in front of it, and the direct path would
    send walk-ffn straight to the shards on loopback, around the delay."""
    return RemoteSettings(ffn=url, timeout=120.0, retries=2, direct=direct)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--vindex", default=None, help="use this vindex instead of the cached one")
    ap.add_argument("--delays", default="0,2,10,25", help="one-way delays in ms, comma-separated")
    ap.add_argument("--jitter-ms", type=float, default=0.0)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--spec-tokens", type=int, default=32, help="tokens per prompt in the speculation table")
    ap.add_argument("--spec-k", type=int, default=4, help="drafts per pass at most")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "wan.txt"))
    args = ap.parse_args()
    delays = [float(d) for d in args.delays.split(",") if d.strip()]
    threadpool_limits(1)
    lines: list[str] = []

    def say(s: str = "") -> None:
        print(s, flush=True)
        lines.append(s)

    paths = role_vindexes(args.model, args.vindex, log=lambda m: None)
    if args.vindex:
        vindex = Path(args.vindex)
    else:
        from larql_edge.tools.slicer.cache import cached_vindex

        vindex = cached_vindex(args.model, dtype="f16", log=lambda m: None)
    n_layers = Vindex.open(vindex).num_layers
    ranges = split_even(n_layers, 2)
    host = "127.0.0.1"
    rp, ep, *sp = pick_ports(host, [19690, 19682, 19680, 19681])
    env = role_env(dict(os.environ), LARQL_GRID_KEY="bench-key", PYTHONUNBUFFERED="1")
    sup = Supervisor(Path(tempfile.mkdtemp(prefix="larql-bench-wan-")), env)
    url = lambda p: f"http://{host}:{p}"  # noqa: E731
    common = ["--host", host, "--blas-threads", "1"]
    counter = CountingTransport()
    try:
        router = sup.start("router", ["larql-router", "--port", str(rp), *common], url(rp))
        sup.start("embed", ["larql-embed", str(paths["embed"]), "--port", str(ep), *common, "--join", url(rp)], url(ep))
        for r, p in zip(ranges, sp, strict=True):
            sup.start(f"ffn-{r}", ["larql-ffn", str(paths["ffn"]), "--layers", str(r), "--port", str(p), *common,
                                   "--join", url(rp)], url(p))
        deadline = time.monotonic() + 900
        sup.wait_ready(sup.roles, deadline)
        while not (v := httpx.get(router.url + "/v1/grid").json())["complete"] or v["embed"] < 1:
            if time.monotonic() > deadline:
                raise TimeoutError("grid not complete")
            time.sleep(0.2)

        tok = Vindex.open(vindex).load_tokenizer()
        ids = tok.encode(PROMPT).ids
        local = Transformer.local(vindex)
        say(f"larql-edge WAN benchmark: {args.model} ({n_layers} layers), {args.tokens} decode tokens after a "
            f"{len(ids)}-token prompt, best of {args.rounds} rounds")
        say(f"  machine: {os.cpu_count()} cores (shared), every process 1 BLAS thread; grid on loopback "
            f"(router + embed + 2 shards {', '.join(str(r) for r in ranges)})")
        say(f"  the delay proxy (its own process) sits between the client and the router: D ms added each "
            f"way (jitter {args.jitter_ms:g} ms); router <-> shards stay on loopback; with the proxy the client "
            "goes through the router (the direct path would go around the proxy)")
        say("")

        base = [decode(local, ids, args.tokens) for _ in range(args.rounds)]
        local_rate = max(b[1] for b in base)
        reference = base[0][2]
        no_proxy = {}
        for how in ("router", "direct"):  # no proxy: the grid's own cost, through the router or the direct path
            m = build_remote(Vindex.open(paths["client"]), remote_args(router.url, direct=how == "direct"))
            decode(m, ids, 2)
            no_proxy[how] = max(decode(m, ids, args.tokens)[1] for _ in range(args.rounds))

        rows: list[dict] = []
        spec_rows: list[dict] = []
        for d in delays:
            with proxy_process(host, rp, d, args.jitter_ms) as proxy_url:
                model = build_remote(Vindex.open(paths["client"]), remote_args(proxy_url))
                decode(model, ids, 2)  # warm: connections open, caches filled
                results = []
                for _ in range(args.rounds):
                    counter.counts.clear()
                    ttft, rate, out = decode(model, ids, args.tokens)
                    if out != reference:
                        raise AssertionError(f"D={d} ms: tokens differ from the local forward: {out} vs {reference}")
                    results.append((ttft, rate, dict(counter.counts)))
                spec_rows.append({"d": d, **speculation(model, tok, args, counter)})
            ttft = min(r[0] for r in results)
            rate = max(r[1] for r in results)
            counts = results[0][2]
            total = sum(counts.values())
            # the counts cover the prefill (one round) and `tokens` decode steps
            per_token = total / (args.tokens + 1)
            rows.append({"d": d, "rate": rate, "ttft": ttft, "per_token": per_token, "counts": counts})

        t0 = 1.0 / rows[0]["rate"] if rows and rows[0]["d"] == 0 else None
        say(f"{'one-way':>8} {'RTT':>6} {'decode':>10} {'vs local':>9} {'ms/token':>9} {'model':>9} "
            f"{'TTFT':>8} {'round trips/token':>18}")
        say(f"{'local':>8} {'-':>6} {local_rate:7.1f} t/s {1.0:8.2f}x {1e3 / local_rate:8.1f} {'':>9} "
            f"{min(b[0] for b in base) * 1e3:6.0f}ms {'0 (one process)':>18}")
        for how, rate in no_proxy.items():
            note = "(no proxy, via router)" if how == "router" else f"(no proxy) {rate / no_proxy['router']:.2f}x router"
            say(f"{how:>8} {'-':>6} {rate:7.1f} t/s {rate / local_rate:8.2f}x {1e3 / rate:8.1f} "
                f"{'':>9} {'':>8} {note:>18}")
        for r in rows:
            model_ms = f"{(t0 + r['per_token'] * 2 * r['d'] / 1e3) * 1e3:8.1f}" if t0 else "       -"
            say(f"{r['d']:6.0f}ms {2 * r['d']:4.0f}ms {r['rate']:7.1f} t/s {r['rate'] / local_rate:8.2f}x "
                f"{1e3 / r['rate']:8.1f} {model_ms:>9} {r['ttft'] * 1e3:6.0f}ms {r['per_token']:18.1f}")
        say("")
        c = rows[0]["counts"]
        say("Round trips per token, counted on the client's transport (prefill + decode steps, by route):")
        for route, n in sorted(c.items()):
            say(f"  {route:22s} {n / (args.tokens + 1):5.1f} per token")
        say(f"  = 1 embed lookup + {n_layers} walk-ffn (one per layer: each layer's FFN input needs that layer's "
            "attention output, so layers cannot be batched in decode) + 1 logits")
        say("")
        say("'model' is (ms/token at 0 ms) + round trips x RTT: a far client pays every round trip of every token.")
        say("")
        say(f"Speculative decoding (n-gram drafts, k <= {args.spec_k} adaptive), {args.spec_tokens} greedy tokens per "
            f"prompt, {len(GROUNDED)} prompts per set; 'off' is today's decode, measured in the same run; the tokens "
            "are checked equal:")
        say(f"{'one-way':>8} {'set':>15} {'off t/s':>8} {'on t/s':>8} {'on/off':>7} {'RT/tok off':>10} "
            f"{'RT/tok on':>10} {'drafts kept':>12} {'tok/pass':>9}")
        for r in spec_rows:
            for name in ("input-grounded", "open-ended"):
                x = r[name]
                say(f"{r['d']:6.0f}ms {name:>15} {x['off']:8.2f} {x['on']:8.2f} {x['on'] / x['off']:6.2f}x "
                    f"{x['rt_off']:10.1f} {x['rt_on']:10.1f} {x['accepted']:5d}/{x['drafted']:<6d} "
                    f"{x['tokens_per_pass']:9.2f}")
        say("(tokens/s over the decode after the first token, summed over the set's prompts; RT/tok: the client's "
            "requests per generated token, prefill included)")
        say(f"(load average during the run: {' '.join(f'{x:.1f}' for x in os.getloadavg())})")
    finally:
        counter.close()
        sup.stop_all()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines) + "\n")
    print(f"\n(saved to {args.out})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
