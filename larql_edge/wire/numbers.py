"""Numbers in JSON bodies, checked strictly: JSON numbers only (no strings, no booleans, no null),
finite, within float32 range, in the shape asked for. Every JSON route with numeric arrays reads
them through here, so the JSON and binary wires refuse the same inputs.

An integer is a JSON number without a fractional part, written ``3`` or ``3.0`` alike (JSON Schema's
``integer``, which the OpenAPI documents use: JSON itself has one number type)."""

from __future__ import annotations

from typing import Any

import numpy as np

from larql_edge.errors import WireError

_NUMBER = (int, float)
# The largest magnitude a residual value may have, on every wire (JSON and binary). Real residuals are
# many orders below it; above it an FFN (about quadratic in its input) or a norm (x * x) overflows
# float32, and a reply would carry Inf or NaN.
MAX_ABS_VALUE = 1e12


def _row(values: Any, what: str) -> list:
    if not isinstance(values, list):
        raise WireError(f"{what} must be a list of numbers")
    for v in values:
        if type(v) not in _NUMBER:  # bool is an int subclass, so type() and not isinstance()
            shown = "a boolean" if isinstance(v, bool) else type(v).__name__
            raise WireError(f"{what} must hold numbers only (found {shown})")
    return values


def json_int(value: Any) -> int | None:
    """``value`` as an int when it is a JSON integer (``3`` or ``3.0``), else None (a fraction, a
    string, a boolean, null...)."""
    if type(value) is int:  # bool is an int subclass, so type() and not isinstance()
        return value
    if type(value) is float and value.is_integer():
        return int(value)
    return None


def int_list(values: Any, what: str) -> list[int]:
    """A JSON list of integers (``json_int``) as Python ints; anything else in it is a `WireError`."""
    if not isinstance(values, list):
        raise WireError(f"{what} must be a list of integers")
    out = []
    for v in values:
        i = json_int(v)
        if i is None:
            shown = "a boolean" if isinstance(v, bool) else "null" if v is None else repr(v)[:40]
            raise WireError(f"{what} must hold integers only (found {shown})")
        out.append(i)
    return out


def finite_f32(x: np.ndarray, what: str) -> np.ndarray:
    """``x`` (float32 or float64) when every value is finite and at most `MAX_ABS_VALUE` in magnitude."""
    # Two reductions and no temporary on the hot path (every FFN hop): max and min propagate NaN,
    # so a row that passes holds finite values within the bound; anything else is told apart below.
    if x.size and float(x.max()) <= MAX_ABS_VALUE and float(x.min()) >= -MAX_ABS_VALUE:
        return x
    if not np.isfinite(x).all():
        raise WireError(f"{what} contains NaN or Inf (or a value beyond float32 range)")
    if x.size and float(np.abs(x).max()) > MAX_ABS_VALUE:
        raise WireError(f"{what} holds a value beyond +-{MAX_ABS_VALUE:g}: no residual is that large, and the "
                        "FFN and norms of such values overflow float32 (Inf or NaN out)")
    return x


def _float64(values: list, what: str) -> np.ndarray:
    try:
        return np.asarray(values, dtype=np.float64)
    except OverflowError:  # a JSON integer beyond float64 (10**400)
        raise WireError(f"{what} holds a value beyond +-{MAX_ABS_VALUE:g}") from None


def float_vector(values: Any, what: str, length: int | None = None) -> np.ndarray:
    """A flat JSON list of numbers as float32 ``[n]``."""
    row = _row(values, what)
    if length is not None and len(row) != length:
        raise WireError(f"{what} has {len(row)} values; expected {length}")
    return finite_f32(_float64(row, what), what).astype(np.float32)  # bounded as sent, before rounding


def float_rows(values: Any, what: str, width: int) -> np.ndarray:
    """``[[numbers x width] x n]`` as float32 ``[n, width]``."""
    if not isinstance(values, list) or not values:
        raise WireError(f"{what} must be a non-empty list of rows of {width} numbers")
    for r in values:
        _row(r, what)
        if len(r) != width:
            raise WireError(f"{what}: a row has {len(r)} values; expected {width}")
    return finite_f32(_float64(values, what), what).astype(np.float32)
