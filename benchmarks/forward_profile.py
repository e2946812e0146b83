"""Where one local decode step goes (issue #17): the one-graph step taken apart, one thread.

    python benchmarks/forward_profile.py [--model gemma3-270m] [--quant gguf] [--tokens 32] [--threads 1]

Measured in one process, medians over ``--tokens`` decode steps at ~40 positions of context:
- the whole step (`Transformer.next_logits`: embed lookup, masks, pointer writes, graph, logits copy);
- the graph's compute alone (``ggml_graph_compute``), with and without the head (final norm, lm_head);
- each weight product alone (a one-node ggml graph per matrix, 1 row), summed per kind;
- attention and elementwise ops: the layers' compute minus their products;
- Python around the graph: the step minus the compute;
- the same step product by product (``LARQL_GRAPH=off``: numpy glue between ggml products);
- the graph on the stored block bytes against the default (ggml's repacked Q4_K copies), alternating.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

for _v in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_v] = "1"
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

from larql_edge.model.forward import Transformer  # noqa: E402
from larql_edge.model.kernels import set_threads  # noqa: E402
from larql_edge.tools.slicer.cache import cached_vindex  # noqa: E402

PROMPT = [2, 818, 5279, 529, 7001, 563]


def med(xs) -> float:
    return float(np.median(xs)) * 1e3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--quant", default="gguf")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    set_threads(args.threads)
    path = cached_vindex(args.model, quant=args.quant, log=lambda m: None)
    m = Transformer.local(path)
    eng = m.engine()
    if eng is None:
        print("this vindex does not run as one graph (float32 weights?)")
        return 1
    prompt = PROMPT if args.model.startswith("gemma") else [1, 504, 3575, 282, 4649, 314]
    m.next_logits(prompt, m.new_cache())

    # the whole step, and its graph compute alone (wrapped)
    from larql_edge.model import graph as G

    computes: list[float] = []
    orig = G._Step.run

    def timed(self, *a):
        t = time.perf_counter()
        orig(self, *a)
        computes.append(time.perf_counter() - t)

    G._Step.run = timed
    cache = m.new_cache()
    logits = m.next_logits(prompt, cache)
    computes.clear()
    steps = []
    for _ in range(args.tokens):
        tok = int(np.argmax(logits))
        t = time.perf_counter()
        logits = m.next_logits([tok], cache)
        steps.append(time.perf_counter() - t)
    head_compute = list(computes)
    computes.clear()
    layer_compute = []  # the layers alone: forward() without the head, at the same context length
    c2 = m.new_cache()
    m.forward(prompt + [506] * 34, c2)
    for _ in range(args.tokens):
        c2.truncate(c2.length - 1)
        computes.clear()
        m.forward([506], c2)
        layer_compute.append(computes[0])
    G._Step.run = orig

    # each product alone (the same ggml kernel, one-node graphs, 1 row)
    x = {}
    per_kind: dict[str, float] = {}
    for layer_w, ffn_w in zip(m.attn, [m.ffn_provider.layers[i] for i in range(m.spec.num_layers)], strict=True):
        for kind, w in (("q", layer_w.q), ("k", layer_w.k), ("v", layer_w.v), ("o", layer_w.o), ("gate", ffn_w.gate),
                        ("up", ffn_w.up), ("down", ffn_w.down)):
            xi = x.setdefault(w.shape[1], np.random.default_rng(0).standard_normal((1, w.shape[1])).astype(np.float32))
            w.matmul(xi)
            ts = []
            for _ in range(7):
                t = time.perf_counter()
                w.matmul(xi)
                ts.append(time.perf_counter() - t)
            per_kind[kind] = per_kind.get(kind, 0.0) + med(ts)
    hx = np.random.default_rng(0).standard_normal((1, m.head.weight.shape[1])).astype(np.float32)
    m.head.weight.matmul(hx)
    ts = []
    for _ in range(5):
        t = time.perf_counter()
        m.head.weight.matmul(hx)
        ts.append(time.perf_counter() - t)
    head_ms = med(ts)

    # product by product, for comparison
    off = Transformer.local(path, graph=False)
    c3 = off.new_cache()
    lg = off.next_logits(prompt, c3)
    ts = []
    for _ in range(args.tokens // 2):
        t = time.perf_counter()
        lg = off.next_logits([int(np.argmax(lg))], c3)
        ts.append(time.perf_counter() - t)

    # the same step with the graph on the stored block bytes (no repacked copies, as before the graph
    # took ggml's repacked Q4_K: DESIGN.md §4.1), alternating with the default in rounds
    from larql_edge.model.kernels import _matrix

    _matrix.REPACK = False
    try:
        stored = Transformer.local(path)
        state = {"stored": [stored, stored.new_cache(), None, []], "repacked": [m, m.new_cache(), None, []]}
        for v in state.values():
            v[2] = v[0].next_logits(prompt, v[1])
    finally:
        _matrix.REPACK = True
    for _ in range(3):
        for v in state.values():
            for _ in range(args.tokens // 2):
                t = time.perf_counter()
                v[2] = v[0].next_logits([int(np.argmax(v[2]))], v[1])
                v[3].append(time.perf_counter() - t)
    ab = {k: med(v[3]) for k, v in state.items()}

    step, comp, lay = med(steps), med(head_compute), med(layer_compute)
    prods = sum(per_kind.values())
    n = m.spec.num_layers
    print(f"{args.model} {args.quant}, {args.threads} thread(s), load average {os.getloadavg()[0]:.1f}; medians, ms per token")
    print(f"  whole step (next_logits)              {step:7.2f}   {1e3 / step:5.1f} tok/s")
    print(f"  graph compute                         {comp:7.2f}   ({eng._graphs and next(reversed(eng._graphs.values())).n_nodes} nodes)")
    hw = m.head.weight
    print(f"    head (final norm + lm_head {hw.fmt} {hw.shape[0]}x{hw.shape[1]})  {comp - lay:7.2f}   "
          f"(lm_head product alone {head_ms:.2f})")
    print(f"    {n} layers                            {lay:7.2f}   ({lay / n * 1e3:.0f} us per layer)")
    print(f"      weight products (alone, summed)   {prods:7.2f}   " + ", ".join(f"{k} {v:.2f}" for k, v in per_kind.items()))
    print(f"      attention, norms, RoPE, GLU, adds {lay - prods:7.2f}   ({(lay - prods) / n * 1e3:.0f} us per layer)")
    print(f"  Python around the graph               {step - comp:7.2f}")
    print(f"  product by product (LARQL_GRAPH=off)  {med(ts):7.2f}   {1e3 / med(ts):5.1f} tok/s")
    print(f"  graph on the stored bytes vs on ggml's repacked copies (alternating rounds): "
          f"{ab['stored']:.2f} vs {ab['repacked']:.2f} ms ({ab['stored'] / ab['repacked']:.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
