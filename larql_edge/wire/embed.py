"""The embed server's binary wire (content type ``application/x-larql-ffn``, little-endian).

- POST ``/v1/embed`` request: ``u32 n, u32 ids[n]``;
  response: ``u32 seq_len, u32 hidden, f32[seq_len * hidden]`` (rows already scaled).
- GET ``/v1/embed/{id}`` response: ``f32[hidden]``, no header.
- POST ``/v1/logits`` request: ``f32[hidden]``, the residual before the final norm;
  raw-logits response: ``f32[vocab]``. Many rows (``?rows=N``): ``f32[N * hidden]``, answered
  ``f32[N * vocab]`` (or top-k JSON per row). With ``&masked=i,j,..`` (rows of that request, ascending)
  the residuals are followed by one token bitmask per listed row, ``u32[ceil(vocab / 32)]`` each
  (bit ``t % 32`` of word ``t // 32`` set: token t allowed; the layout of llguidance's and xgrammar's
  bitmasks), applied to the row's logits before top-k (structured output). With ``&extra=i,j,..``
  (rows, ascending) the body ends with one token-id list per listed row, ``u32 n, u32 ids[n]``
  (n <= `MAX_EXTRA_IDS`): the top-k JSON answer then also carries those ids' log-probabilities and
  logits (``"extra"``, one list per row), whatever their rank (larql-serve's ``logit_bias`` and
  penalties that raise a token).

Decoders return numpy views of the body where they can (no copy) and raise `WireError` for any
body whose length disagrees with its header or its element size.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import numpy as np

from larql_edge.wire import WireError

U32 = np.dtype("<u4")
F32 = np.dtype("<f4")
_HEADER_1 = struct.Struct("<I")
_HEADER_2 = struct.Struct("<II")
# POST /v1/logits: the smallest temperature above 0 (greedy); smaller ones only overflow the scaled
# logits (NaN probabilities, Inf logits).
MIN_TEMPERATURE = 1e-3


def _aligned(body: bytes, what: str) -> None:
    if len(body) % 4:
        raise WireError(f"{what}: {len(body)} bytes is not a whole number of 4-byte values")


# -- POST /v1/embed ---------------------------------------------------------------------------------


def encode_embed_request(ids: Sequence[int] | np.ndarray) -> bytes:
    arr = np.asarray(ids, dtype=np.int64)
    if arr.ndim != 1 or (arr.size and (arr.min() < 0 or arr.max() > 0xFFFFFFFF)):
        raise WireError("token ids must be a flat list of u32 values")
    return _HEADER_1.pack(arr.size) + arr.astype(U32).tobytes()


def decode_embed_request(body: bytes) -> np.ndarray:
    """``u32 n, u32 ids[n]`` -> ``uint32[n]`` (n may be 0; the caller decides whether that is allowed)."""
    if len(body) < 4:
        raise WireError(f"embed request: {len(body)} bytes, need at least the 4-byte count")
    _aligned(body, "embed request")
    (n,) = _HEADER_1.unpack_from(body)
    if len(body) != 4 + 4 * n:
        raise WireError(f"embed request: header says {n} ids ({4 + 4 * n} bytes), body has {len(body)} bytes")
    return np.frombuffer(body, dtype=U32, offset=4, count=n)


def encode_embed_response(rows: np.ndarray) -> bytes:
    rows = np.asarray(rows, dtype=F32)
    if rows.ndim != 2:
        raise WireError("embed response rows must be [seq_len, hidden]")
    return _HEADER_2.pack(*rows.shape) + rows.tobytes()


def encode_embed_response_parts(seq_len: int, hidden: int, parts: Sequence[bytes]) -> bytes:
    """Same framing from ready-made row bytes (the hot cache keeps rows already encoded)."""
    return b"".join((_HEADER_2.pack(seq_len, hidden), *parts))


def decode_embed_response(body: bytes) -> np.ndarray:
    if len(body) < 8:
        raise WireError(f"embed response: {len(body)} bytes, need the 8-byte header")
    _aligned(body, "embed response")
    seq, hidden = _HEADER_2.unpack_from(body)
    if len(body) != 8 + 4 * seq * hidden:
        raise WireError(f"embed response: header says {seq}x{hidden} values, body has {len(body) - 8} bytes")
    return np.frombuffer(body, dtype=F32, offset=8).reshape(seq, hidden)


# -- GET /v1/embed/{id} -----------------------------------------------------------------------------


def encode_row(row: np.ndarray) -> bytes:
    return np.ascontiguousarray(row, dtype=F32).tobytes()


def decode_row(body: bytes, hidden: int | None = None) -> np.ndarray:
    _aligned(body, "embedding row")
    if hidden is not None and len(body) != 4 * hidden:
        raise WireError(f"embedding row: {len(body)} bytes, expected {4 * hidden} (hidden {hidden})")
    return np.frombuffer(body, dtype=F32)


# -- POST /v1/logits ---------------------------------------------------------------------------------


def encode_logits_request(residual: np.ndarray) -> bytes:
    r = np.asarray(residual, dtype=F32)
    if r.ndim != 1:
        raise WireError("logits request: the residual is one position, a flat f32[hidden]")
    return r.tobytes()


def decode_logits_request(body: bytes, hidden: int) -> np.ndarray:
    _aligned(body, "logits request")
    if len(body) != 4 * hidden:
        raise WireError(f"logits request: {len(body) // 4} values, expected hidden size {hidden}")
    return np.frombuffer(body, dtype=F32)


def encode_logits_rows_request(rows: np.ndarray) -> bytes:
    r = np.asarray(rows, dtype=F32)
    if r.ndim != 2:
        raise WireError("logits rows request: residuals are [rows, hidden]")
    return np.ascontiguousarray(r).tobytes()


def decode_logits_rows_request(body: bytes, rows: int, hidden: int) -> np.ndarray:
    _aligned(body, "logits rows request")
    if len(body) != 4 * rows * hidden:
        raise WireError(f"logits rows request: {len(body) // 4} values, expected {rows} rows x hidden size {hidden}")
    return np.frombuffer(body, dtype=F32).reshape(rows, hidden)


def mask_words(vocab: int) -> int:
    """u32 words of one token bitmask (8192, 32 KB, for a 262,144-token vocabulary)."""
    return (vocab + 31) // 32


def encode_logits_masked_rows_request(rows: np.ndarray, masks: np.ndarray) -> bytes:
    """Residuals, then the bitmasks (``[m, words]`` of 32-bit words) of the rows named by ``?masked=``."""
    m = np.asarray(masks)
    if m.ndim != 2 or m.dtype.itemsize != 4 or m.dtype.kind not in "iu":
        raise WireError("token masks are [rows, words] of 32-bit words")
    return encode_logits_rows_request(rows) + np.ascontiguousarray(m).view(U32).astype(U32, copy=False).tobytes()


MAX_EXTRA_IDS = 1024  # ids per row of ?extra=: a longer list is cheaper as the whole row (raw logits)


def encode_extra_ids(lists: Sequence[Sequence[int] | np.ndarray]) -> bytes:
    """The ``?extra=`` section: ``u32 n, u32 ids[n]`` per listed row, in the order the rows are listed."""
    out = []
    for ids in lists:
        a = np.asarray(ids, dtype=np.int64).reshape(-1)
        if a.size > MAX_EXTRA_IDS or (a.size and (a.min() < 0 or a.max() > 0xFFFFFFFF)):
            raise WireError(f"extra ids: at most {MAX_EXTRA_IDS} u32 token ids per row")
        out += [_HEADER_1.pack(a.size), a.astype(U32).tobytes()]
    return b"".join(out)


def decode_logits_rows_sections(body: bytes, rows: int, hidden: int, masked: int, extra: int,
                                vocab: int) -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:
    """A many-rows body with its optional sections -> (``f32[rows, hidden]`` residuals, ``u32[masked,
    words]`` bitmasks, ``extra`` arrays of token ids (each < vocab, at most `MAX_EXTRA_IDS`))."""
    _aligned(body, "logits rows request")
    words = mask_words(vocab)
    fixed = 4 * (rows * hidden + masked * words)
    what = f"{rows} rows x hidden size {hidden} f32" + (f", {masked} token masks of {words} u32 words" if masked else "")
    if len(body) < fixed or (not extra and len(body) != fixed):
        raise WireError(f"logits rows request: {len(body)} bytes, expected {what} ({fixed} bytes)"
                        + (" and the extra ids" if extra else ""))
    x = np.frombuffer(body, dtype=F32, count=rows * hidden).reshape(rows, hidden)
    bits = np.frombuffer(body, dtype=U32, offset=4 * rows * hidden, count=masked * words).reshape(masked, words)
    lists: list[np.ndarray] = []
    at = fixed
    for i in range(extra):
        if len(body) < at + 4:
            raise WireError(f"logits rows request: the extra ids end after {i} of {extra} lists")
        (n,) = _HEADER_1.unpack_from(body, at)
        if n > MAX_EXTRA_IDS:
            raise WireError(f"logits rows request: extra list {i} holds {n} ids, at most {MAX_EXTRA_IDS}")
        if len(body) < at + 4 + 4 * n:
            raise WireError(f"logits rows request: extra list {i} says {n} ids, the body ends first")
        ids = np.frombuffer(body, dtype=U32, offset=at + 4, count=n)
        if n and int(ids.max()) >= vocab:
            raise WireError(f"logits rows request: extra list {i} names token {int(ids.max())}, vocabulary is {vocab}")
        lists.append(ids)
        at += 4 + 4 * n
    if at != len(body):
        raise WireError(f"logits rows request: {len(body) - at} bytes after the {extra} extra id lists")
    return x, bits, lists


def allowed_tokens(masks: np.ndarray, vocab: int) -> np.ndarray:
    """Bitmasks ``[m, words]`` -> booleans ``[m, vocab]`` (bits beyond the vocabulary ignored)."""
    m = np.ascontiguousarray(masks).view(np.uint8)
    return np.unpackbits(m, axis=-1, bitorder="little")[..., :vocab].view(bool)  # 0/1 bytes: a view, no copy


def encode_logits_response(logits: np.ndarray) -> bytes:
    return np.ascontiguousarray(logits, dtype=F32).tobytes()


def decode_logits_response(body: bytes, vocab: int | None = None) -> np.ndarray:
    _aligned(body, "logits response")
    if vocab is not None and len(body) != 4 * vocab:
        raise WireError(f"logits response: {len(body) // 4} values, expected vocab size {vocab}")
    return np.frombuffer(body, dtype=F32)
