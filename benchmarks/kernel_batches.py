"""Products at 1-32 rows of x, every route side by side (issue #17: which route batches take).

    python benchmarks/kernel_batches.py [--rows 1,4,8,16,32] [--reps 5] [--out benchmarks/results/kernel_batches.txt]

Routes, one thread each: ``ggml`` (mul_mat on the stored bytes: ggml's vec_dot per row), ``repacked``
(ggml's repack buffer and its gemm/gemv kernels, where this CPU build has them for the type), ``tiled``
(ggml's dequantizer into float32 tiles + SGEMM, `TILED_FROM_ROWS`; f16 through ggml-cpu's F16C converter),
and numpy float32 BLAS on the
dequantized weights (the reference). Shapes are Gemma 3 270M's (random weights): the FFN's gate
[2048, 640] and down [640, 2048] in the block types the q4k and gguf vindexes use, and a quarter of the
lm_head [65536, 640] in Q8_0 and f16. Times are the calling thread's CPU time (``time.thread_time``),
best of --reps: on a shared machine the wall time mostly measures the neighbours.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

for _v in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_v] = "1"

import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from _support import save_keeping_earlier  # noqa: E402  (benchmarks/ is the script's folder)

from larql_edge.model.kernels import CompactMatrix, _matrix, kernel_info, set_threads  # noqa: E402

SHAPES = [("gate", 2048, 640, "f16"), ("down", 640, 2048, "f16"),
          ("gate", 2048, 640, "q4_k"), ("gate", 2048, 640, "q5_0"), ("down", 640, 2048, "q6_k"),
          ("down", 640, 2048, "q4_k"), ("lm_head/4", 65536, 640, "q8_0"), ("lm_head/4", 65536, 640, "f16")]


def cpu_ms(fn, reps: int) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.thread_time()
        fn()
        best = min(best, time.thread_time() - t0)
    return best * 1e3


def matrix(w: np.ndarray, fmt: str, repack: bool) -> CompactMatrix:
    m = CompactMatrix.quantize(w, fmt)
    saved, _matrix.REPACK = _matrix.REPACK, repack
    try:
        m.matmul(np.zeros((1, w.shape[1]), np.float32))  # graphs (and any repacked copy) made now
    finally:
        _matrix.REPACK = saved
    return m


def routes(plain: CompactMatrix, rep: CompactMatrix, ref: np.ndarray, x: np.ndarray, reps: int) -> dict[str, float]:
    got = {"ggml": cpu_ms(lambda: plain.matmul(x), reps)}
    got["repacked"] = cpu_ms(lambda: rep.matmul(x), reps) if rep.repacked else float("nan")
    _matrix.TILED_FROM_ROWS = 1
    try:
        got["tiled"] = cpu_ms(lambda: plain.matmul(x), reps)
    finally:
        _matrix.TILED_FROM_ROWS = 1 << 30
    got["f32"] = cpu_ms(lambda: x @ ref.T, reps)
    return got


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,4,8,16,32")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "kernel_batches.txt"))
    args = ap.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    set_threads(1)
    info = kernel_info()
    lines: list[str] = []

    def say(s: str = "") -> None:
        print(s, flush=True)
        lines.append(s)

    say(f"kernel routes by rows of x, {time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} CPUs, load average "
        f"{os.getloadavg()[0]:.1f}; {info['library']} {info['version']}; CPU features {' '.join(info['cpu_features'])}")
    say("ms of the thread's CPU time per product, best of %d; x f32 = route / numpy float32" % args.reps)
    say("")
    say(f"{'matrix':<10} {'format':<6} {'rows':>4} {'ggml':>9} {'repacked':>9} {'tiled':>9} {'f32':>9}   best (x f32)")
    rng = np.random.default_rng(0)
    for name, r, c, fmt in SHAPES:
        w = (rng.standard_normal((r, c)) * 0.05).astype(np.float32)
        plain, rep = matrix(w, fmt, False), matrix(w, fmt, True)
        ref = plain.dequantize()
        for n in rows:
            x = rng.standard_normal((n, c)).astype(np.float32)
            got = routes(plain, rep, ref, x, args.reps)
            best = min((k for k in got if k != "f32" and got[k] == got[k]), key=lambda k: got[k])
            cells = " ".join(f"{got[k]:9.3f}" if got[k] == got[k] else f"{'-':>9}" for k in ("ggml", "repacked", "tiled", "f32"))
            say(f"{name:<10} {fmt:<6} {n:>4} {cells}   {best} ({got[best] / got['f32']:.2f}x)")
    say("")
    say(f"load average at end {os.getloadavg()[0]:.1f}")
    save_keeping_earlier(args.out, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
