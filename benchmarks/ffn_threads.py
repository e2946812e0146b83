"""An FFN shard's layer on more than one kernel thread, and what exact rows cost (issue #17).

    python benchmarks/ffn_threads.py [--model gemma3-270m] [--quant gguf,q4k] [--rows 1,4,16] [--n 300]
                                     [--out benchmarks/results/ffn_threads.txt]

One process, Gemma 3 270M's FFN layers from the ``--quant`` vindexes (a gguf layer with a Q4_K
ffn_down, and LARQL's q4k layout: every FFN weight Q4_K), wall-clock medians of ``--n`` calls of
`LocalFfn.ffn` (what `Shard.compute` calls), each route as a ratio to the one-thread graph measured
in the same run:

- ``graph 1t``: the fused layer graph on one thread (the baseline);
- ``graph 2t``: the same graph on ggml's pool of 2 threads, workers asleep between graphs
  (`kernels._threads.GRAPH_POLL` = 0, the default from PARALLEL_FROM_MACS up), and with ggml's
  default polling (50: workers spin after each graph);
- ``products 2t``: the three products split over 2 Python threads with numpy's GLU between them (the
  route 2+ threads took before);
- ``rows together``: a repacked (Q4_K) layer with its rows in one product (ggml's gemm for 4+ rows),
  against ``ROW_BY_ROW`` (gemv per row: the price of a row's floats not depending on its company).

Every route's result is checked equal, bit for bit, to the one-thread graph's (``ROW_BY_ROW`` off
excepted: it is the route that is not).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

for _v in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_v] = "1"
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
from _support import median_ms, save_keeping_earlier  # noqa: E402

from larql_edge.format.vindex import Vindex  # noqa: E402
from larql_edge.model.forward import LocalFfn, ffn_compute  # noqa: E402
from larql_edge.model.kernels import _ggml, _threads, set_threads  # noqa: E402
from larql_edge.model.spec import ModelSpec  # noqa: E402
from larql_edge.tools.slicer.cache import cached_vindex  # noqa: E402


def _layers(ffn: LocalFfn) -> list[int]:
    """The first layer with a repacked FFN weight and the first without (those the vindex has)."""
    picked: dict[bool, int] = {}
    for i, w in ffn.layers.items():
        picked.setdefault(any(m.repacked for m in (w.gate, w.up, w.down)), i)
    return sorted(picked.values())


def _with_poll(poll: int, fn):
    """``fn`` run with the graph pool rebuilt at ggml polling level ``poll``."""
    def run():
        saved = _threads.GRAPH_POLL
        _threads.GRAPH_POLL = poll
        try:
            return fn()
        finally:
            _threads.GRAPH_POLL = saved
    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--quant", default="gguf,q4k")
    ap.add_argument("--rows", default="1,4,16")
    ap.add_argument("--n", type=int, default=300)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "ffn_threads.txt"))
    args = ap.parse_args()
    lines: list[str] = []

    def say(s: str = "") -> None:
        print(s, flush=True)
        lines.append(s)

    say(f"FFN layer routes, {args.model}, one process, {os.cpu_count()} CPUs, wall medians of {args.n} calls; "
        f"load average before: {os.getloadavg()[0]:.2f}")
    rng = np.random.default_rng(0)
    for quant in args.quant.split(","):
        vx = Vindex.open(cached_vindex(args.model, level="all", dtype="f16", quant=quant, progress=False,
                                       log=lambda *a: None))
        spec = ModelSpec.from_index(vx.index)
        ffn = LocalFfn(vx, spec)
        for layer in _layers(ffn):
            layer_routes(args, quant, ffn, layer, spec.hidden_size, rng, say)
    set_threads(1)
    say(f"\n(load average after: {os.getloadavg()[0]:.2f}; python benchmarks/ffn_threads.py"
        + "".join(f" {a}" for a in sys.argv[1:]) + f"; {time.strftime('%Y-%m-%d %H:%M')})")
    save_keeping_earlier(args.out, lines)


def layer_routes(args, quant: str, ffn: LocalFfn, layer: int, hidden: int, rng, say) -> None:
    w = ffn.layers[layer]
    repacked = [n for n, m in (("gate", w.gate), ("up", w.up), ("down", w.down)) if m.repacked]
    say(f"\n{quant}: layer {layer} (gate {w.gate.fmt}, up {w.up.fmt}, down {w.down.fmt}; repacked: "
        + (", ".join(repacked) or "none") + ("; every route but the gemm: a chain of nodes per row"
                                             if repacked else "") + "; 2t: ggml's pool)")
    say(f"{'rows':>5} {'route':<28} {'us':>8} {'x graph 1t':>11}")
    for rows in (int(r) for r in args.rows.split(",")):
        rows_routes(args, quant, ffn, layer, rng.standard_normal((rows, hidden)).astype(np.float32), say)


def rows_routes(args, quant: str, ffn: LocalFfn, layer: int, x: np.ndarray, say) -> None:
    w, rows = ffn.layers[layer], x.shape[0]
    def graph(threads: int):
        def run():
            set_threads(threads)
            return ffn.ffn(layer, x)
        return run

    def products():
        set_threads(2)
        return ffn_compute(w, x, ffn.act, ffn.backend)

    def together():
        saved, _ggml.ROW_BY_ROW = _ggml.ROW_BY_ROW, False
        try:
            set_threads(1)
            return ffn.ffn(layer, x)
        finally:
            _ggml.ROW_BY_ROW = saved

    routes = [("graph 1t", graph(1), True), ("graph 2t (poll 0)", graph(2), True),
              ("graph 2t (ggml's poll 50)", _with_poll(50, graph(2)), True),
              ("products 2t", products, True)]
    if rows > 1 and any(m.repacked for m in (w.gate, w.up, w.down)):
        routes.append(("rows together (gemm), 1t", together, False))
    ref = graph(1)()
    base = None
    for name, fn, exact in routes:
        if exact:
            assert np.array_equal(fn(), ref), f"{quant} {rows} rows: {name} is not the 1-thread graph's floats"
        poll = "poll 50" in name
        if poll:  # the pool is rebuilt at that polling level for this route's calls only
            _threads.graph_pool.n = 0
        t = median_ms(fn, n=args.n, warmup=20) * 1e3
        if poll:
            _threads.graph_pool.n = 0  # and at the default again for the next route
        base = base or t
        say(f"{rows:>5} {name:<28} {t:>8.0f} {t / base:>10.2f}x")


if __name__ == "__main__":
    main()
