"""Load ggml once at process start (and say what it is), so the first request does not pay for it."""

from __future__ import annotations

import time

import numpy as np

from larql_edge.model.kernels import _ggml
from larql_edge.model.kernels._threads import get_threads


def warm_up(formats=("q4_k", "q6_k", "q8_0", "q5_0", "q4_1", "f16")) -> float:
    """Load libggml and run each format's product and row decode once; returns seconds taken."""
    from larql_edge.model.kernels._matrix import CompactMatrix

    t0 = time.perf_counter()
    for fmt in formats:
        m = CompactMatrix.quantize(np.ones((8, 256), np.float32), fmt)
        m.matmul(np.ones((1, 256), np.float32))
        m.rows(np.array([0]))
    return time.perf_counter() - t0


def kernel_info() -> dict:
    """The compute library behind the compact backend: name, version, path, CPU features, threads."""
    return {**_ggml.lib().info(), "threads": get_threads()}
