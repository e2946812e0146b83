"""Quantized compute (issues #13, #17), one run: today's float32 path against the compact kernels.

    python benchmarks/quantized.py [--model gemma3-270m] [--tokens 32] [--rounds 3] [--quick]
                                   [--part embed,local,grid,ffn,llama] [--repeats 2] [--layerwise]
                                   [--out benchmarks/results/quantized.txt]

``--part`` runs some of the parts only (default: all): ``embed`` (the embed servers' RSS and
``/v1/logits`` p50), ``local`` (local decode), ``grid`` (grid decode), ``ffn`` (FFN shard throughput),
``llama`` (the gguf vindex against llama.cpp at equal threads, 1 and 2). E.g. the serving figures alone:
``--part embed,ffn --out benchmarks/results/quantized-serving.txt``.

Configurations, each measured in the same run (the machine is shared: only the ratios travel):
- ``f32``   the f16 vindex on the numpy backend: float32 weights, the f32 lm_head copy (the baseline);
- ``q4k``   LARQL's q4k vindex on the compact backend (Q4_K/Q6_K blocks, the tied head as Q8_0);
- ``gguf``  larql-edge's gguf vindex on the compact backend (every tensor in its GGUF block type).

Measured: the embed server's RSS after start and after 10,000 row lookups against the on-disk size of
its slice; ``/v1/logits`` p50 (one residual, raw f32 reply); local decode tokens/s; grid decode
tokens/s (router, embed server, 2 FFN shards, attention-only client, all local processes); aggregate
FFN-shard throughput at 1 and 16 rows (two concurrent clients); and, when ``llama_cpp`` imports,
the gguf vindex's local decode against llama.cpp's on the same GGUF at equal threads (1 and 2; ours
set by LARQL_KERNEL_THREADS), alternating processes. Every process pins BLAS to one thread.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
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
from _support import median_ms, save_keeping_earlier, tree_rss  # noqa: E402  (benchmarks/ is the script's folder)

from larql_edge.format.layers import split_even  # noqa: E402
from larql_edge.format.presets import ROLE_PRESETS  # noqa: E402
from larql_edge.format.vindex import Vindex  # noqa: E402
from larql_edge.net.h1_sync import HttpClient  # noqa: E402
from larql_edge.tools.grid.supervisor import Supervisor, pick_ports, role_env  # noqa: E402
from larql_edge.tools.slicer.cache import cached_slice, cached_vindex  # noqa: E402
from larql_edge.wire import embed as ew  # noqa: E402
from larql_edge.wire import ffn as fw  # noqa: E402

ROWS = (1, 16)  # rows per FFN request (shard throughput)
FFN_ROUNDS = 3  # alternating rounds per configuration and rows (shard throughput)
PARTS = ("embed", "local", "grid", "ffn", "llama")
CONFIGS = {"f32": ("none", "numpy"), "q4k": ("q4k", "compact"), "gguf": ("gguf", "compact")}
HOST = "127.0.0.1"
BIN = fw.CONTENT_TYPE


def url(port: int) -> str:
    return f"http://{HOST}:{port}"



def folder_mb(path: Path) -> float:
    return sum(f.stat().st_size for f in path.iterdir() if f.is_file()) / 2**20



PROMPT_IDS: list[int] = []


def worker(vindex: Path, backend: str, tokens: int, rounds: int, ffn: str | None = None, embed: str | None = None,
           threads: int | None = None, graph: str | None = None) -> dict:
    argv = [sys.executable, str(ROOT / "benchmarks" / "_decode_worker.py"), str(vindex), "--tokens", str(tokens),
            "--rounds", str(rounds), "--prompt-ids", ",".join(map(str, PROMPT_IDS))]
    if ffn:
        argv += ["--ffn", ffn, "--embed", embed or ffn]
    env = {**os.environ, "LARQL_BACKEND": backend}
    if threads:
        env["LARQL_KERNEL_THREADS"] = str(threads)
    if graph:
        env["LARQL_GRAPH"] = graph
    r = subprocess.run(argv, capture_output=True, text=True, timeout=3600, cwd=ROOT, env=env)
    if r.returncode:
        raise RuntimeError(f"decode worker failed ({backend}, {vindex.name}):\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def shard_throughput(client_url: str, hidden: int, layers: int, rows: int, seconds: float) -> float:
    """Rows per second through one shard from two concurrent clients (random layers)."""
    done = [0, 0]
    stop = time.monotonic() + seconds

    def run(i: int) -> None:
        c = HttpClient()
        rng = np.random.default_rng(i)
        x = rng.standard_normal((rows, hidden)).astype(np.float32)
        try:
            while time.monotonic() < stop:
                body = fw.encode_request(int(rng.integers(layers)), x)
                r = c.request("POST", client_url + "/v1/walk-ffn", content=body, headers={"content-type": BIN})
                if r.status_code != 200:
                    raise RuntimeError(f"walk-ffn {r.status_code}")
                done[i] += rows
        finally:
            c.close()

    t0 = time.monotonic()
    ts = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return sum(done) / (time.monotonic() - t0)


def llama_cpp_rate(gguf_path: Path, tokens: int, prompt: list[int], threads: int, rounds: int) -> tuple[float, list[int]] | None:
    """llama.cpp's greedy decode on the GGUF (llama-cpp-python, its own process): best tokens/s of
    ``rounds`` (prefill excluded, as `_decode_worker`) and the ids; None when llama_cpp is missing."""
    import importlib.util

    # not imported here: its ggml and the libggml-python wheel's share library names (one process, one ggml)
    if importlib.util.find_spec("llama_cpp") is None:
        return None
    code = (
        "import json, sys, time\n"
        "import numpy as np\n"
        "import llama_cpp\n"
        "from llama_cpp import Llama\n"
        f"ids = {prompt!r}\n"
        f"m = Llama(model_path={str(gguf_path)!r}, n_threads={threads}, n_threads_batch={threads}, n_ctx=256, "
        "verbose=False, logits_all=False)\n"
        # with logits_all off, Llama.scores is never filled (0.3.36): the last row's logits from llama.cpp itself
        "def last():\n"
        "    return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(m._ctx.ctx, -1), shape=(m.n_vocab(),))\n"
        "best, toks = 0.0, []\n"
        f"for _ in range({rounds}):\n"
        "    m.reset(); m.eval(ids); toks = []\n"
        "    t0 = time.perf_counter()\n"
        f"    for _ in range({tokens}):\n"
        "        t = int(np.argmax(last()))\n"
        "        toks.append(t); m.eval([t])\n"
        f"    best = max(best, {tokens} / (time.perf_counter() - t0))\n"
        "print(json.dumps([best, toks]))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=1800)
    if r.returncode:
        raise RuntimeError(f"llama.cpp run failed: {r.stderr[-1000:]}")
    rate, toks = json.loads(r.stdout.strip().splitlines()[-1])
    return rate, toks


def llama_cpp_section(say, args, full: dict) -> None:
    """Local decode of the gguf vindex against llama.cpp on the same GGUF, at equal threads (1 and 2),
    alternating the two so that the machine's load hits both alike."""
    from larql_edge.tools.slicer.extract._source import _package_gguf

    gguf = _package_gguf(args.model)
    say(f"Local decode of the gguf vindex vs llama.cpp on the same GGUF ({gguf.name}), equal threads "
        f"({args.tokens} tokens after a {len(PROMPT_IDS)}-token prompt; best of {args.rounds} rounds per process, "
        f"{args.repeats} processes each, alternating):")
    for th in (1, 2):
        ours, theirs, graph_off = [], [], []
        for _ in range(args.repeats):
            ours.append(worker(full["gguf"], "compact", args.tokens, args.rounds, threads=th))
            lc = llama_cpp_rate(gguf, args.tokens, PROMPT_IDS, th, args.rounds)
            if lc is None:
                say("  llama.cpp: llama_cpp (llama-cpp-python) is not installed; not measured")
                return
            theirs.append(lc)
            if args.layerwise:
                graph_off.append(worker(full["gguf"], "compact", args.tokens, args.rounds, threads=th, graph="off"))
        best = max(ours, key=lambda r: r["rate"])
        lrate, ltoks = max(theirs, key=lambda x: x[0])
        ours_s = ", ".join("%.1f" % x["rate"] for x in ours)
        theirs_s = ", ".join("%.1f" % x[0] for x in theirs)
        per = f"per process: ours {ours_s}; llama.cpp {theirs_s}"
        say(f"  {th} thread(s): larql-edge {best['rate']:6.1f} tok/s   llama.cpp {lrate:6.1f} tok/s   "
            f"ratio {best['rate'] / lrate:.2f}x   same {args.tokens} tokens: {best['ids'] == ltoks}   ({per})")
        if graph_off:
            off = max(r["rate"] for r in graph_off)
            say(f"             larql-edge product by product (LARQL_GRAPH=off) {off:6.1f} tok/s   ratio {off / lrate:.2f}x")
    say("")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--lookups", type=int, default=10_000)
    ap.add_argument("--quick", action="store_true", help="fewer tokens, rounds and requests (a few minutes)")
    ap.add_argument("--repeats", type=int, default=2, help="processes per side in the llama.cpp comparison")
    ap.add_argument("--layerwise", action="store_true", help="also the product-by-product path in the llama.cpp comparison")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "quantized.txt"))
    ap.add_argument("--part", default=",".join(PARTS), help="comma-separated parts to run: " + ", ".join(PARTS))
    args = ap.parse_args()
    parts = set(args.part.split(","))
    if not parts <= set(PARTS):
        ap.error(f"--part: unknown {', '.join(sorted(parts - set(PARTS)))}; expected some of {', '.join(PARTS)}")
    if args.quick:
        args.tokens, args.rounds, args.lookups = 12, 1, 2000
    missing = [c for c in ("larql-embed", "larql-ffn", "larql-router") if shutil.which(c) is None]
    if missing and parts - {"local", "llama"}:  # the serving parts start the roles as processes
        ap.error(f"{', '.join(missing)} not on PATH: run from the project's venv (. .venv/bin/activate)")
    lines: list[str] = []

    def say(s: str = "") -> None:
        print(s, flush=True)
        lines.append(s)

    wanted = CONFIGS if parts - {"llama"} else {"gguf": CONFIGS["gguf"]}
    full = {k: cached_vindex(args.model, dtype="f16", quant=q, log=lambda m: None) for k, (q, _) in wanted.items()}
    slices = {k: {role: cached_slice(v, ROLE_PRESETS[role]) for role in ("embed", "ffn", "client")} for k, v in full.items()} \
        if parts & {"embed", "grid", "ffn"} else {}
    vx = Vindex.open(full["gguf"])
    from tokenizers import Tokenizer

    PROMPT_IDS[:] = Tokenizer.from_file(str(vx.tokenizer_path)).encode("The capital of France is").ids
    hidden, n_layers = vx.hidden_size, vx.num_layers
    say(f"larql-edge quantized compute: {args.model} ({n_layers} layers, hidden {hidden}, vocab {vx.vocab_size:,})")
    say(f"  {time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} cores, load average at start "
        f"{os.getloadavg()[0]:.1f}; every process 1 BLAS thread; f32 = f16 vindex on the numpy backend")
    say("")

    env = role_env(dict(os.environ), LARQL_GRID_KEY="bench-key", PYTHONUNBUFFERED="1")
    sup = Supervisor(Path(tempfile.mkdtemp(prefix="larql-qbench-")), env)
    common = ["--host", HOST, "--blas-threads", "1"]
    local: dict[str, list[dict]] = {k: [] for k in CONFIGS}
    try:
        # -- embed servers: memory and /v1/logits ------------------------------------------------
        if "embed" in parts:
            ports = pick_ports(HOST, [19682, 19683, 19684])
            embeds = {}
            for (k, (_, backend)), port in zip(CONFIGS.items(), ports, strict=True):
                embeds[k] = sup.start(f"embed-{k}", ["larql-embed", str(slices[k]["embed"]), "--port", str(port), *common],
                                      url(port), env={"LARQL_BACKEND": backend})
            sup.wait_ready(list(embeds.values()), time.monotonic() + 900)
            rss_start = {k: tree_rss(r.popen.pid) / 2**20 for k, r in embeds.items()}
            c = HttpClient()
            x = np.random.default_rng(0).standard_normal(hidden).astype(np.float32)
            body = ew.encode_logits_request(x)
            hdr = {"content-type": BIN, "accept": BIN}
            n = 10 if args.quick else 40
            logits_p50: dict[str, list[float]] = {k: [] for k in CONFIGS}
            for _ in range(3):  # interleaved, so noise hits every configuration alike
                for k, r in embeds.items():
                    def post(r=r):
                        return c.request("POST", r.url + "/v1/logits", content=body, headers=hdr)

                    logits_p50[k].append(median_ms(post, n, warmup=3))
            rng = np.random.default_rng(1)
            ids = rng.integers(0, vx.vocab_size, args.lookups)
            for r in embeds.values():
                for i in ids:
                    resp = c.request("GET", f"{r.url}/v1/embed/{int(i)}")
                    if resp.status_code != 200:
                        raise RuntimeError(f"embed lookup {resp.status_code}")
            rss_after = {k: tree_rss(r.popen.pid) / 2**20 for k, r in embeds.items()}
            stats = {k: json.loads(c.request("GET", r.url + "/v1/stats").content) for k, r in embeds.items()}
            c.close()
            for r in embeds.values():
                r.stop()
            base = min(logits_p50["f32"])
            say("Embed server (its `embed` slice; RSS of the server and its worker, MB):")
            say("  config  slice on disk  lm_head as                 RSS after start  after %d lookups  /v1/logits p50" % args.lookups)
            for k in CONFIGS:
                h = stats[k]["lm_head"]
                p = min(logits_p50[k])
                say(f"  {k:<6}  {folder_mb(slices[k]['embed']):9.0f} MB   {h['format'] + ', ' + h['storage']:<26} "
                    f"{rss_start[k]:9.0f}        {rss_after[k]:9.0f}        {p:7.1f} ms  {p / base:.2f}x")
            say("")

        # -- local decode ------------------------------------------------------------------------
        if "local" in parts:
            for _ in range(max(1, args.rounds // 2 + 1) if not args.quick else 1):
                for k, (_, backend) in CONFIGS.items():
                    local[k].append(worker(full[k], backend, args.tokens, args.rounds))
            base = max(r["rate"] for r in local["f32"])
            say(f"Local decode ({args.tokens} tokens after a {len(PROMPT_IDS)}-token prompt; best of {args.rounds} rounds per process):")
            for k in CONFIGS:
                best = max(local[k], key=lambda r: r["rate"])
                say(f"  {k:<6}  {best['rate']:6.1f} tok/s  {best['rate'] / base:.2f}x   RSS {best['rss_mb']:.0f} MB   "
                    f"first ids {best['ids'][:6]}")
            say("")

        # -- grid decode and shard throughput ---------------------------------------------------
        if "grid" in parts or "ffn" in parts:
            ranges = split_even(n_layers, 2)
            grid_rates: dict = {}
            wholes: dict = {}  # the all-layers shard of each configuration, side by side
            whole_ports = pick_ports(HOST, [19694, 19695, 19696])
            for k, (_, backend) in CONFIGS.items():
                be = {"LARQL_BACKEND": backend}
                rp, ep, s0, s1 = pick_ports(HOST, [19690, 19691, 19692, 19693])
                roles = []
                if "grid" in parts:
                    router = sup.start(f"router-{k}", ["larql-router", "--port", str(rp), *common], url(rp), env=be)
                    roles = [router, sup.start(f"gembed-{k}", ["larql-embed", str(slices[k]["embed"]), "--port", str(ep),
                                                               *common, "--join", url(rp)], url(ep), env=be)]
                    for rng_, p in zip(ranges, (s0, s1), strict=True):
                        roles.append(sup.start(f"ffn-{k}-{rng_}", ["larql-ffn", str(slices[k]["ffn"]), "--layers", str(rng_),
                                                                   "--port", str(p), *common, "--join", url(rp)], url(p), env=be))
                if "ffn" in parts:
                    wp = whole_ports[len(wholes)]
                    wholes[k] = sup.start(f"ffn-all-{k}", ["larql-ffn", str(slices[k]["ffn"]), "--port", str(wp), *common],
                                          url(wp), env=be)
                sup.wait_ready([*roles, *wholes.values()], time.monotonic() + 900)
                if "grid" in parts:
                    deadline = time.monotonic() + 120
                    hc = HttpClient()
                    while not json.loads(hc.request("GET", router.url + "/v1/grid").content)["complete"]:
                        if time.monotonic() > deadline:
                            raise RuntimeError("grid incomplete")
                        time.sleep(0.2)
                    hc.close()
                    grid_rates[k] = worker(slices[k]["client"], backend, args.tokens, args.rounds, ffn=router.url)
                for r in reversed(roles):
                    r.stop()
            if "ffn" in parts:
                # The three shards run side by side and are measured in alternating rounds, so that the
                # machine's load (other processes come and go) hits every configuration alike.
                secs = 4.0 if args.quick else 10.0
                done = {k: {rows: [0.0, 0.0] for rows in ROWS} for k in wholes}
                for _ in range(FFN_ROUNDS):
                    for rows in ROWS:
                        for k, w in wholes.items():
                            t0 = time.monotonic()
                            rate = shard_throughput(w.url, hidden, n_layers, rows, secs / FFN_ROUNDS)
                            dt = time.monotonic() - t0
                            done[k][rows][0] += rate * dt
                            done[k][rows][1] += dt
                through = {k: {rows: n / t for rows, (n, t) in d.items()} for k, d in done.items()}
                for w in wholes.values():
                    w.stop()
            if "grid" in parts:
                base = grid_rates["f32"]["rate"]
                say("Grid decode (router + embed server + 2 FFN shards + attention-only client, loopback):")
                for k in CONFIGS:
                    r = grid_rates[k]
                    same = r["ids"] == max(local[k], key=lambda x: x["rate"])["ids"] if local.get(k) else "not measured"
                    say(f"  {k:<6}  {r['rate']:6.1f} tok/s  {r['rate'] / base:.2f}x   same tokens as local: {same}")
                say("")
            if "ffn" in parts:
                say(f"FFN shard throughput (all layers in one shard, 2 concurrent clients, rows per second; the three "
                    f"shards side by side, {FFN_ROUNDS} alternating rounds each):")
                for k in CONFIGS:
                    t = through[k]
                    say(f"  {k:<6}  " + "    ".join(f"{n} row{'s' if n > 1 else ''} {t[n]:8.0f}  ({t[n] / through['f32'][n]:.2f}x)"
                                                    for n in ROWS))
                say("")

        # -- llama.cpp on the same GGUF, at equal threads -------------------------------------------
        if "llama" in parts:
            llama_cpp_section(say, args, full)
        say(f"load average at end {os.getloadavg()[0]:.1f}")
    finally:
        sup.stop_all()
    save_keeping_earlier(args.out, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
