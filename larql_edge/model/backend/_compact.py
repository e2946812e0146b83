from __future__ import annotations

import numpy as np

from larql_edge.format.quant import GGML_Q6_K, QBlocks, dequantize_matrix, q6k_to_ggml
from larql_edge.model.kernels import COMPACT_FORMATS, CompactMatrix

# vindex block format -> ggml type name. "Q6_K" in a vindex is LARQL's linear bit layout, which ggml
# cannot read: it is re-laid-out once, in memory, to ggml's (lossless, same size).
_KERNEL_FORMAT = {"Q4_K": "q4_k", "Q8_0": "q8_0", "Q5_0": "q5_0", "Q4_1": "q4_1", GGML_Q6_K: "q6_k", "Q6_K": "q6_k"}


class CompactBackend:
    """Products on the weights as stored: quantized blocks and f16 tables straight from the vindex's
    memory map, through ggml's own CPU kernels (`larql_edge.model.kernels`); never a float32 copy.

    A float32 weight stays float32 (numpy BLAS, exact). LARQL's Q6_K layout is the one block format
    converted (to ggml's Q6_K, in memory, same size); any other format is converted once to f16.
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
    fmt = _KERNEL_FORMAT.get(q.format)
    data = q.data
    if fmt not in COMPACT_FORMATS:
        return CompactMatrix.from_array(dequantize_matrix(q).astype(np.float16))
    if q.format == "Q6_K":
        data = q6k_to_ggml(np.asarray(data).reshape(-1))
    raw = np.ascontiguousarray(np.asarray(data).reshape(-1))
    return CompactMatrix.from_blocks(raw, fmt, q.rows, q.logical_cols)
