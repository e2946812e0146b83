"""Q5_0 multiplied from its stored blocks against from a Q8_0 copy of the same values (`_matrix.WIDEN`).

The gguf vindex of Gemma 3 270M keeps ffn_gate, ffn_up, attn_q, attn_k and half of attn_v as Q5_0. On
x86 ggml's Q8_0 `vec_dot` is Q5_0's without the bit unpacking, so the copy gives the same floats (checked
here on every product timed, and in tests/test_kernels.py). Per shape and rows of x: CPU ms of one thread
(medians), widened / stored, in one process, alternating. Usage: python benchmarks/widen.py [--reps 300]
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

from larql_edge.model.kernels import CompactMatrix, _ggml, _matrix  # noqa: E402

SHAPES = [("ffn_gate/up", 2048, 640), ("attn_q", 1024, 640), ("attn_k/v", 256, 640)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=300, help="products timed per shape, rows and route")
    ap.add_argument("--rows", default="1,4,16", help="rows of x, comma-separated")
    args = ap.parse_args()
    try:
        levels = [int(r) for r in args.rows.split(",")]
    except ValueError:
        ap.error(f"--rows must be comma-separated integers, got {args.rows!r}")
    if args.reps < 1 or not levels or min(levels) < 1:
        ap.error("--reps and every --rows value must be at least 1")
    if "q5_0" not in _matrix.WIDEN:
        sys.exit("widen: Q5_0 is not widened on this machine (x86-64 only): nothing to compare")
    info = _ggml.lib().info()
    print(f"ggml {info['version']}, build {info['build']}, features {','.join(info['cpu_features'])}; one thread; "
          f"load average {os.getloadavg()[0]:.2f}")
    print(f"{'weight':12s} {'shape':>9s} {'rows':>4s} {'stored ms':>10s} {'widened ms':>11s} {'widened/stored':>15s}  equal")
    rng = np.random.default_rng(1)
    saved = _matrix.WIDEN
    for name, r, c in SHAPES:
        w = rng.standard_normal((r, c)).astype(np.float32) * 0.05
        widened = CompactMatrix.quantize(w, "q5_0")
        _matrix.WIDEN = {}
        try:
            stored = CompactMatrix.from_blocks(widened.data.reshape(-1).copy(), "q5_0", r, c)
            stored.matmul(np.zeros((1, c), np.float32))  # its graphs made now, on the stored bytes
        finally:
            _matrix.WIDEN = saved
        assert widened.kernel_form()[0] == "q8_0" and stored.kernel_form()[0] == "q5_0"
        for n in levels:
            x = rng.standard_normal((n, c)).astype(np.float32)
            equal = np.array_equal(widened.matmul(x), stored.matmul(x))
            a, b = [], []
            for _ in range(3):  # alternating thirds: the same neighbours' load for both
                reps = max(1, args.reps // 3)
                a.append(median_ms(partial(stored.matmul, x), reps, 1, time.thread_time))
                b.append(median_ms(partial(widened.matmul, x), reps, 1, time.thread_time))
            sa, sb = float(np.median(a)), float(np.median(b))
            print(f"{name:12s} {r:4d}x{c:<4d} {n:4d} {sa:10.3f} {sb:11.3f} {sb / sa:14.2f}x  {equal}", flush=True)
            if not equal:
                sys.exit("widen: the widened product differs from the stored one")


if __name__ == "__main__":
    main()
