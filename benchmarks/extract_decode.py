"""Extraction wall time for Gemma 3 270M, and local decode speed with the KV cache against a plain
float32 numpy loop without it (each step re-runs the whole sequence), measured in the same run.

    OPENBLAS_NUM_THREADS=1 python benchmarks/extract_decode.py [--model gemma3-270m] [--tokens 32]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import numpy as np  # noqa: E402

from larql_edge.model.forward import Transformer  # noqa: E402
from larql_edge.tools.slicer.cache import cached_vindex  # noqa: E402
from larql_edge.tools.slicer.extract import extract  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--skip-extract", action="store_true")
    a = ap.parse_args()
    print(f"# extract_decode  model={a.model}  OPENBLAS_NUM_THREADS={os.environ.get('OPENBLAS_NUM_THREADS')}  cores={os.cpu_count()}")
    if not a.skip_extract:
        with tempfile.TemporaryDirectory() as d:
            for dtype in ("f16", "f32"):
                t0 = time.perf_counter()
                extract(a.model, Path(d) / dtype, dtype=dtype, progress=False, log=lambda m: None)
                print(f"extract {a.model} --dtype {dtype}: {time.perf_counter() - t0:.1f} s")
    m = Transformer.local(cached_vindex(a.model, dtype="f32", log=lambda m: None))
    prompt = [2, 818, 5279, 529, 7001, 563] if a.model.startswith("gemma") else [504, 3575, 282, 4649, 314]
    list(m.generate(prompt, 2, stop_ids=[]))  # warm the page cache

    t0 = time.perf_counter()
    cached = list(m.generate(prompt, a.tokens, stop_ids=[]))
    t_cache = time.perf_counter() - t0

    t0 = time.perf_counter()
    seq = list(prompt)
    plain = []
    for _ in range(a.tokens):
        tok = int(np.argmax(m.head.logits(m.forward(seq)[-1:])[0]))  # no cache: the whole sequence again
        plain.append(tok)
        seq.append(tok)
    t_plain = time.perf_counter() - t0
    assert plain == cached, "the cached and plain loops disagree"
    r_cache, r_plain = a.tokens / t_cache, a.tokens / t_plain
    print(f"decode with KV cache : {r_cache:6.1f} tok/s  ({a.tokens} tokens incl. prefill)")
    print(f"plain f32 loop       : {r_plain:6.1f} tok/s  (no cache, same weights)")
    print(f"ratio cache/plain    : {r_cache / r_plain:6.2f}x")


if __name__ == "__main__":
    main()
