"""The head's row-wise post-processing on one kernel thread and on two (issue #17, `kernels.map_rows`).

    python benchmarks/head_post.py [--rows 16] [--vocab 262144] [--k 1,8,64] [--n 60]
                                   [--out benchmarks/results/head_post.txt]

After the lm_head product of a decode step, every row of ``rows x vocab`` logits needs its top k and
its log-normaliser: the embed server's many-rows ``/v1/logits`` (`routes.logits._top_k_rows`, with
the token texts) and the in-process `LocalTopK.top_k_rows` (`model.head.candidates`). One process,
random logits of Gemma 3's vocabulary, wall-clock medians of ``--n`` calls; ``1t/2t``: two threads' speed-up
over one, both measured in the same run (the rows split across the kernel threads: numpy's reductions,
partitions and exponentials release the GIL; the token texts do not). Each route's answer is checked
equal on both.
"""

from __future__ import annotations

import argparse
import os
import pickle
import sys
from pathlib import Path

for _v in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_v] = "1"
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
from _support import median_ms, save_keeping_earlier  # noqa: E402

from larql_edge.model.batch import LocalTopK  # noqa: E402
from larql_edge.model.kernels import set_threads  # noqa: E402
from larql_edge.roles.embed.routes.logits import _top_k_rows  # noqa: E402


class _Texts:
    def token_text(self, i: int) -> str:  # the route's per-id text, as cheap as a tokenizer's cache hit
        return f"t{i}"


class _Head:
    def __init__(self, logits: np.ndarray):
        self.x = logits

    def logits(self, h: np.ndarray) -> np.ndarray:
        return self.x


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=262144)
    ap.add_argument("--k", default="1,8,64")
    ap.add_argument("--n", type=int, default=60)
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/head_post.txt"))
    a = ap.parse_args()
    block = (np.random.default_rng(0).standard_normal((a.rows, a.vocab)) * 3).astype(np.float32)
    lines = [f"head post-processing of {a.rows} rows x {a.vocab} logits, median ms of {a.n} calls; "
             f"load average before: {os.getloadavg()[0]:.2f}",
             f"{'k':>4} {'route':>12} {'1t ms':>8} {'2t ms':>8} {'1t/2t':>7}"]
    routes = {
        "embed route": lambda k: _top_k_rows(_Texts(), k, 1.0, (), None, {}, block),
        "LocalTopK": lambda k: LocalTopK(_Head(block)).top_k_rows(block, k),
    }
    for k in (int(v) for v in a.k.split(",")):
        for name, route in routes.items():
            ms, answers = {}, {}
            for threads in (1, 2):
                set_threads(threads)
                answers[threads] = route(k)
                ms[threads] = median_ms(lambda route=route, k=k: route(k), n=a.n, warmup=3)
            if pickle.dumps(answers[1]) != pickle.dumps(answers[2]):  # exact: every float's bits
                raise SystemExit(f"k={k} {name}: the answers on 1 and 2 threads differ")
            lines.append(f"{k:>4} {name:>12} {ms[1]:>8.2f} {ms[2]:>8.2f} {ms[1] / ms[2]:>6.2f}x")
    lines.append(f"load average after: {os.getloadavg()[0]:.2f}; CPU: {_cpu()}")
    print("\n".join(lines))
    save_keeping_earlier(a.out, lines)


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


if __name__ == "__main__":
    main()
