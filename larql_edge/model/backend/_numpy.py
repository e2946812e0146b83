from __future__ import annotations

import numpy as np


class NumpyBackend:
    name = "numpy"

    def prepare(self, w: np.ndarray) -> np.ndarray:
        # float32, C-contiguous: BLAS then multiplies by the transposed view without copying.
        return np.ascontiguousarray(w, dtype=np.float32)

    def linear(self, x: np.ndarray, w: np.ndarray) -> np.ndarray:
        return x @ w.T
