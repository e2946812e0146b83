"""The FFN wire format of POST /v1/walk-ffn (LARQL-compatible, little-endian). This module owns it.

Request, single layer::

    u32 layer, u32 seq_len, u32 flags (bit0 full_output), u32 top_k, f32[seq_len * hidden]

Request, batch (the SAME input rows are applied to every listed layer: LARQL's batch semantics)::

    u32 0xFFFFFFFF, u32 num_layers, u32 layers[num_layers], u32 seq_len, u32 flags, u32 top_k,
    f32[seq_len * hidden]

Response, single::   u32 layer, u32 seq_len, f32 latency_ms, VAL[seq_len * hidden]
Response, batch::    u32 0xFFFFFFFF, u32 num_results, f32 latency_ms,
                     then per result: u32 layer, u32 seq_len, u32 n, VAL[n]

VAL is f32 (``application/x-larql-ffn``) or f16 when the caller sent
``Accept: application/x-larql-ffn-f16``; the framing is the same. Request values are always f32.

Every decoder checks sizes exactly and raises `WireError` (a 400) naming what is wrong, so
a server can answer 400 without ever indexing past the buffer.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from larql_edge.wire import BINARY, BINARY_F16, WireError
from larql_edge.wire.numbers import finite_f32, float_rows, float_vector, json_int

CONTENT_TYPE = BINARY
CONTENT_TYPE_F16 = BINARY_F16
BATCH = 0xFFFFFFFF
FLAG_FULL_OUTPUT = 1

_F32 = np.dtype("<f4")
_F16 = np.dtype("<f2")
_U32 = struct.Struct("<I")
_HEAD = struct.Struct("<III")  # seq_len, flags, top_k (after the layer field(s))
_RESP = struct.Struct("<IIf")  # layer|BATCH, seq_len|num_results, latency_ms
_ITEM = struct.Struct("<III")  # layer, seq_len, n
_LATENCY = struct.Struct("<f")  # _RESP's last field, written once the reply's values are in

# A request never names more layers than a model could have; bounds the work a header can ask for.
MAX_BATCH_LAYERS = 4096


@dataclass(frozen=True)
class FfnRequest:
    layers: tuple[int, ...]
    x: np.ndarray  # [seq_len, hidden] float32 (a read-only view of the body)
    batch: bool
    full_output: bool = True
    top_k: int = 0

    @property
    def seq_len(self) -> int:
        return int(self.x.shape[0])


def value_dtype(f16: bool) -> np.dtype:
    return _F16 if f16 else _F32


def wants_f16(accept: str | None) -> bool:
    """True when an Accept header asks for f16 values (``application/x-larql-ffn-f16``)."""
    return accept is not None and CONTENT_TYPE_F16 in accept.lower()


def reply_content_type(f16: bool) -> str:
    return CONTENT_TYPE_F16 if f16 else CONTENT_TYPE


# -- requests ------------------------------------------------------------------------------------


def encode_request(
    layers: int | Sequence[int], x: np.ndarray, *, full_output: bool = True, top_k: int = 0, batch: bool | None = None
) -> bytes:
    """Encode ``x`` (``[seq, hidden]`` or ``[hidden]``) for one layer (an int) or a batch (a sequence)."""
    rows = np.atleast_2d(np.asarray(x, dtype=_F32))
    if rows.ndim != 2:
        raise WireError("the input must be [seq_len, hidden]")
    flags = FLAG_FULL_OUTPUT if full_output else 0
    tail = _HEAD.pack(rows.shape[0], flags, top_k) + np.ascontiguousarray(rows, dtype=_F32).tobytes()
    if isinstance(layers, (int, np.integer)) and not batch:
        return _U32.pack(int(layers)) + tail
    ls = [int(layers)] if isinstance(layers, (int, np.integer)) else [int(v) for v in layers]
    return struct.pack(f"<II{len(ls)}I", BATCH, len(ls), *ls) + tail


def decode_request(body: bytes, hidden: int) -> FfnRequest:
    """Parse a request body for a model of width ``hidden``; sizes must match exactly."""
    mv = memoryview(body)
    if len(mv) < 4:
        raise WireError(f"body of {len(mv)} bytes is shorter than the 16-byte header")
    (first,) = _U32.unpack_from(mv, 0)
    if first == BATCH:
        if len(mv) < 8:
            raise WireError("batch request ends before num_layers")
        (k,) = _U32.unpack_from(mv, 4)
        if k == 0:
            raise WireError("batch request lists no layers")
        if k > MAX_BATCH_LAYERS:
            raise WireError(f"batch request lists {k} layers (at most {MAX_BATCH_LAYERS})")
        off = 8 + 4 * k
        if len(mv) < off:
            raise WireError(f"batch request ends inside its list of {k} layers")
        layers = tuple(int(v) for v in np.frombuffer(mv[8:off], dtype="<u4"))
        batch = True
    else:
        layers, off, batch = (int(first),), 4, False
    if len(mv) < off + _HEAD.size:
        raise WireError(f"body of {len(mv)} bytes ends inside the header")
    seq_len, flags, top_k = _HEAD.unpack_from(mv, off)
    off += _HEAD.size
    if seq_len == 0:
        raise WireError("seq_len is 0: nothing to compute")
    want = seq_len * hidden * 4
    got = len(mv) - off
    if got != want:
        raise WireError(f"expected {want} bytes of f32 values (seq_len {seq_len} x hidden {hidden}), got {got}")
    x = finite_f32(np.frombuffer(mv[off:], dtype=_F32).reshape(seq_len, hidden), "the input rows")
    return FfnRequest(layers=layers, x=x, batch=batch, full_output=bool(flags & FLAG_FULL_OUTPUT), top_k=int(top_k))


# -- responses -----------------------------------------------------------------------------------


def encode_response(layer: int, out: np.ndarray, latency_ms: float, f16: bool = False) -> bytes:
    rows = np.atleast_2d(out)
    vals = np.ascontiguousarray(rows, dtype=value_dtype(f16))
    return _RESP.pack(int(layer), rows.shape[0], float(latency_ms)) + vals.tobytes()


def reply_buffer(layers: Sequence[int], seq_len: int, hidden: int, batch: bool,
                 f16: bool = False) -> tuple[bytearray, list[np.ndarray]]:
    """A reply's bytes, framed, and a writable ``[seq_len, hidden]`` view of each layer's values in
    them (float32, or float16 for ``f16``): a shard computes straight into its reply, no encode copy.
    The latency field is 0 until `set_latency`."""
    dt = value_dtype(f16)
    n = seq_len * hidden
    item = n * dt.itemsize
    if batch:
        step = _ITEM.size + item
        buf = bytearray(_RESP.size + step * len(layers))
        _RESP.pack_into(buf, 0, BATCH, len(layers), 0.0)
        views = []
        for i, layer in enumerate(layers):
            off = _RESP.size + i * step
            _ITEM.pack_into(buf, off, int(layer), seq_len, n)
            views.append(np.frombuffer(buf, dt, n, off + _ITEM.size).reshape(seq_len, hidden))
        return buf, views
    if len(layers) != 1:
        raise WireError("a single-layer reply carries exactly one layer")
    buf = bytearray(_RESP.size + item)
    _RESP.pack_into(buf, 0, int(layers[0]), seq_len, 0.0)
    return buf, [np.frombuffer(buf, dt, n, _RESP.size).reshape(seq_len, hidden)]


def set_latency(buf: bytearray, latency_ms: float) -> None:
    """The latency field of a reply made by `reply_buffer` (the same place in single and batch replies)."""
    _LATENCY.pack_into(buf, _RESP.size - _LATENCY.size, float(latency_ms))


def decode_response(body: bytes, hidden: int, f16: bool = False) -> tuple[int, np.ndarray, float]:
    """``(layer, out [seq_len, hidden] float32, latency_ms)`` of a single-layer reply."""
    mv = memoryview(body)
    if len(mv) < _RESP.size:
        raise WireError(f"reply of {len(mv)} bytes is shorter than its 12-byte header")
    layer, seq_len, latency = _RESP.unpack_from(mv, 0)
    if layer == BATCH:
        raise WireError("expected a single-layer reply, got a batch reply")
    dt = value_dtype(f16)
    want = seq_len * hidden * dt.itemsize
    if len(mv) - _RESP.size != want:
        raise WireError(f"reply for layer {layer} carries {len(mv) - _RESP.size} value bytes, expected {want}")
    out = np.frombuffer(mv[_RESP.size :], dtype=dt).reshape(seq_len, hidden).astype(np.float32)
    return int(layer), out, float(latency)


def encode_batch_response(results: Sequence[tuple[int, np.ndarray]], latency_ms: float, f16: bool = False) -> bytes:
    dt = value_dtype(f16)
    parts = [_RESP.pack(BATCH, len(results), float(latency_ms))]
    for layer, out in results:
        rows = np.atleast_2d(out)
        parts.append(_ITEM.pack(int(layer), rows.shape[0], rows.size))
        parts.append(np.ascontiguousarray(rows, dtype=dt).tobytes())
    return b"".join(parts)


def iter_batch_items(body: bytes, f16: bool = False):
    """Yield ``(layer, seq_len, raw value bytes)`` per result of a batch reply, checking every size.

    The router merges replies from several shards by re-framing these raw bytes: no decode and
    re-encode of the values, so what a shard sent is what the client gets, bit for bit.
    """
    mv = memoryview(body)
    if len(mv) < _RESP.size:
        raise WireError(f"batch reply of {len(mv)} bytes is shorter than its 12-byte header")
    marker, count, _ = _RESP.unpack_from(mv, 0)
    if marker != BATCH:
        raise WireError("expected a batch reply")
    size = value_dtype(f16).itemsize
    off = _RESP.size
    for i in range(count):
        if len(mv) < off + _ITEM.size:
            raise WireError(f"batch reply ends before result {i}")
        layer, seq_len, n = _ITEM.unpack_from(mv, off)
        off += _ITEM.size
        end = off + n * size
        if end > len(mv):
            raise WireError(f"batch reply ends inside result {i} (layer {layer})")
        yield int(layer), int(seq_len), mv[off:end]
        off = end
    if off != len(mv):
        raise WireError(f"batch reply has {len(mv) - off} trailing bytes")


def batch_latency(body: bytes) -> float:
    if len(body) < _RESP.size:
        raise WireError("batch reply is shorter than its header")
    return float(_RESP.unpack_from(body, 0)[2])


def frame_batch(items: Sequence[tuple[int, int, bytes | memoryview]], latency_ms: float, f16: bool = False) -> bytes:
    """A batch reply from already-encoded results ``(layer, seq_len, value bytes)``."""
    size = value_dtype(f16).itemsize
    parts: list[bytes | memoryview] = [_RESP.pack(BATCH, len(items), float(latency_ms))]
    for layer, seq_len, raw in items:
        parts.append(_ITEM.pack(layer, seq_len, len(raw) // size))
        parts.append(raw)
    return b"".join(parts)


def decode_batch_response(body: bytes, hidden: int | None = None, f16: bool = False) -> tuple[list[tuple[int, np.ndarray]], float]:
    """``([(layer, out float32 [seq_len, n / seq_len])...], latency_ms)`` of a batch reply."""
    dt = value_dtype(f16)
    results = []
    for layer, seq_len, raw in iter_batch_items(body, f16):
        vals = np.frombuffer(raw, dtype=dt).astype(np.float32)
        if seq_len == 0 or vals.size % seq_len:
            raise WireError(f"result for layer {layer}: {vals.size} values do not split into {seq_len} rows")
        width = vals.size // seq_len
        if hidden is not None and width != hidden:
            raise WireError(f"result for layer {layer} has width {width}, expected {hidden}")
        results.append((layer, vals.reshape(seq_len, width)))
    return results, batch_latency(body)


def is_batch_body(body: bytes) -> bool:
    return len(body) >= 4 and _U32.unpack_from(body, 0)[0] == BATCH


def split_batch_request(body: bytes) -> tuple[tuple[int, ...], bytes]:
    """``(layers, tail)`` of a batch request, where tail = seq_len, flags, top_k and the values.

    Used by the router to re-address one input to several shards without touching the values.
    Checks only the framing (the router may not know ``hidden``); shards check the sizes.
    """
    mv = memoryview(body)
    if len(mv) < 8 or _U32.unpack_from(mv, 0)[0] != BATCH:
        raise WireError("not a batch request")
    (k,) = _U32.unpack_from(mv, 4)
    if k == 0 or k > MAX_BATCH_LAYERS:
        raise WireError(f"batch request lists {k} layers (1 to {MAX_BATCH_LAYERS})")
    off = 8 + 4 * k
    if len(mv) < off + _HEAD.size:
        raise WireError("batch request ends before its values")
    layers = tuple(int(v) for v in np.frombuffer(mv[8:off], dtype="<u4"))
    return layers, bytes(mv[off:])


def batch_request_from_tail(layers: Sequence[int], tail: bytes) -> bytes:
    return struct.pack(f"<II{len(layers)}I", BATCH, len(layers), *layers) + tail


def single_layer_of(body: bytes) -> int:
    if len(body) < 4 + _HEAD.size:
        raise WireError(f"body of {len(body)} bytes is shorter than the 16-byte header")
    return int(_U32.unpack_from(body, 0)[0])


# -- JSON form -------------------------------------------------------------------------------------
# Request: {"layer": L} or {"layers": [L, ...]}, "residual": [[f32 x hidden] x seq] (or a flat list
# with "seq_len"), optional "full_output" (default true) and "top_k".
# Reply:   {"layer", "seq_len", "output": [[...]], "latency_ms"} or
#          {"results": [{"layer", "seq_len", "output"}...], "latency_ms"}.


def _int_field(obj: dict, key: str) -> int:
    v = json_int(obj[key])
    if v is None or v < 0 or v >= BATCH:
        raise WireError(f'"{key}" must be a non-negative integer')
    return v


def request_from_json(obj: object, hidden: int) -> FfnRequest:
    if not isinstance(obj, dict):
        raise WireError("the JSON body must be an object")
    if ("layer" in obj) == ("layers" in obj):
        raise WireError('give exactly one of "layer" or "layers"')
    if "layer" in obj:
        layers: tuple[int, ...] = (_int_field(obj, "layer"),)
        batch = False
    else:
        ls = obj["layers"]
        if not isinstance(ls, list) or not ls or len(ls) > MAX_BATCH_LAYERS:
            raise WireError(f'"layers" must be a list of 1 to {MAX_BATCH_LAYERS} layer numbers')
        layers = tuple(_int_field({"layers": v}, "layers") for v in ls)
        batch = True
    if "residual" not in obj:
        raise WireError('missing "residual"')
    value = obj["residual"]
    if isinstance(value, list) and value and isinstance(value[0], list):
        x = float_rows(value, '"residual"', hidden)
        if "seq_len" in obj and json_int(obj["seq_len"]) != x.shape[0]:  # optional, but never null or wrong
            raise WireError(f'"seq_len" {str(obj["seq_len"])[:20]} is not the {x.shape[0]} rows of "residual"')
    else:
        flat = float_vector(value, '"residual"')
        seq = json_int(obj.get("seq_len", flat.size // hidden if hidden else 0))
        if seq is None or seq <= 0 or flat.size != seq * hidden:
            raise WireError(f'"residual" has {flat.size} values: not seq_len x hidden ({hidden})')
        x = flat.reshape(seq, hidden)
    full = obj.get("full_output", True)
    if not isinstance(full, bool):
        raise WireError('"full_output" must be true or false')
    top_k = json_int(obj.get("top_k", 0))
    if top_k is None or top_k < 0:
        raise WireError('"top_k" must be a non-negative integer')
    return FfnRequest(layers=layers, x=x, batch=batch, full_output=full, top_k=top_k)


def request_to_json(layers: int | Sequence[int], x: np.ndarray) -> dict:
    rows = np.atleast_2d(np.asarray(x, dtype=np.float32)).tolist()
    if isinstance(layers, (int, np.integer)):
        return {"layer": int(layers), "residual": rows}
    return {"layers": [int(v) for v in layers], "residual": rows}


def response_to_json(results: Sequence[tuple[int, np.ndarray]], latency_ms: float, batch: bool) -> dict:
    items = [
        {"layer": int(layer), "seq_len": int(np.atleast_2d(out).shape[0]), "output": np.atleast_2d(out).tolist()}
        for layer, out in results
    ]
    if batch:
        return {"results": items, "latency_ms": round(float(latency_ms), 3)}
    return items[0] | {"latency_ms": round(float(latency_ms), 3)}
