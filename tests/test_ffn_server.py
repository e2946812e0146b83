"""The FFN shard over HTTP, in-process (tiny model): exact replies, every form, every bad input, the work bounds."""

from __future__ import annotations

import json
import shutil
import struct

import httpx
import numpy as np
import pytest

from larql_edge.errors import VindexError
from larql_edge.format.vindex import Vindex
from larql_edge.model.forward import LocalFfn
from larql_edge.model.spec import ModelSpec
from larql_edge.wire import ffn as w
from tests import _inproc as inproc
from tests._cli import run_cli

H = 32  # the tiny models' hidden size
X = np.random.default_rng(3).standard_normal((4, H)).astype(np.float32)
BIN = {"content-type": w.CONTENT_TYPE}


@pytest.fixture(scope="module")
def shard(tiny_models):
    with inproc.shard(tiny_models["gemma3"], "1-1", max_rows=256, max_reply_bytes=64 * H * 4) as s:
        yield s


@pytest.fixture(scope="module")
def reference(tiny_models):
    vx = Vindex.open(tiny_models["gemma3"])
    return LocalFfn(vx, ModelSpec.from_index(vx.index))


def post(url, content=None, headers=None, **kw):
    return httpx.post(url + "/v1/walk-ffn", content=content, headers=headers, timeout=10, **kw)


def test_single_binary_is_exactly_the_local_ffn(shard, reference):
    r = post(shard.url, w.encode_request(1, X), BIN)
    assert r.status_code == 200 and r.headers["content-type"] == w.CONTENT_TYPE
    layer, out, ms = w.decode_response(r.content, H)
    assert layer == 1 and ms >= 0
    np.testing.assert_array_equal(out, reference.ffn(1, X))


@pytest.mark.parametrize("rows", [1, 5, 17])
def test_inline_and_compute_thread_routes_are_exact(shard, reference, rows):
    """Up to INLINE_ROWS rows x layers are computed in the event loop, more in the compute thread:
    the same bytes either way."""
    from larql_edge.roles.ffn.routes import INLINE_ROWS

    assert 1 <= INLINE_ROWS < 5
    x = np.random.default_rng(rows).standard_normal((rows, H)).astype(np.float32)
    r = post(shard.url, w.encode_request(1, x), BIN)
    assert r.status_code == 200
    np.testing.assert_array_equal(w.decode_response(r.content, H)[1], reference.ffn(1, x))


def test_batch_binary(shard, reference):
    r = post(shard.url, w.encode_request([1], X), BIN)
    assert r.status_code == 200
    results, _ = w.decode_batch_response(r.content, H)
    assert [layer for layer, _ in results] == [1]
    np.testing.assert_array_equal(results[0][1], reference.ffn(1, X))


def test_work_bounds_are_published_and_enforced_before_work(shard):
    """No repeated layers, at most max_rows positions, at most max_reply_bytes of reply (#14)."""
    limits = httpx.get(shard.url + "/v1/stats").json()["limits"]
    assert limits["max_rows"] == 256 and limits["max_layers_per_request"] == 1 and limits["repeated_layers"] is False
    assert limits["max_rows_x_layers"] == 64
    r = post(shard.url, w.encode_request([1, 1], X), BIN)
    assert r.status_code == 400 and "more than once" in r.json()["error"]
    r = post(shard.url, w.encode_request(1, np.zeros((65, H), np.float32)), BIN)  # a reply over max_reply_bytes
    assert r.status_code == 413 and "reply" in r.json()["error"]
    r = post(shard.url, w.encode_request(1, np.zeros((257, H), np.float32)), BIN)  # over max_body_bytes: refused unread
    assert r.status_code == 413 and set(r.json()) == {"error"}
    # One listed layer 4,096 times is refused from its 16 KB header, before any product.
    r = post(shard.url, struct.pack("<II", 0xFFFFFFFF, 4096) + struct.pack("<I", 1) * 4096
             + struct.pack("<III", 1, 1, 0) + X[:1].tobytes(), BIN)
    assert r.status_code == 400
    r = post(shard.url, b"\0" * (limits["max_body_bytes"] + 1), BIN)
    assert r.status_code == 413


def test_missing_content_type_is_binary(shard, reference):
    r = httpx.post(shard.url + "/v1/walk-ffn", content=w.encode_request(1, X), headers={"content-type": ""})
    assert r.status_code == 200
    np.testing.assert_array_equal(w.decode_response(r.content, H)[1], reference.ffn(1, X))


