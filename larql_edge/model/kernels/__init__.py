"""Matrix products on compact (quantized or f16) weights, without a float32 copy of the weights.

``CompactMatrix`` holds a weight ``[out, in]`` in ggml's block layout (Q4_K, Q6_K, Q8_0) or as f16,
usually as a memory map of the vindex file, and computes ``x @ W.T`` and row lookups from those
bytes with numba kernels (chosen by measurement: benchmarks/kernels.py, DESIGN.md). ``"f32"`` is
the exact reference (numpy BLAS).

    m = CompactMatrix.from_blocks(raw_uint8, "q4_k", rows, cols)
    y = m.matmul(x)            # x float32 [n, cols] -> [n, rows]
    e = m.rows([2, 818])       # float32 [2, cols]

``warm_up()`` compiles (or loads from numba's on-disk cache) every kernel; call it at process start
so the first request does not pay for it. ``set_threads(n)`` caps the threads one product may use.
"""

from __future__ import annotations

from larql_edge.model.kernels._formats import FORMATS, KernelError
from larql_edge.model.kernels._matrix import CompactMatrix
from larql_edge.model.kernels._threads import get_threads, set_threads
from larql_edge.model.kernels._warmup import warm_up

COMPACT_FORMATS = ("q4_k", "q6_k", "q8_0", "f16")

__all__ = ["COMPACT_FORMATS", "FORMATS", "CompactMatrix", "KernelError", "get_threads", "set_threads", "warm_up"]
