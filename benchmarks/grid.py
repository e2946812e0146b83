"""Grid benchmark: decode tokens/s through the three-tier grid against the local single-process
forward measured in the same run, per-hop latency, 59-token prefill, and the RSS of each role.

    python benchmarks/grid.py [--model gemma3-270m] [--tokens 32] [--rounds 3] [--replicas 2]
                              [--compare-code DIR] [--out benchmarks/results/grid.txt]
    python benchmarks/grid.py --compare-grid DIR [--compare-python PY] [--kernel-threads N] [--rounds 3]

``--replicas 2`` (the default) runs two replicas of each range, so the direct data path hedges its hops
as on a production grid. ``--compare-code DIR`` also decodes on the direct path from client processes
running this tree and the larql-edge tree at DIR (e.g. an older checkout), alternately, for a
same-run ratio of the two versions' clients against the same grid. ``--compare-grid DIR`` (alone) runs
two whole grids, every role and the client of this tree and of DIR (DIR's own .venv, or --compare-python:
an older tree keeps its own dependencies), and decodes on each alternately: grid decode version against
version.

Every role runs as a local process on loopback with 1 BLAS thread (as `larql-grid up` starts them);
this process also pins itself to 1 BLAS thread, so the baseline and the grid get the same compute.
Figures are ratios against a baseline measured in this run: the machine is shared.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

for _v in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_v] = "1"

import httpx  # noqa: E402
import numpy as np  # noqa: E402
import psutil  # noqa: E402
from threadpoolctl import threadpool_limits  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent

from _support import median_ms, tree_rss  # noqa: E402  (benchmarks/ is the script's folder)

from larql_edge.format.layers import split_even  # noqa: E402
from larql_edge.format.vindex import Vindex  # noqa: E402
from larql_edge.model.forward import Transformer  # noqa: E402
from larql_edge.net.remote import RemoteSettings  # noqa: E402
from larql_edge.roles.client._build import build_remote  # noqa: E402
from larql_edge.tools.grid.cli import role_vindexes  # noqa: E402
from larql_edge.tools.grid.supervisor import Supervisor, pick_ports, role_env  # noqa: E402
from larql_edge.wire import embed as ew  # noqa: E402
from larql_edge.wire import ffn as fw  # noqa: E402

TEXT = ("The history of the city begins with a small settlement on the river, where fishermen and traders met "
        "to exchange goods. Over the centuries it grew into a busy port, then a capital, and today it is known "
        "for its museums, its bridges and the long walks along the water that visitors remember.")


def remote_args(**kw) -> RemoteSettings:
    return RemoteSettings(**{"timeout": 120.0, "retries": 4, **kw})


def decode_rate(model: Transformer, ids: list[int], tokens: int) -> float:
    """Tokens/s of greedy decode with the KV cache (the prefill is excluded)."""
    cache = model.new_cache()
    logits = model.next_logits(ids, cache)
    t0 = time.perf_counter()
    for _ in range(tokens):
        logits = model.next_logits([int(np.argmax(logits))], cache)
    return tokens / (time.perf_counter() - t0)


def prefill_seconds(model: Transformer, ids: list[int]) -> float:
    t0 = time.perf_counter()
    model.next_logits(ids, model.new_cache())
    return time.perf_counter() - t0



def client_rss_mb(vindex: Path, router: str) -> float:
    """Peak RSS of an attention-only client process running one prediction through the grid."""
    code = (
        "import psutil\n"
        "from larql_edge.roles.client._build import build_remote\n"
        "from larql_edge.format.vindex import Vindex\n"
        "from larql_edge.net.remote import RemoteSettings\n"
        f"m = build_remote(Vindex.open({str(vindex)!r}), RemoteSettings(ffn={router!r}, timeout=120.0, retries=2))\n"
        "m.next_logits([2, 818, 5279, 529, 7001, 563])\n"
        "mi = psutil.Process().memory_info()\n"
        "print(mi.rss / 2**20)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    if r.returncode:
        raise RuntimeError(r.stderr)
    return float(r.stdout.strip().splitlines()[-1])


_DECODE_CHILD = """
import os, sys, time, json
import numpy as np
from threadpoolctl import threadpool_limits
threadpool_limits(1)
from larql_edge.format.vindex import Vindex
from larql_edge.roles.client._build import build_remote
try:
    from larql_edge.net.remote import RemoteSettings
    settings = RemoteSettings(ffn=sys.argv[2], timeout=120.0, retries=4)