@pytest.mark.parametrize("residual", [[["1.0"] * H], [[True] * H], [[float("nan")] * H]], ids=["strings", "booleans", "nan"])
def test_json_residual_must_be_finite_numbers(shard, residual):
    body = json.dumps({"layer": 1, "residual": residual}).encode()
    r = post(shard.url, body, {"content-type": "application/json"})
    assert r.status_code == 400 and set(r.json()) == {"error"}


def test_binary_nan_is_refused(shard):
    x = X.copy()
    x[0, 3] = np.nan
    r = post(shard.url, w.encode_request(1, x), BIN)
    assert r.status_code == 400 and "NaN" in r.json()["error"]


@pytest.mark.parametrize("depth", [40, 2_000])
def test_deeply_nested_json_is_a_400(shard, depth):
    r = post(shard.url, b"[" * depth + b"]" * depth, {"content-type": "application/json"})
    assert r.status_code == 400 and "nested" in r.json()["error"]


def test_f16_reply_on_accept(shard, reference):
    r = post(shard.url, w.encode_request(1, X), {**BIN, "accept": w.CONTENT_TYPE_F16})
    assert r.headers["content-type"] == w.CONTENT_TYPE_F16
    assert len(r.content) == 12 + X.size * 2
    _, out, _ = w.decode_response(r.content, H, f16=True)
    np.testing.assert_allclose(out, reference.ffn(1, X), rtol=2e-3, atol=2e-3)
    r = post(shard.url, w.encode_request([1], X), {**BIN, "accept": w.CONTENT_TYPE_F16})
    results, _ = w.decode_batch_response(r.content, H, f16=True)
    np.testing.assert_allclose(results[0][1], reference.ffn(1, X), rtol=2e-3, atol=2e-3)


def test_json_single_and_batch(shard, reference):
    r = httpx.post(shard.url + "/v1/walk-ffn", json={"layer": 1, "residual": X.tolist()}, timeout=10)
    assert r.status_code == 200
    got = r.json()
    assert got["layer"] == 1 and got["seq_len"] == 4 and "latency_ms" in got
    np.testing.assert_allclose(np.array(got["output"], dtype=np.float32), reference.ffn(1, X), rtol=1e-6, atol=1e-6)
    r = httpx.post(shard.url + "/v1/walk-ffn", json={"layers": [1], "residual": X.ravel().tolist(), "seq_len": 4})
    assert [x["layer"] for x in r.json()["results"]] == [1]


def test_layer_outside_range_is_400_naming_the_range(shard):
    for body in (w.encode_request(0, X), w.encode_request([1, 0], X)):
        r = post(shard.url, body, BIN)
        assert r.status_code == 400
        assert "0" in r.json()["error"] and "1-1" in r.json()["error"]
    r = httpx.post(shard.url + "/v1/walk-ffn", json={"layer": 7, "residual": X.tolist()})
    assert r.status_code == 400 and "1-1" in r.json()["error"]


BAD_BINARY = [
    b"",
    b"\x01\x00",
    struct.pack("<IIII", 1, 0, 1, 0),
    struct.pack("<IIII", 1, 4, 1, 0) + X.tobytes()[:-4],
    struct.pack("<IIII", 1, 4, 1, 0) + X.tobytes() + b"\x00",
    struct.pack("<IIII", 1, 1, 1, 0) + X[:1].astype(np.float64).tobytes(),
    struct.pack("<II", 0xFFFFFFFF, 0) + struct.pack("<III", 1, 1, 0) + X[:1].tobytes(),
    struct.pack("<II", 0xFFFFFFFF, 99999),
    struct.pack("<IIII", 1, 4, 0, 0) + X.tobytes(),  # full_output=0: not served
]


@pytest.mark.parametrize("body", BAD_BINARY, ids=range(len(BAD_BINARY)))
def test_bad_binary_inputs_get_4xx_error_envelope(shard, body):
    r = post(shard.url, body, BIN)
    assert 400 <= r.status_code < 500, r.text
    assert set(r.json()) == {"error"} and r.json()["error"]


@pytest.mark.parametrize(
    "content, ctype, status",
    [
        (b"{not json", "application/json", 400),
        (b"[]", "application/json", 400),
        (json.dumps({"layer": 1}).encode(), "application/json", 400),
        (json.dumps({"layer": 1, "residual": [[1.0] * (H - 1)]}).encode(), "application/json", 400),
        (json.dumps({"layers": "1", "residual": [[1.0] * H]}).encode(), "application/json", 400),
        (b"\xff\xfe", "application/json", 400),
        (b"hello", "text/plain", 415),
    ],
)
def test_bad_json_and_media_types(shard, content, ctype, status):
    r = post(shard.url, content, {"content-type": ctype})
    assert r.status_code == status and set(r.json()) == {"error"}


