"""larql-router with real shards, in-process on loopback (tiny model): routing, split/merge, Accept, the embed
proxy, membership auth and every bad input to join/heartbeat."""

from __future__ import annotations

import json

import httpx
import numpy as np
import pytest

from larql_edge.format.vindex import Vindex
from larql_edge.model.forward import LocalFfn
from larql_edge.model.spec import ModelSpec
from larql_edge.wire import embed as ew
from larql_edge.wire import ffn as w
from tests import _inproc as inproc
from tests._cli import run_cli
from tests._grid import GRID_KEY, StubEmbed, capture_logs, wait_grid

H = 32
X = np.random.default_rng(5).standard_normal((3, H)).astype(np.float32)
BIN = {"content-type": w.CONTENT_TYPE}
AUTH = {"authorization": f"Bearer {GRID_KEY}"}


@pytest.fixture(scope="module")
def grid(tiny_models):
    """A router with shards for layer 0 and layer 1 (joined), and a stub embed server (static)."""
    with StubEmbed(tiny_models["gemma3"]) as stub, inproc.router(static_embed=[stub.url]) as router, \
            inproc.shard(tiny_models["gemma3"], "0-0", join=router.url) as a, \
            inproc.shard(tiny_models["gemma3"], "1-1", join=router.url) as b:
        wait_grid(router.url, members=3)
        yield {"router": router, "a": a, "b": b, "stub": stub}


@pytest.fixture(scope="module")
def reference(tiny_models):
    vx = Vindex.open(tiny_models["gemma3"])
    return LocalFfn(vx, ModelSpec.from_index(vx.index))


def walk(url, content, headers=None):
    return httpx.post(url + "/v1/walk-ffn", content=content, headers={**BIN, **(headers or {})}, timeout=10)


def test_grid_view(grid):
    v = httpx.get(grid["router"].url + "/v1/grid").json()
    assert v["complete"] and v["gaps"] == [] and v["num_layers"] == 2 and v["embed"] == 1
    ffn = sorted((m["layers"], m["url"]) for m in v["members"] if m["capability"] == "ffn")
    assert ffn == [("0-0", grid["a"].url), ("1-1", grid["b"].url)]
    assert all(m["vindex_hash"] for m in v["members"] if not m["static"])


def test_single_layer_routes_to_its_shard(grid, reference):
    for layer in (0, 1):
        r = walk(grid["router"].url, w.encode_request(layer, X))
        assert r.status_code == 200
        got, out, _ = w.decode_response(r.content, H)
        assert got == layer
        np.testing.assert_array_equal(out, reference.ffn(layer, X))


def test_batch_spanning_shards_is_split_and_merged_in_order(grid, reference):
    layers = [1, 0]
    r = walk(grid["router"].url, w.encode_request(layers, X))
    assert r.status_code == 200 and r.headers["content-type"] == w.CONTENT_TYPE
    results, ms = w.decode_batch_response(r.content, H)
    assert [layer for layer, _ in results] == layers and ms > 0
    for layer, out in results:
        np.testing.assert_array_equal(out, reference.ffn(layer, X))


def test_accept_f16_is_forwarded(grid, reference):
    r = walk(grid["router"].url, w.encode_request([0, 1], X), {"accept": w.CONTENT_TYPE_F16})
    assert r.headers["content-type"] == w.CONTENT_TYPE_F16
    results, _ = w.decode_batch_response(r.content, H, f16=True)
    for layer, out in results:
        np.testing.assert_allclose(out, reference.ffn(layer, X), rtol=2e-3, atol=2e-3)
    r = walk(grid["router"].url, w.encode_request(1, X), {"accept": w.CONTENT_TYPE_F16})
    assert r.headers["content-type"] == w.CONTENT_TYPE_F16 and len(r.content) == 12 + X.size * 2


def test_json_batch_spanning_shards(grid, reference):
    r = httpx.post(grid["router"].url + "/v1/walk-ffn", json={"layers": [1, 0], "residual": X.tolist()}, timeout=10)
    assert r.status_code == 200
    res = r.json()["results"]
    assert [x["layer"] for x in res] == [1, 0]
    np.testing.assert_allclose(np.array(res[0]["output"], np.float32), reference.ffn(1, X), atol=1e-6)
    r = httpx.post(grid["router"].url + "/v1/walk-ffn", json={"layer": 0, "residual": X.tolist()}, timeout=10)
    assert r.json()["layer"] == 0