except ImportError:  # an older tree (before net/): build_remote read the CLI's namespace
    import argparse
    settings = argparse.Namespace(ffn=sys.argv[2], embed=None, timeout=120.0, retries=4, ffn_f16=False,
                                  logits_top_k=64, blas_threads=1, vindex=sys.argv[1])
m = build_remote(Vindex.open(sys.argv[1]), settings)
ids, tokens = json.loads(sys.argv[3]), int(sys.argv[4])
cache = m.new_cache()
logits = m.next_logits(ids, cache)
for _ in range(tokens):  # warm-up: the topology is learned, the hop times too
    logits = m.next_logits([int(np.argmax(logits))], cache)
cache = m.new_cache()
logits = m.next_logits(ids, cache)
t0 = time.perf_counter()
for _ in range(tokens):
    logits = m.next_logits([int(np.argmax(logits))], cache)
print(tokens / (time.perf_counter() - t0))
"""


def child_decode_rate(code: Path, vindex: Path, router: str, ids: list[int], tokens: int,
                      python: str | None = None, threads: int = 1) -> float:
    """Decode tok/s on the direct path from a client process running the larql-edge tree at ``code``
    (with ``python``: that interpreter, e.g. the tree's own virtual environment)."""
    import json

    # one thread of products by default, as `larql generate --ffn` pins its own (BLAS and the kernels)
    env = {**os.environ, "PYTHONPATH": str(code), "LARQL_KERNEL_THREADS": str(threads)}
    r = subprocess.run([python or sys.executable, "-c", _DECODE_CHILD, str(vindex), router, json.dumps(ids), str(tokens)],
                       capture_output=True, text=True, cwd=str(code), env=env, timeout=900)
    if r.returncode:
        raise RuntimeError(r.stderr[-2000:])
    return float(r.stdout.strip().splitlines()[-1])


def tree_python(tree: Path, python: str | None) -> str | None:
    """The interpreter that runs ``tree``'s code: ``python``, else the tree's own .venv when it has one."""
    if python:
        return str(Path(python).absolute())
    own = tree / ".venv" / "bin" / "python"
    return str(own) if own.exists() else None


def start_grid(sup, tag: str, tree: Path | None, python: str | None, paths, ranges, replicas: int, host: str,
               ports: list[int], kernel_threads: int | None = None):
    """Router, embed server and ``replicas`` FFN shards per range, every role from ``tree`` (None: this one)
    run by ``python``'s virtual environment (its bin folder's larql-* entry points); ``kernel_threads``:
    the roles' LARQL_KERNEL_THREADS (else what --blas-threads 1 gives: one)."""
    rp, ep, *sp = ports
    env: dict[str, str] = {} if kernel_threads is None else {"LARQL_KERNEL_THREADS": str(kernel_threads)}
    cmd = lambda name: name  # noqa: E731
    if tree is not None:
        env["PYTHONPATH"] = str(tree)
    if python is not None:
        bindir = Path(python).parent
        env.update(PATH=f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}", VIRTUAL_ENV=str(bindir.parent))
        cmd = lambda name: str(bindir / name)  # noqa: E731
    url = lambda p: f"http://{host}:{p}"  # noqa: E731
    common = ["--host", host, "--blas-threads", "1"]
    router = sup.start(f"router-{tag}", [cmd("larql-router"), "--port", str(rp), *common], url(rp), env=env)
    embed = sup.start(f"embed-{tag}", [cmd("larql-embed"), str(paths["embed"]), "--port", str(ep), *common,
                                       "--join", url(rp)], url(ep), env=env)
    placed = [(r, i) for i in range(replicas) for r in ranges]
    shards = [sup.start(f"ffn-{tag}-{r}-{i}", [cmd("larql-ffn"), str(paths["ffn"]), "--layers", str(r), "--port",
                                               str(p), *common, "--join", url(rp)], url(p), env=env, layers=str(r))
              for (r, i), p in zip(placed, sp, strict=True)]
    return router, embed, shards


def compare_grids(args, paths, n_layers: int, say) -> None:
    """Whole grid against whole grid: every role and the client of this tree, and every role and the
    client of the tree at --compare-grid (its own interpreter), decoding alternately."""
    ranges = split_even(n_layers, 2)
    host = "127.0.0.1"
    n = 2 + len(ranges) * args.replicas
    ports = pick_ports(host, [*range(19590, 19590 + n), *range(19690, 19690 + n)])
    env = role_env(dict(os.environ), LARQL_GRID_KEY="bench-key", PYTHONUNBUFFERED="1")
    sup = Supervisor(Path(tempfile.mkdtemp(prefix="larql-bench-grids-")), env)
    other = Path(args.compare_grid).resolve()
    other_py = tree_python(other, args.compare_python)
    try:
        grids = {"this": start_grid(sup, "this", None, None, paths, ranges, args.replicas, host, ports[:n],
                                    args.kernel_threads),
                 "other": start_grid(sup, "other", other, other_py, paths, ranges, args.replicas, host, ports[n:])}
        sup.wait_ready(sup.roles, time.monotonic() + 900)
        for router, _, _ in grids.values():
            while not httpx.get(router.url + "/v1/grid").json()["complete"]:
                time.sleep(0.2)
        tok = Vindex.open(paths["client"]).load_tokenizer()
        prompt = tok.encode("The capital of France is").ids
        say(f"Whole grid against whole grid: {args.model} ({n_layers} layers), router + embed + {len(ranges) * args.replicas} "
            f"FFN shards ({', '.join(map(str, ranges))}, {args.replicas} each) per grid, every process 1 BLAS thread")
        say(f"  this:  {ROOT} ({sys.executable}), roles and client; kernel threads "
            f"{args.kernel_threads or 'as --blas-threads (1)'} (an older tree's kernels may use every CPU whatever "
            "--blas-threads says: d8dfbd4's numba did)")
        say(f"  other: {other} ({other_py or sys.executable}), roles and client")
        say(f"  vindexes: {', '.join(f'{k} {v}' for k, v in paths.items())}")
        say(f"  load average before: {os.getloadavg()[0]:.2f}")
        rates: dict[str, list[float]] = {"this": [], "other": []}
        for _ in range(args.rounds):  # alternating: the same neighbours' load for both
            rates["this"].append(child_decode_rate(ROOT, paths["client"], grids["this"][0].url, prompt, args.tokens,
                                                   threads=args.kernel_threads or 1))
            rates["other"].append(child_decode_rate(other, paths["client"], grids["other"][0].url, prompt, args.tokens,
                                                    other_py))
        bt, bo = max(rates["this"]), max(rates["other"])
        pr = float(np.median([x / y for x, y in zip(rates["this"], rates["other"], strict=True)]))
        say(f"Decode ({args.tokens} tokens after a {len(prompt)}-token prompt, client process per round, best of {args.rounds}):")
        say(f"  this grid   {bt:6.1f} tok/s   {bt / bo:.2f}x   (all rounds: {', '.join(f'{r:.1f}' for r in rates['this'])})")
        say(f"  {other.name:11s} {bo:6.1f} tok/s   (all rounds: {', '.join(f'{r:.1f}' for r in rates['other'])})")
        say(f"  median of the per-round ratios: this grid {pr:.2f}x {other.name}; load average after: {os.getloadavg()[0]:.2f}")
    finally:
        sup.stop_all()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--vindex", default=None, help="use this vindex instead of the cached one")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--replicas", type=int, default=2, help="FFN shards per layer range")
    ap.add_argument("--compare-code", default=None, metavar="DIR",
                    help="also compare the direct path's client from this tree against the one at DIR")
    ap.add_argument("--compare-grid", default=None, metavar="DIR",
                    help="only this: the whole grid (every role and the client) of this tree against the whole "
                         "grid of the tree at DIR, decoding alternately (results kept with earlier runs)")
    ap.add_argument("--compare-python", default=None, metavar="PY",
                    help="the interpreter for DIR's roles and client (default: DIR/.venv/bin/python if it exists)")
    ap.add_argument("--kernel-threads", type=int, default=None,
                    help="with --compare-grid: this tree's roles' and client's kernel threads (equal threads against "
                         "a tree whose kernels ignored --blas-threads)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "grid.txt"))
    args = ap.parse_args()
    threadpool_limits(1)
    lines: list[str] = []

    def say(s: str = "") -> None:
        print(s, flush=True)
        lines.append(s)

    paths = role_vindexes(args.model, args.vindex, log=lambda m: None)  # each role runs from its slice
    if args.compare_grid:
        from _support import save_keeping_earlier

        try:
            compare_grids(args, paths, Vindex.open(paths["ffn"]).num_layers, say)
        finally:
            save_keeping_earlier(args.out, lines)
            print(f"\n(saved to {args.out}, earlier runs kept)")
        return 0
    if args.vindex:
        vindex = Path(args.vindex)
    else:
        from larql_edge.tools.slicer.cache import cached_vindex

        vindex = cached_vindex(args.model, dtype="f16", log=lambda m: None)  # the local baseline: the whole model
    n_layers = Vindex.open(vindex).num_layers
    ranges = split_even(n_layers, 2)
    host = "127.0.0.1"
    rp, ep, *sp = pick_ports(host, [19590, 19582, *range(19600, 19600 + len(ranges) * args.replicas)])
    env = role_env(dict(os.environ), LARQL_GRID_KEY="bench-key", PYTHONUNBUFFERED="1")
    sup = Supervisor(Path(tempfile.mkdtemp(prefix="larql-bench-")), env)
    url = lambda p: f"http://{host}:{p}"  # noqa: E731
    common = ["--host", host, "--blas-threads", "1"]
    try:
        router_argv = ["larql-router", "--port", str(rp), *common]
        embed_argv = ["larql-embed", str(paths["embed"]), "--port", str(ep), *common, "--join", url(rp)]
        router = sup.start("router", router_argv, url(rp))
        embed = sup.start("embed", embed_argv, url(ep))
        placed = [(r, i) for i in range(args.replicas) for r in ranges]
        shards = [sup.start(f"ffn-{r}" + (f"-{i}" if args.replicas > 1 else ""),
                            ["larql-ffn", str(paths["ffn"]), "--layers", str(r), "--port", str(p), *common,
                             "--join", url(rp)], url(p), layers=str(r)) for (r, i), p in zip(placed, sp, strict=True)]
        deadline = time.monotonic() + 900
        sup.wait_ready(sup.roles, deadline)
        while not httpx.get(router.url + "/v1/grid").json()["complete"]:
            time.sleep(0.2)

        local = Transformer.local(vindex)
        grid = build_remote(Vindex.open(paths["client"]), remote_args(ffn=router.url, direct=False))
        topo = build_remote(Vindex.open(paths["client"]), remote_args(ffn=router.url))  # the direct data path
        direct = build_remote(Vindex.open(paths["client"]), remote_args(  # one shard per range, no hedging
            ffn=",".join(f"{s.info['layers']}={s.url}" for s in shards[: len(ranges)]), embed=embed.url))

        tok = Vindex.open(vindex).load_tokenizer()
        prompt = tok.encode("The capital of France is").ids
        long_ids = tok.encode(TEXT * 3).ids[:59]
        assert len(long_ids) == 59

        say(f"larql-edge grid benchmark: {args.model} ({n_layers} layers), vindex {vindex.name}")
        say(f"  machine: {os.cpu_count()} cores (shared), every process 1 BLAS thread; loopback HTTP")
        say(f"  grid: router + embed server + {len(shards)} FFN shards ({', '.join(str(r) for r in ranges)}"
            + (f", {args.replicas} replicas each)" if args.replicas > 1 else ")"))
        say("")

        # Decode: rounds interleave the three configurations so machine noise hits them alike.
        rates: dict[str, list[float]] = {"local": [], "grid": [], "topo": [], "direct": []}
        for _ in range(args.rounds):
            rates["local"].append(decode_rate(local, prompt, args.tokens))
            rates["grid"].append(decode_rate(grid, prompt, args.tokens))
            rates["topo"].append(decode_rate(topo, prompt, args.tokens))
            rates["direct"].append(decode_rate(direct, prompt, args.tokens))
        best = {k: max(v) for k, v in rates.items()}
        say(f"Decode ({args.tokens} tokens after a {len(prompt)}-token prompt, best of {args.rounds} rounds):")
        say(f"  local single process      {best['local']:6.1f} tok/s   (baseline)")
        say(f"  grid via router           {best['grid']:6.1f} tok/s   {best['grid'] / best['local']:.2f}x local"
            "   (--no-direct: every hop through the router)")
        say(f"  grid, direct data path    {best['topo']:6.1f} tok/s   {best['topo'] / best['local']:.2f}x local   "
            f"{best['topo'] / best['grid']:.2f}x via router   (--ffn ROUTER: shards learned from /v1/topology)")
        say(f"  grid, shards by hand      {best['direct']:6.1f} tok/s   {best['direct'] / best['local']:.2f}x local   "
            f"{best['direct'] / best['grid']:.2f}x via router   (--ffn 0-8=URL,9-17=URL --embed URL: one replica each)")
        say(f"  (all rounds: local {', '.join(f'{r:.1f}' for r in rates['local'])}; "
            f"grid {', '.join(f'{r:.1f}' for r in rates['grid'])}; direct path {', '.join(f'{r:.1f}' for r in rates['topo'])}; "
            f"by hand {', '.join(f'{r:.1f}' for r in rates['direct'])})")
        paired = lambda a, b: float(np.median([x / y for x, y in zip(rates[a], rates[b], strict=True)]))  # noqa: E731
        say(f"  (median of the per-round ratios, rounds interleaved: direct path {paired('topo', 'grid'):.2f}x via router, "
            f"by hand {paired('direct', 'grid'):.2f}x via router, direct path {paired('topo', 'direct'):.2f}x by hand)")
        say("")

        if args.compare_code:
            other = Path(args.compare_code).resolve()
            cmp: dict[str, list[float]] = {"this": [], "other": []}
            for _ in range(args.rounds):
                cmp["this"].append(child_decode_rate(ROOT, paths["client"], router.url, prompt, args.tokens))
                cmp["other"].append(child_decode_rate(other, paths["client"], router.url, prompt, args.tokens))
            bt, bo = max(cmp["this"]), max(cmp["other"])
            say(f"Direct data path, client from this tree vs {other} (separate client processes, alternating, best of {args.rounds}):")
            say(f"  this tree   {bt:6.1f} tok/s   {bt / bo:.2f}x   (all rounds: {', '.join(f'{r:.1f}' for r in cmp['this'])})")
            say(f"  {other.name:11s} {bo:6.1f} tok/s   (all rounds: {', '.join(f'{r:.1f}' for r in cmp['other'])})")
            pr = float(np.median([x / y for x, y in zip(cmp["this"], cmp["other"], strict=True)]))
            say(f"  median of the per-round ratios: this tree {pr:.2f}x {other.name}")
            say("")

        pf = {k: min(prefill_seconds(m, long_ids) for _ in range(args.rounds))
              for k, m in (("local", local), ("grid", grid), ("direct", direct))}
        say("Prefill, 59-token prompt (best of rounds):")
        say(f"  local {pf['local'] * 1e3:7.1f} ms   grid via router {pf['grid'] * 1e3:7.1f} ms "
            f"({pf['grid'] / pf['local']:.2f}x)   shards direct {pf['direct'] * 1e3:7.1f} ms")
        say("")

        # Per-hop latency, one decode-sized request each (median of 200).
        hidden = local.spec.hidden_size
        x = np.random.default_rng(0).standard_normal((1, hidden)).astype(np.float32)
        body = fw.encode_request(0, x)
        h = {"content-type": fw.CONTENT_TYPE}
        from larql_edge.net.h1_sync import HttpClient

        c = HttpClient()  # the client's own transport: per-hop figures are what decode pays
        w0 = local.ffn_provider.layers[0]
        from larql_edge.model.forward import ffn_compute

        compute = median_ms(lambda: ffn_compute(w0, x, local.ffn_provider.act, local.backend))
        shard_ms = median_ms(lambda: c.request("POST", shards[0].url + "/v1/walk-ffn", content=body, headers=h))
        router_ms = median_ms(lambda: c.request("POST", router.url + "/v1/walk-ffn", content=body, headers=h))
        eb = ew.encode_embed_request([818])
        embed_ms = median_ms(lambda: c.request("POST", embed.url + "/v1/embed", content=eb, headers=h))
        embed_r_ms = median_ms(lambda: c.request("POST", router.url + "/v1/embed", content=eb, headers=h))
        lb = ew.encode_logits_request(x[0])
        lh = {**h, "accept": fw.CONTENT_TYPE}
        logits_ms = median_ms(lambda: c.request("POST", embed.url + "/v1/logits", content=lb, headers=lh), n=50)
        logits_r_ms = median_ms(lambda: c.request("POST", router.url + "/v1/logits", content=lb, headers=lh), n=50)
        head_local = median_ms(lambda: local.head.logits(x), n=50)
        say("Per-hop latency (median, one position):")
        say(f"  FFN layer compute in-process     {compute:7.3f} ms")
        say(f"  client -> shard  /v1/walk-ffn    {shard_ms:7.3f} ms   (HTTP + codec: {shard_ms - compute:.3f} ms)")
        say(f"  client -> router -> shard        {router_ms:7.3f} ms   (router hop: {router_ms - shard_ms:.3f} ms)")
        say(f"  client -> embed  /v1/embed       {embed_ms:7.3f} ms   via router {embed_r_ms:7.3f} ms")
        say(f"  lm_head in-process               {head_local:7.3f} ms")
        say(f"  client -> embed  /v1/logits raw  {logits_ms:7.3f} ms   via router {logits_r_ms:7.3f} ms")
        say(f"  => per decode token: {n_layers} FFN round trips + embed + logits")
        say("")

        say("RSS per role (MB):")
        for r in (router, embed, *shards):
            say(f"  {r.name:12s} {tree_rss(r.pid) / 2**20:8.1f}")
        say(f"  {'client':12s} {client_rss_mb(paths['client'], router.url):8.1f}   (attention-only, one prediction)")
        say(f"  {'local':12s} {psutil.Process().memory_info().rss / 2**20:8.1f}   (this benchmark process: the whole model + the clients)")
    finally:
        sup.stop_all()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines) + "\n")
    print(f"\n(saved to {args.out})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
