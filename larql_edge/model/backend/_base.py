from __future__ import annotations

from typing import Protocol

import numpy as np


class Backend(Protocol):
    """The few primitives the model math needs; inputs and outputs are float32 numpy arrays."""

    name: str

    def linear(self, x: np.ndarray, w: np.ndarray) -> np.ndarray:
        """``x @ w.T`` for ``w`` in ``[out, in]`` orientation."""

    def prepare(self, w: np.ndarray) -> object:
        """Convert a weight once into the backend's preferred resident form."""
