from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from larql_edge.format.quant import QBlocks


class Backend(Protocol):
    """The few primitives the model math needs; inputs and outputs are float32 numpy arrays."""

    name: str

    def linear(self, x: np.ndarray, w: Any) -> np.ndarray:
        """``x @ w.T`` for ``w`` (what `prepare` made of an ``[out, in]`` weight)."""

    def prepare(self, w: np.ndarray | QBlocks) -> Any:
        """Convert a weight once into the backend's preferred resident form."""
