"""Compile (or load from numba's cache) every kernel once, on tiny inputs of the real signatures."""

from __future__ import annotations

import time

import numpy as np

from larql_edge.model.kernels._formats import FORMATS


def warm_up(formats=("q4_k", "q6_k", "q8_0", "f16")) -> float:
    """Run each format's matmul (1 and 4 rows, fused and tiled) and rows once; returns seconds taken.

    numba compiles a kernel on its first call (~2-4 s each, cold) and caches the machine code on
    disk (``cache=True``: beside the package, or under NUMBA_CACHE_DIR when that is read-only);
    later processes load it in milliseconds.
    """
    from larql_edge.model.kernels._matrix import TILED_FROM_ROWS, CompactMatrix

    t0 = time.perf_counter()
    for fmt in formats:
        cols = FORMATS[fmt].padded_cols(256)
        m = CompactMatrix.quantize(np.ones((8, cols), np.float32), fmt)
        for n in (1, 4, TILED_FROM_ROWS):
            m.matmul(np.ones((n, cols), np.float32))
        m.rows(np.array([0]))
    return time.perf_counter() - t0
