from __future__ import annotations

import numpy as np

from larql_edge.format.quant import GGML_Q6_K, QBlocks, dequantize_matrix, q6k_to_ggml
from larql_edge.model.kernels import COMPACT_FORMATS, CompactMatrix

# vindex block format -> kernel format. "Q6_K" in a vindex is LARQL's linear bit layout; the kernels'
# "q6_k" is ggml's, "larql_q6_k" LARQL's (read in place when the kernels have it).
_KERNEL_FORMAT = {"Q4_K": "q4_k", "Q8_0": "q8_0", "Q5_0": "q5_0", "Q4_1": "q4_1", GGML_Q6_K: "q6_k"}


class CompactBackend:
    """Products on the weights as stored: quantized blocks and f16 tables straight from the vindex's
    memory map, through numba kernels (`larql_edge.model.kernels`); never a float32 copy of a table.

    A float32 weight stays float32 (numpy BLAS, exact). A block type the kernels cannot read in place
    is converted once to the nearest one they can: LARQL's Q6_K re-laid-out to ggml's (lossless, same
    size), anything else to f16.
    """

    name = "compact"

    def prepare(self, w: np.ndarray | QBlocks) -> CompactMatrix:
        if isinstance(w, QBlocks):
            return _from_blocks(w)
        a = np.asarray(w)  # a memory map becomes a plain view: no copy
        if a.dtype == np.float16 or a.dtype == np.float32:
            return CompactMatrix.from_array(a)
        return CompactMatrix.from_array(np.ascontiguousarray(a, dtype=np.float32))

    def linear(self, x: np.ndarray, w: CompactMatrix) -> np.ndarray:
        return w.matmul(np.asarray(x, dtype=np.float32))


def _from_blocks(q: QBlocks) -> CompactMatrix:
    fmt = "larql_q6_k" if q.format == "Q6_K" else _KERNEL_FORMAT.get(q.format)
    data = q.data
    if fmt not in COMPACT_FORMATS and q.format == "Q6_K":
        fmt, data = "q6_k", q6k_to_ggml(np.asarray(data).reshape(-1))
    if fmt not in COMPACT_FORMATS:
        return CompactMatrix.from_array(dequantize_matrix(q).astype(np.float16))
    raw = np.ascontiguousarray(np.asarray(data).reshape(-1))
    return CompactMatrix.from_blocks(raw, fmt, q.rows, q.logical_cols)
