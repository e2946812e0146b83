"""Reading embed-server requests: Accept negotiation and the validation of values.

Content types and JSON bodies are read by the service toolkit (`larql_edge.service`), the same in
every server. Everything here raises the typed errors of `larql_edge.errors`, so every bad input
leaves as a 4xx with ``{"error": ...}``: 400 for malformed or invalid values, 406 for an Accept
nothing can satisfy, 413 for more than a published limit.
"""

from __future__ import annotations

import json
import math
import re

import numpy as np

from larql_edge.errors import BadRequest, NotAcceptable, PayloadTooLarge
from larql_edge.wire import BINARY, JSON
from larql_edge.wire.embed import MIN_TEMPERATURE
from larql_edge.wire.numbers import finite_f32, float_vector, json_int

_DIGITS = re.compile(r"^[0-9]{1,10}$")
# An integer in a query string: as in JSON bodies, 3 and 3.0 alike (larql_edge.wire.numbers.json_int).
_QUERY_INT = re.compile(r"-?[0-9]{1,19}(\.0*)?")


# -- Accept ----------------------------------------------------------------------------------------


def wants_binary(request, default_binary: bool) -> bool:
    """Whether to answer ``f32`` bytes rather than JSON: the default unless Accept prefers the other
    (equal preference and a missing Accept go to the default; nothing acceptable is a 406)."""
    default, other = (BINARY, JSON) if default_binary else (JSON, BINARY)
    if not request.headers.get("accept"):
        return default_binary
    m = request.accept.match(default, other)
    if not m:
        raise NotAcceptable(f"Accept {request.headers.get('accept')!r}: this resource is {default} or {other}")
    return str(m) == BINARY


# -- values ----------------------------------------------------------------------------------------


def check_ids(ids: np.ndarray, vocab: int, limit: int, what: str = "token_ids") -> np.ndarray:
    """Non-empty, at most ``limit`` ids, each in ``[0, vocab)``; returns int64."""
    if ids.size == 0:
        raise BadRequest(f"{what} is empty")
    if ids.size > limit:
        raise PayloadTooLarge(f"{what} has {ids.size} ids; the limit is {limit} per request")
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= vocab:
        bad = lo if lo < 0 else hi
        raise BadRequest(f"token id {bad} is out of range [0, {vocab})")
    return ids.astype(np.int64, copy=False)


def json_ids(value, what: str = "token_ids") -> np.ndarray:
    """A JSON list of integers (``3`` or ``3.0``; no fractions, booleans or nesting) as an int64 array."""
    if not isinstance(value, list):
        raise BadRequest(f"{what} must be a list of integers")
    ids = []
    for v in value:
        i = json_int(v)
        if i is None:
            raise BadRequest(f"{what} must hold integers only (got {json.dumps(v)[:40]})")
        if not -(2**63) <= i < 2**63:
            raise BadRequest(f"token id {i} is out of range")
        ids.append(i)
    return np.asarray(ids, dtype=np.int64)


def path_id(text: str) -> int:
    """A token id from a URL segment: decimal digits only (no sign, no fraction, no spaces)."""
    if not _DIGITS.match(text):
        raise BadRequest(f"token id {text[:40]!r} is not a non-negative integer")
    return int(text)


def query_ids(text: str | None) -> np.ndarray:
    if text is None or not text.strip():
        raise BadRequest("ids is required, e.g. ?ids=9515,235")
    out = []
    for part in text.split(","):
        part = part.strip()
        if not _QUERY_INT.fullmatch(part):
            raise BadRequest(f"ids: {part[:40]!r} is not an integer")
        out.append(int(part.split(".", 1)[0]))
    return np.asarray(out, dtype=np.int64)


def residual(value, hidden: int) -> np.ndarray:
    """A JSON residual: a flat list of ``hidden`` finite numbers, as float32."""
    return float_vector(value, "residual", hidden)


def finite(x: np.ndarray, what: str = "residual") -> np.ndarray:
    return finite_f32(x, what)


def int_param(value, name: str, default: int, lo: int, hi: int) -> int:
    if value is None:
        return default
    if isinstance(value, str):
        if not _QUERY_INT.fullmatch(value.strip()) or len(value.strip()) > 24:
            raise BadRequest(f"{name} must be an integer")
        value = int(value.strip().split(".", 1)[0])
    elif type(value) is not int:
        raise BadRequest(f"{name} must be an integer")
    if not lo <= value <= hi:
        raise BadRequest(f"{name}={value} is out of range [{lo}, {hi}]")
    return value


def temperature_param(value) -> float:
    """0 (greedy) or a finite temperature >= MIN_TEMPERATURE; default 1."""
    if value is None:
        return 1.0
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            raise BadRequest("temperature must be a number") from None
    elif type(value) not in (int, float):
        raise BadRequest("temperature must be a number")
    try:
        value = float(value)
    except OverflowError:  # a JSON integer beyond float64 (10**400)
        raise BadRequest("temperature is beyond float range: use a finite number >= 0 (0 means greedy)") from None
    if not math.isfinite(value) or value < 0:
        raise BadRequest(f"temperature={value} is invalid: use a finite number >= 0 (0 means greedy)")
    if 0 < value < MIN_TEMPERATURE:  # logits / 1e-40 overflow float32: NaN probabilities, Inf logits
        raise BadRequest(f"temperature={value} is below {MIN_TEMPERATURE}: use 0 for greedy")
    return value


def bool_param(value, name: str, default: bool = False) -> bool:
    if value is None:
        return default
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("1", "true", "yes", "on"):
        return True
    if isinstance(value, str) and value.strip().lower() in ("0", "false", "no", "off"):
        return False
    raise BadRequest(f"{name} must be a boolean")