def test_layer_outside_the_model_is_400(grid):
    r = walk(grid["router"].url, w.encode_request(7, X))
    assert r.status_code == 400 and "0-1" in r.json()["error"]


@pytest.mark.parametrize(
    "content, ctype, status",
    [
        (b"", w.CONTENT_TYPE, 400),
        (b"\x00\x00\x00", w.CONTENT_TYPE, 400),
        (w.encode_request(0, X)[:-4], w.CONTENT_TYPE, 400),  # the shard checks sizes; the 400 comes back as is
        (w.encode_request([0, 1], X)[:10], w.CONTENT_TYPE, 400),
        (b"\xff\xff\xff\xff\x00\x00\x00\x00", w.CONTENT_TYPE, 400),
        (b"{", "application/json", 400),
        (b'{"layer": 0}', "application/json", 400),
        (b'{"layers": [0, -1], "residual": []}', "application/json", 400),
        (b'{"layer": 0, "layers": [0]}', "application/json", 400),
        (b"x", "text/plain", 415),
    ],
)
def test_bad_walk_inputs_get_4xx(grid, content, ctype, status):
    r = httpx.post(grid["router"].url + "/v1/walk-ffn", content=content, headers={"content-type": ctype}, timeout=10)
    assert r.status_code == status, r.text
    assert set(r.json()) == {"error"}


def test_embed_proxy(grid, tiny_models):
    url = grid["router"].url
    r = httpx.post(url + "/v1/embed", content=ew.encode_embed_request([4, 5]), headers=BIN)
    assert r.status_code == 200
    direct = httpx.post(grid["stub"].url + "/v1/embed", content=ew.encode_embed_request([4, 5]), headers=BIN)
    assert r.content == direct.content
    r = httpx.get(url + "/v1/embed/4")
    assert r.status_code == 200 and r.headers["etag"] == '"row-4"' and len(r.content) == 4 * H
    r = httpx.get(url + "/v1/token/encode", params={"text": "paris"})
    assert r.json() == {"token_ids": [1]} and "GET /v1/token/encode?text=paris" in grid["stub"].requests
    h = np.ones(H, np.float32)
    r = httpx.post(url + "/v1/logits", content=ew.encode_logits_request(h), headers={**BIN, "accept": w.CONTENT_TYPE})
    assert r.status_code == 200 and len(r.content) == 4 * Vindex.open(tiny_models["gemma3"]).vocab_size
    r = httpx.post(url + "/v1/logits", content=b"\x00")
    assert r.status_code == 400 and "error" in r.json()  # the embed server's 4xx comes back unchanged


def test_metrics_and_health(grid):
    url = grid["router"].url
    m = httpx.get(url + "/metrics").text
    assert "larql_router_requests_total" in m and "larql_router_upstream_duration_seconds" in m
    assert "larql_router_members" in m
    assert httpx.get(url + "/v1/health").json() == {"status": "ok"}
    assert httpx.get(url + "/v1/ready").json()["complete"]


def test_heartbeats_carry_load(grid):
    walk(grid["router"].url, w.encode_request(0, X))
    wait = wait_grid(grid["router"].url, members=3)
    import time

    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        a = next(m for m in httpx.get(grid["router"].url + "/v1/grid").json()["members"] if m["url"] == grid["a"].url)
        if a["layer_latency_ms"]:
            break
        time.sleep(0.1)
    assert "0" in a["layer_latency_ms"] and a["rss_mb"] > 0 and wait["complete"]


# -- membership routes ------------------------------------------------------------------------------

JOIN_OK = {"capability": "ffn", "public_url": "http://127.0.0.1:9", "model": "gemma3-hf", "num_layers": 2,
           "hidden_size": 32, "layer_start": 0, "layer_end": 0, "vindex_hash": "x"}


@pytest.mark.parametrize("headers", [{}, {"authorization": "Bearer wrong"}, {"authorization": GRID_KEY},
                                     {"authorization": f"Basic {GRID_KEY}"}])
