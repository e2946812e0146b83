"""What padding a 1-row product to 2 rows costs on the installed ggml build (DESIGN.md §4.3).

A ggml built with llamafile's sgemm multiplies 2+ rows by tinyBLAS and one row by `vec_dot`; the package
then runs every 1-row product as 2 rows (`_ggml.sgemm_min_rows`) so that a row's floats never depend on
its company. This times, in one process and one thread, the products of Gemma 3 270M's shapes (random
weights) at 1 and 16 rows, plain (`min_rows` 1) and padded (`min_rows` 2), and prints padded / plain.
On the prebuilt wheel (no llamafile) padding only adds work; on a llamafile build the plain 1-row figure
is what the rule forbids. Usage: python benchmarks/min_rows.py [--reps-large 5] [--reps-small 300]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from functools import partial
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("LARQL_KERNEL_THREADS", "1")

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _support import median_ms  # noqa: E402  (benchmarks/ is the script's folder)

from larql_edge.model.kernels import CompactMatrix, _ggml  # noqa: E402

SHAPES = [("lm_head", "q8_0", 262144, 640), ("lm_head", "f16", 262144, 640), ("gate", "q4_k", 2048, 640),
          ("down", "q6_k", 640, 2048), ("gate", "q5_0", 1024, 640), ("gate", "f16", 2048, 640)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps-large", type=int, default=5, help="repetitions of an lm_head product")
    ap.add_argument("--reps-small", type=int, default=300, help="repetitions of a per-layer product")
    args = ap.parse_args()
    if args.reps_large < 1 or args.reps_small < 1:
        ap.error("repetitions must be at least 1")
    L = _ggml.lib()
    info = L.info()
    load = os.getloadavg()[0]
    print(f"ggml {info['version']}, build {info['build']}, features {','.join(info['cpu_features'])}, "
          f"min_rows {L.min_rows}; one thread; load average {load:.2f}")
    print(f"{'product':22s} {'rows':>4s} {'plain ms':>9s} {'padded ms':>10s} {'padded/plain':>13s}")
    rng = np.random.default_rng(0)
    own = L.min_rows
    try:
        for name, fmt, r, c in SHAPES:
            w = rng.standard_normal((r, c), dtype=np.float32) * 0.05
            for n in (1, 16):
                x = rng.standard_normal((n, c), dtype=np.float32)
                reps = args.reps_large if r > 100_000 else args.reps_small
                got = []
                for rows in (1, 2):
                    L.min_rows = rows  # a matrix builds its graphs on first use: one per setting
                    m = CompactMatrix.quantize(w, fmt) if fmt != "f16" else CompactMatrix.from_array(w.astype(np.float16))
                    got.append(median_ms(partial(m.matmul, x), reps, 1, time.thread_time))
                    del m
                print(f"{name + ' ' + fmt + f' {r}x{c}':22s} {n:4d} {got[0]:9.3f} {got[1]:10.3f} {got[1] / got[0]:12.2f}x",
                      flush=True)
            del w
    finally:
        L.min_rows = own


if __name__ == "__main__":
    main()
