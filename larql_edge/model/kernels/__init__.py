"""Matrix products on compact (quantized or f16) weights, without a float32 copy of the weights.

``CompactMatrix`` holds a weight ``[out, in]`` in ggml's block layout (Q4_K, Q6_K, Q8_0, Q5_0, Q4_1)
or as f16, usually as a memory map of the vindex file, and computes ``x @ W.T`` and row lookups from
those bytes with ggml's own CPU kernels (the prebuilt ``libggml-python`` wheel, through ctypes:
`_ggml`). ``"f32"`` is the exact reference (numpy BLAS).

    m = CompactMatrix.from_blocks(raw_uint8, "q4_k", rows, cols)
    y = m.matmul(x)            # x float32 [n, cols] -> [n, rows]
    e = m.rows([2, 818])       # float32 [2, cols]

``set_threads(n)`` caps the threads one product may use; ``kernel_info()`` names the library, its
version and the CPU features its build uses.
"""

from __future__ import annotations

from larql_edge.model.kernels._formats import FORMATS, KernelError
from larql_edge.model.kernels._matrix import CompactMatrix
from larql_edge.model.kernels._threads import get_threads, map_rows, set_threads
from larql_edge.model.kernels._warmup import kernel_info, warm_up

COMPACT_FORMATS = ("q4_k", "q6_k", "q8_0", "q5_0", "q4_1", "f16")

__all__ = ["COMPACT_FORMATS", "FORMATS", "CompactMatrix", "KernelError", "get_threads", "kernel_info",
           "map_rows", "set_threads", "warm_up"]