@pytest.mark.parametrize("path", ["/v1/grid/join", "/v1/grid/heartbeat", "/v1/grid/leave"])
def test_wrong_or_missing_key_is_401(grid, headers, path):
    r = httpx.post(grid["router"].url + path, json=JOIN_OK, headers=headers)
    assert r.status_code == 401 and r.json() == {"error": "grid key refused"}


@pytest.mark.parametrize(
    "path, content, ctype, status",
    [
        ("/v1/grid/join", b"{", "application/json", 400),
        ("/v1/grid/join", b"[]", "application/json", 400),
        ("/v1/grid/join", json.dumps({**JOIN_OK, "capability": "gpu"}).encode(), "application/json", 400),
        ("/v1/grid/join", json.dumps({**JOIN_OK, "layer_end": 5}).encode(), "application/json", 400),
        ("/v1/grid/join", json.dumps({**JOIN_OK, "public_url": "nope"}).encode(), "application/json", 400),
        ("/v1/grid/join", json.dumps({**JOIN_OK, "model": "another"}).encode(), "application/json", 409),
        ("/v1/grid/join", json.dumps({**JOIN_OK, "hidden_size": 64}).encode(), "application/json", 409),
        ("/v1/grid/join", json.dumps(JOIN_OK).encode(), "text/plain", 415),
        ("/v1/grid/heartbeat", b"{}", "application/json", 400),
        ("/v1/grid/heartbeat", b'{"member_id": "nobody"}', "application/json", 404),
        ("/v1/grid/heartbeat", b'{"member_id": "x", "inflight": "many"}', "application/json", 400),
        ("/v1/grid/heartbeat", b'{"member_id": "x", "layer_latency_ms": {"a": 1}}', "application/json", 400),
        ("/v1/grid/leave", b"{}", "application/json", 400),
        ("/v1/grid/leave", b'{"member_id": "nobody"}', "application/json", 404),
    ],
)
def test_bad_membership_inputs_get_4xx(grid, path, content, ctype, status):
    r = httpx.post(grid["router"].url + path, content=content, headers={**AUTH, "content-type": ctype})
    assert r.status_code == status, r.text
    assert set(r.json()) == {"error"}


def test_wrong_key_member_is_refused_and_no_log_shows_a_key(grid, tiny_models, monkeypatch):
    import time

    with capture_logs() as logs, inproc.shard(tiny_models["gemma3"], "0-1", join=grid["router"].url, key="not-the-key-42") as intruder:
        deadline = time.monotonic() + 10
        while "refused the grid key" not in logs.text and time.monotonic() < deadline:
            time.sleep(0.1)
        assert "refused the grid key" in logs.text
        v = httpx.get(grid["router"].url + "/v1/grid").json()
        assert intruder.url not in [m["url"] for m in v["members"]]
    assert GRID_KEY not in logs.text and "not-the-key-42" not in logs.text
    from larql_edge.roles.router.cli import main

    monkeypatch.setenv("LARQL_GRID_KEY", GRID_KEY)
    helptext = run_cli(main, "--help").stdout
    assert GRID_KEY not in helptext and "(set)" in helptext


def test_static_router_reports_gaps_and_refuses_uncovered_layers(grid, tiny_models):
    static = inproc.router(static_ffn=[("0-0", grid["a"].url)]).start()
    wait_grid(static.url, complete=False, members=1)
    import time

    deadline = time.monotonic() + 10
    while httpx.get(static.url + "/v1/grid").json()["num_layers"] is None and time.monotonic() < deadline:
        time.sleep(0.1)  # the static shard's model is learned by probing its /v1/stats
    v = httpx.get(static.url + "/v1/grid").json()
    assert v["gaps"] == ["1-1"] and not v["complete"]
    r = walk(static.url, w.encode_request(1, X))
    assert r.status_code == 503 and "layer 1" in r.json()["error"]
    r = walk(static.url, w.encode_request([0, 1], X))
    assert r.status_code == 503 and "layer 1" in r.json()["error"]
    assert walk(static.url, w.encode_request(0, X)).status_code == 200
    r = httpx.post(static.url + "/v1/embed", content=ew.encode_embed_request([1]), headers=BIN)
    assert r.status_code == 503 and "embed" in r.json()["error"]
    static.stop()


def test_router_requires_a_grid_key():
    from larql_edge.roles.router.cli import main

    r = run_cli(main)
    assert r.returncode == 2 and "--grid-key" in r.stderr
