from __future__ import annotations

import numpy as np

from larql_edge.format.quant import QBlocks, dequantize_matrix
from larql_edge.model.ops import linear_rows


class NumpyBackend:
    name = "numpy"

    def prepare(self, w: np.ndarray | QBlocks) -> np.ndarray:
        # float32, C-contiguous: BLAS then multiplies by the transposed view without copying. The
        # exact reference: quantized blocks are dequantized (LARQL's layouts, padding dropped).
        if isinstance(w, QBlocks):
            return dequantize_matrix(w)
        return np.ascontiguousarray(w, dtype=np.float32)

    def linear(self, x: np.ndarray, w: np.ndarray) -> np.ndarray:
        return linear_rows(x, w.T) if x.ndim == 2 else x @ w.T  # rows as alone: speculation stays exact
