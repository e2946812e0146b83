"""Numbers in JSON bodies, checked strictly: JSON numbers only (no strings, no booleans, no null),
finite, within float32 range, in the shape asked for. Every JSON route with numeric arrays reads
them through here, so the JSON and binary wires refuse the same inputs."""

from __future__ import annotations

from typing import Any

import numpy as np

from larql_edge.errors import WireError

_NUMBER = (int, float)


def _row(values: Any, what: str) -> list:
    if not isinstance(values, list):
        raise WireError(f"{what} must be a list of numbers")
    for v in values:
        if type(v) not in _NUMBER:  # bool is an int subclass, so type() and not isinstance()
            shown = "a boolean" if isinstance(v, bool) else type(v).__name__
            raise WireError(f"{what} must hold numbers only (found {shown})")
    return values


def finite_f32(x: np.ndarray, what: str) -> np.ndarray:
    if not np.isfinite(x).all():
        raise WireError(f"{what} contains NaN or Inf (or a value beyond float32 range)")
    return x


def float_vector(values: Any, what: str, length: int | None = None) -> np.ndarray:
    """A flat JSON list of numbers as float32 ``[n]``."""
    row = _row(values, what)
    if length is not None and len(row) != length:
        raise WireError(f"{what} has {len(row)} values; expected {length}")
    with np.errstate(over="ignore"):  # beyond float32 range becomes inf, refused just below
        x = np.asarray(row, dtype=np.float64).astype(np.float32)
    return finite_f32(x, what)


def float_rows(values: Any, what: str, width: int) -> np.ndarray:
    """``[[numbers x width] x n]`` as float32 ``[n, width]``."""
    if not isinstance(values, list) or not values:
        raise WireError(f"{what} must be a non-empty list of rows of {width} numbers")
    for r in values:
        _row(r, what)
        if len(r) != width:
            raise WireError(f"{what}: a row has {len(r)} values; expected {width}")
    with np.errstate(over="ignore"):
        x = np.asarray(values, dtype=np.float64).astype(np.float32)
    return finite_f32(x, what)
