"""The FFN wire codec: round trips (single, batch, f32, f16, JSON) and exact rejection of bad frames."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from larql_edge.wire import WireError
from larql_edge.wire import ffn as w

H = 8
rng = np.random.default_rng(0)
X = rng.standard_normal((3, H)).astype(np.float32)


def test_single_request_round_trip_and_layout():
    body = w.encode_request(5, X)
    assert body[:16] == struct.pack("<IIII", 5, 3, 1, 0)  # layer, seq_len, flags (full_output), top_k
    assert len(body) == 16 + X.nbytes
    req = w.decode_request(body, H)
    assert req.layers == (5,) and not req.batch and req.full_output and req.top_k == 0
    np.testing.assert_array_equal(req.x, X)


def test_batch_request_round_trip_and_layout():
    body = w.encode_request([3, 1, 3], X)
    assert body[:20] == struct.pack("<IIIII", 0xFFFFFFFF, 3, 3, 1, 3)
    req = w.decode_request(body, H)
    assert req.batch and req.layers == (3, 1, 3)
    np.testing.assert_array_equal(req.x, X)
    # A one-layer batch is still a batch.
    assert w.decode_request(w.encode_request([2], X), H).batch


def test_flags_and_top_k_travel():
    req = w.decode_request(w.encode_request(0, X, full_output=False, top_k=7), H)
    assert not req.full_output and req.top_k == 7


@pytest.mark.parametrize("f16", [False, True])
def test_single_response_round_trip(f16):
    body = w.encode_response(4, X, 1.5, f16)
    assert len(body) == 12 + X.size * (2 if f16 else 4)
    layer, out, ms = w.decode_response(body, H, f16)
    assert layer == 4 and ms == pytest.approx(1.5)
    if f16:
        np.testing.assert_allclose(out, X, rtol=1e-3, atol=1e-3)
    else:
        np.testing.assert_array_equal(out, X)


@pytest.mark.parametrize("f16", [False, True])
def test_batch_response_round_trip(f16):
    results = [(2, X), (7, X * 2)]
    body = w.encode_batch_response(results, 3.25, f16)
    assert struct.unpack_from("<IIf", body) == (0xFFFFFFFF, 2, 3.25)
    assert struct.unpack_from("<III", body, 12) == (2, 3, X.size)  # layer, seq_len, n
    got, ms = w.decode_batch_response(body, H, f16)
    assert [g[0] for g in got] == [2, 7] and ms == pytest.approx(3.25)
    tol = 1e-2 if f16 else 0
    np.testing.assert_allclose(got[1][1], X * 2, atol=tol, rtol=tol)


def test_router_reframing_is_byte_exact():
    """Splitting a batch request and re-framing replies loses nothing (what the router does)."""
    body = w.encode_request([0, 1, 2], X)
    layers, tail = w.split_batch_request(body)
    assert layers == (0, 1, 2)
    assert w.batch_request_from_tail([1], tail) == w.encode_request([1], X)
    reply = w.encode_batch_response([(0, X), (1, X + 1)], 0.0)
    items = list(w.iter_batch_items(reply))
    assert w.frame_batch(items, 0.0) == reply


def test_wants_f16():
    assert w.wants_f16("application/x-larql-ffn-f16")
    assert w.wants_f16("application/json, application/x-larql-ffn-f16;q=0.9")
    assert not w.wants_f16("application/x-larql-ffn")
    assert not w.wants_f16(None)


@pytest.mark.parametrize(
    "body, what",
    [
        (b"", "shorter"),
        (b"\x00\x00", "shorter"),
        (struct.pack("<II", 0, 1), "header"),
        (struct.pack("<IIII", 0, 0, 1, 0), "seq_len is 0"),
        (struct.pack("<IIII", 0, 2, 1, 0) + b"\x00" * (H * 4), "expected"),  # too few values
        (struct.pack("<IIII", 0, 1, 1, 0) + b"\x00" * (H * 4 + 1), "expected"),  # trailing byte
        (struct.pack("<II", 0xFFFFFFFF, 0), "no layers"),
        (struct.pack("<II", 0xFFFFFFFF, 10**6), "layers"),
        (struct.pack("<III", 0xFFFFFFFF, 3, 1), "inside"),
        (struct.pack("<IIIII", 0xFFFFFFFF, 1, 0, 1, 1) + b"\x00" * 4, "expected"),
        (struct.pack("<IIII", 0xFFFFFFFF, 1, 0, 1), "header"),
    ],
)
def test_bad_requests_raise_wire_error(body, what):
    with pytest.raises(WireError, match=what):
        w.decode_request(body, H)


def test_bad_replies_raise_wire_error():
    good = w.encode_response(1, X, 0.0)
    with pytest.raises(WireError):
        w.decode_response(good[:-1], H)
    with pytest.raises(WireError):
        w.decode_response(good[:5], H)
    batch = w.encode_batch_response([(1, X)], 0.0)
    with pytest.raises(WireError):
        w.decode_response(batch, H)
    with pytest.raises(WireError):
        w.decode_batch_response(batch[:-4])
    with pytest.raises(WireError):
        w.decode_batch_response(batch + b"\x00")
    with pytest.raises(WireError):
        w.decode_batch_response(good)
    with pytest.raises(WireError):
        w.decode_batch_response(batch, hidden=H + 1)


def test_json_round_trip():
    req = w.request_from_json(w.request_to_json([1, 2], X), H)
    assert req.batch and req.layers == (1, 2)
    np.testing.assert_array_equal(req.x, X)
    flat = {"layer": 3, "residual": X.ravel().tolist(), "seq_len": 3}
    assert w.request_from_json(flat, H).x.shape == (3, H)
    single = w.response_to_json([(3, X)], 1.0, batch=False)
    assert single["layer"] == 3 and single["seq_len"] == 3 and len(single["output"]) == 3
    many = w.response_to_json([(1, X), (2, X)], 1.0, batch=True)
    assert [r["layer"] for r in many["results"]] == [1, 2]


@pytest.mark.parametrize(
    "obj",
    [
        [],
        {},
        {"layer": 1},
        {"layer": 1, "layers": [1], "residual": [[0.0] * H]},
        {"layer": -1, "residual": [[0.0] * H]},
        {"layer": True, "residual": [[0.0] * H]},
        {"layer": "1", "residual": [[0.0] * H]},
        {"layers": [], "residual": [[0.0] * H]},
        {"layers": [1, "x"], "residual": [[0.0] * H]},
        {"layer": 1, "residual": [[0.0] * (H - 1)]},
        {"layer": 1, "residual": [[]]},
        {"layer": 1, "residual": "abc"},
        {"layer": 1, "residual": [["a"] * H]},
        {"layer": 1, "residual": [[float("nan")] * H]},
        {"layer": 1, "residual": [0.0] * (H + 1)},
        {"layer": 1, "residual": [[0.0] * H], "full_output": "yes"},
        {"layer": 1, "residual": [[0.0] * H], "top_k": -1},
    ],
)
def test_bad_json_raises_wire_error(obj):
    with pytest.raises(WireError):
        w.request_from_json(obj, H)


@pytest.mark.parametrize("f16", [False, True])
def test_reply_buffer_is_the_encoded_reply(f16):
    """A shard computes into `reply_buffer`'s views; the bytes are then what the encoders write."""
    rng = np.random.default_rng(4)
    a, b = (rng.standard_normal((3, 8)).astype(np.float32) for _ in range(2))
    buf, (va,) = w.reply_buffer([5], 3, 8, batch=False, f16=f16)
    va[...] = a
    w.set_latency(buf, 1.5)
    assert bytes(buf) == w.encode_response(5, a, 1.5, f16)
    buf, views = w.reply_buffer([2, 7], 3, 8, batch=True, f16=f16)
    views[0][...], views[1][...] = a, b
    w.set_latency(buf, 2.25)
    assert bytes(buf) == w.encode_batch_response([(2, a), (7, b)], 2.25, f16)
    with pytest.raises(WireError):
        w.reply_buffer([1, 2], 3, 8, batch=False)
