"""Compatibility with LARQL's own vindexes: fixtures written in LARQL's exact layout by an independent
writer (`tests/larql_fixtures.py`, from LARQL's documented formats: float and q4k, tied and untied,
index.json as LARQL's extractor writes it), read by larql-edge and served by every role.

Float fixtures are checked against a reference forward over the source tensors (`tests/tinymodel.py`);
q4k fixtures against the same model through its dequantized blocks (every role must compute exactly
what the local forward computes on the vindex) and, loosely, against the float model.
"""

from __future__ import annotations

import json

import httpx
import numpy as np
import pytest

from larql_edge.format.vindex import Vindex
from larql_edge.model.forward import Transformer
from larql_edge.roles.client._build import build_remote
from larql_edge.wire import embed as ew
from larql_edge.wire import ffn as fw
from tests import _inproc as inproc
from tests._grid import remote_args
from tests.larql_fixtures import make_fixture
from tests.tinymodel import reference_logits

IDS = [2, 4, 5, 6, 7, 8]
CASES = [
    ("gemma3", "none", True, "f32"), ("gemma3", "none", True, "f16"), ("llama", "none", False, "f32"),
    ("gemma3", "q4k", True, "f16"), ("llama", "q4k", False, "f16"),
]


@pytest.fixture(scope="module", params=CASES, ids=[f"{f}-{q}-{'tied' if t else 'untied'}-{d}" for f, q, t, d in CASES])
def fixture(request, tmp_path_factory):
    family, quant, tied, dtype = request.param
    hf, vx = make_fixture(tmp_path_factory.mktemp("larql"), family, quant=quant, tied=tied, dtype=dtype)
    return {"family": family, "quant": quant, "tied": tied, "dtype": dtype, "hf": hf, "vindex": vx}


def test_larql_index_json_is_read_as_larql_wrote_it(fixture):
    vx = Vindex.open(fixture["vindex"])
    raw = json.loads((fixture["vindex"] / "index.json").read_text())
    assert "lm_head_tied" not in raw  # LARQL's writer has no such field: the files say it
    assert vx.tied is fixture["tied"]
    assert vx.quantized is (fixture["quant"] == "q4k")
    assert vx.index.source["larql_version"] and vx.index.source["extracted_at"]
    assert vx.num_layers == raw["num_layers"] and vx.index.model_config is not None


def test_local_forward_on_a_larql_vindex(fixture):
    m = Transformer.local(fixture["vindex"])
    got = m.head.logits(m.forward(IDS))[0]
    want = reference_logits(fixture["hf"], IDS)[0]
    if fixture["quant"] == "q4k":  # 4-6 bit blocks of random weights: close, not equal
        assert np.corrcoef(got, want)[0, 1] > 0.9
    else:
        np.testing.assert_allclose(got, want, atol=1e-4 if fixture["dtype"] == "f32" else 2e-2, rtol=0)


def test_every_role_serves_a_larql_vindex(fixture):
    """Embed server, FFN shard and router from LARQL's files, and the attention-only client through
    them: the grid computes what the local forward computes on the same vindex."""
    v = fixture["vindex"]
    local = Transformer.local(v)
    hidden = Vindex.open(v).hidden_size
    with inproc.grid(v, ["0-0", "1-1"]) as g:
        url = g["router"].url
        # the embed server's row and logits
        row = ew.decode_row(httpx.get(url + "/v1/embed/4").content, hidden)
        np.testing.assert_allclose(row, local.embedder.embed([4])[0], rtol=0, atol=1e-6)
        x = np.random.default_rng(1).standard_normal(hidden).astype(np.float32)
        r = httpx.post(url + "/v1/logits", content=ew.encode_logits_request(x),
                       headers={"content-type": ew_type(), "accept": ew_type()})
        np.testing.assert_allclose(ew.decode_logits_response(r.content), local.head.logits(x[None])[0], atol=1e-4, rtol=0)
        # an FFN shard's layer
        h = np.random.default_rng(2).standard_normal((3, hidden)).astype(np.float32)
        r = httpx.post(url + "/v1/walk-ffn", content=fw.encode_request(1, h), headers={"content-type": fw.CONTENT_TYPE})
        np.testing.assert_allclose(fw.decode_response(r.content, hidden)[1], local.ffn_provider.ffn(1, h), atol=1e-5, rtol=0)
        # the attention-only client through the router
        remote = build_remote(Vindex.open(v), remote_args(ffn=url))
        np.testing.assert_allclose(remote.next_logits(IDS), local.next_logits(IDS), atol=1e-4, rtol=0)


def ew_type() -> str:
    return fw.CONTENT_TYPE


def test_the_router_stats_carry_what_larqls_client_reads(fixture):
    """`larql run --ffn ROUTER` reads hidden_size from /v1/stats ("stats missing hidden_size" before);
    the model fields LARQL's own servers report come along, learned from the members' stats."""
    v = Vindex.open(fixture["vindex"])
    with inproc.grid(fixture["vindex"], ["0-0", "1-1"]) as g:
        s = httpx.get(g["router"].url + "/v1/stats").json()
    assert s["hidden_size"] == v.hidden_size and isinstance(s["hidden_size"], int)
    assert s["layers"] == s["num_layers"] == v.num_layers
    assert s["family"] == fixture["family"] and s["vocab_size"] == v.vocab_size
    assert s["intermediate_size"] == v.index.intermediate_size
