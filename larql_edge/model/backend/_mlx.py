from __future__ import annotations

import mlx.core as mx
import numpy as np

from larql_edge.format.quant import QBlocks, dequantize_matrix


class MlxBackend:
    """Metal on Apple Silicon (CPU elsewhere): weights live as mx.array, results come back as numpy."""

    name = "mlx"

    def prepare(self, w):
        if isinstance(w, QBlocks):
            w = dequantize_matrix(w)
        return mx.array(np.ascontiguousarray(w, dtype=np.float32))

    def linear(self, x: np.ndarray, w) -> np.ndarray:
        if not isinstance(w, mx.array):
            w = mx.array(np.ascontiguousarray(w, dtype=np.float32))
        y = mx.matmul(mx.array(np.ascontiguousarray(x, dtype=np.float32)), w.T)
        return np.asarray(y)