def test_wrong_method_and_unknown_route(shard):
    r = httpx.get(shard.url + "/v1/walk-ffn")
    assert r.status_code == 405 and "error" in r.json()
    r = httpx.get(shard.url + "/v1/nope")
    assert r.status_code == 404 and "error" in r.json()


def test_stats_health_ready_metrics(shard):
    s = httpx.get(shard.url + "/v1/stats").json()
    assert s["mode"] == "ffn-shard" and s["layers"] == "1-1" and s["hidden_size"] == H
    assert s["num_layers"] == 2 and s["vindex_hash"] and s["memory_mb"] > 0
    assert httpx.get(shard.url + "/v1/health").json() == {"status": "ok"}
    assert httpx.get(shard.url + "/v1/ready").status_code == 200
    before = _layer_count(httpx.get(shard.url + "/metrics").text)
    x = np.random.default_rng(5).standard_normal((2, H)).astype(np.float32)
    for _ in range(3):
        assert post(shard.url, w.encode_request(1, x), {"content-type": w.CONTENT_TYPE}).status_code == 200
    m = httpx.get(shard.url + "/metrics")
    assert m.status_code == 200
    assert "larql_ffn_requests_total" in m.text and "larql_ffn_request_duration_seconds" in m.text
    # the per-layer histogram is batched in Python and flushed before every scrape: nothing is lost
    assert _layer_count(m.text) == before + 3


def _layer_count(text: str) -> float:
    import re

    found = re.search(r'^larql_ffn_layer_duration_seconds_count\{layer="1"\} (\S+)$', text, re.M)
    return float(found.group(1)) if found else 0.0


def _without_layer0_ffn(src, dst):
    """A copy of a vindex whose layer 0 FFN weights are gone (manifest entries and gate rows)."""
    shutil.copytree(src, dst)
    man = json.loads((dst / "weight_manifest.json").read_text())
    man = [e for e in man if not e["key"].startswith("layers.0.mlp.")]
    (dst / "weight_manifest.json").write_text(json.dumps(man))
    index = json.loads((dst / "index.json").read_text())
    index["layers"] = [r for r in index["layers"] if r["layer"] != 0]
    (dst / "index.json").write_text(json.dumps(index))
    return dst


def test_loads_only_its_own_layers(tiny_models, tmp_path):
    from larql_edge.format.layers import LayerRange
    from larql_edge.roles.ffn.shard import Shard

    vx = _without_layer0_ffn(tiny_models["gemma3"], tmp_path / "v")
    s = Shard(vx, LayerRange(1, 1))
    assert sorted(s.ffn.layers) == [1]
    with pytest.raises(VindexError, match="layer 0"):
        Shard(vx, LayerRange(0, 1))


def test_cli_rejects_bad_ranges(tiny_models):
    from larql_edge.roles.ffn.cli import main

    def run(*a):
        return run_cli(main, str(tiny_models["gemma3"]), *a)

    r = run("--layers", "x-y")
    assert r.returncode == 2 and "layer range" in r.stderr
    r = run("--layers", "0-5")
    assert r.returncode == 1 and "outside the model" in r.stderr
    r = run("--layers", "0-1", "--join", "http://127.0.0.1:9")
    assert r.returncode == 2 and "--grid-key" in r.stderr


def test_rows_beyond_a_chunk_into_f32_and_f16_outputs(tiny_models, reference):
    """Shard.compute in ROW_CHUNK pieces, into a float32 or a float16 reply view: the local FFN's values."""
    from larql_edge.roles.ffn.shard import ROW_CHUNK, Shard

    s = Shard(tiny_models["gemma3"], None)
    x = np.random.default_rng(9).standard_normal((ROW_CHUNK + 37, H)).astype(np.float32)
    want = np.concatenate([reference.ffn(1, x[:ROW_CHUNK]), reference.ffn(1, x[ROW_CHUNK:])])
    np.testing.assert_array_equal(s.compute(1, x), want)
    out16 = np.empty((x.shape[0], H), np.float16)
    assert s.compute(1, x, out16) is out16
    np.testing.assert_array_equal(out16, want.astype(np.float16))
