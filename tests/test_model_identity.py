"""One model identity and integrity at serve time (issue 19), in-process on loopback with tiny models.

- every FFN shard and embed server reply carries ``X-Larql-Vindex`` (the vindex it answers from),
  the router passes it on, and it is the ``vindex_hash`` the member announced;
- a shard whose weights are damaged (NaN in a weight file whose index still claims the good
  checksums, so it joins as a replica) answers non-finite values: through the router that is the
  member's failure (fail over, count it), never the caller's error, and alone it is a 503;
- the client refuses to mix two builds for one layer across a generation.
(The router's refusal of a member of another build is in test_router_registry.py.)
"""

from __future__ import annotations

import shutil

import httpx
import numpy as np
import pytest

from larql_edge.errors import RemoteError
from larql_edge.format.layers import LayerRange
from larql_edge.net.h1_sync import HttpClient
from larql_edge.net.remote import RemoteFfn, Replicas, Target
from larql_edge.wire import VINDEX_HEADER
from larql_edge.wire import ffn as w
from tests import _inproc as inproc
from tests._grid import wait_grid

H = 32
X = np.random.default_rng(7).standard_normal((2, H)).astype(np.float32)
BIN = {"content-type": w.CONTENT_TYPE}


@pytest.fixture(scope="module")
def damaged(tiny_models, tmp_path_factory):
    """The tiny gemma3 vindex with NaN in layer 0's down projection; index.json untouched."""
    out = tmp_path_factory.mktemp("damaged") / "gemma3.vindex"
    shutil.copytree(tiny_models["gemma3"], out)
    with open(out / "down_weights.bin", "r+b") as f:
        f.write(np.full(16, np.nan, np.float32).tobytes())
    return out


def walk(url, layer=0):
    return httpx.post(url + "/v1/walk-ffn", content=w.encode_request(layer, X), headers=BIN, timeout=10)


def test_every_reply_names_the_vindex_and_the_router_passes_it_on(tiny_models):
    with inproc.router() as router, inproc.shard(tiny_models["gemma3"], "0-1", join=router.url) as s:
        wait_grid(router.url, members=1)
        announced = httpx.get(s.url + "/v1/stats").json()["vindex_hash"]
        assert announced
        for r in (walk(s.url), walk(router.url), httpx.get(s.url + "/v1/ready"), httpx.get(s.url + "/v1/nowhere")):
            assert r.headers.get(VINDEX_HEADER) == announced, (r.request.url, r.status_code)
        r = httpx.post(router.url + "/v1/walk-ffn", content=w.encode_request([0, 1], X), headers=BIN, timeout=10)
        assert r.status_code == 200 and r.headers[VINDEX_HEADER] == announced


def test_a_damaged_replica_is_failed_over_never_the_callers_error(tiny_models, damaged):
    with inproc.router() as router, inproc.shard(damaged, "0-0", join=router.url) as bad, \
            inproc.shard(tiny_models["gemma3"], "0-0", join=router.url) as good:
        wait_grid(router.url, members=2, complete=False)
        direct = w.decode_response(walk(bad.url).content, H)[1]
        assert not np.isfinite(direct).all()  # the damage is real: the shard itself answers NaN
        for _ in range(6):
            r = walk(router.url)
            assert r.status_code == 200, r.text
            assert np.isfinite(w.decode_response(r.content, H)[1]).all()
        members = {m["url"]: m for m in httpx.get(router.url + "/v1/grid").json()["members"]}
        assert members[bad.url]["failures"] >= 1 and members[good.url]["failures"] == 0
    with inproc.router() as router, inproc.shard(damaged, "0-0", join=router.url):
        wait_grid(router.url, members=1, complete=False)
        r = walk(router.url)
        assert r.status_code == 503 and "non-finite" in r.json()["error"], r.text


def _remote(urls: list[str]) -> RemoteFfn:
    client = HttpClient(timeout=10)
    return RemoteFfn(Replicas(client, retries=2, backoff=0.01), [Target(u, LayerRange(0, 1)) for u in urls], H, 2)


def test_the_client_fails_over_from_a_damaged_replica_and_refuses_to_mix_builds(tiny_models, damaged, tmp_path):
    from larql_edge.tools.slicer.extract import extract

    other = tmp_path / "f16.vindex"  # the same model, another build (f16): another vindex id
    extract(str(tiny_models["gemma3-hf"]), other, dtype="f16", progress=False, log=lambda m: None)
    with inproc.shard(damaged, "0-1") as bad, inproc.shard(tiny_models["gemma3"], "0-1") as good:
        ffn = _remote([bad.url, good.url])
        assert np.isfinite(ffn.ffn(0, X)).all()  # the damaged replica's NaN is its failure: the next one answers
    with inproc.shard(other, "0-1") as f16:
        with inproc.shard(tiny_models["gemma3"], "0-1") as good:
            ffn = _remote([good.url, f16.url])
            ffn.ffn(0, X)
            good_id = ffn.identity[0]
        # the replica that answered so far is gone; what is left for layer 0 is the f16 build
        with pytest.raises(RemoteError, match="refusing to mix"):
            ffn.ffn(0, X)
        assert ffn.identity[0] == good_id
    # the embed tier too: embeddings pinned to the build that first answered
    from larql_edge.net.remote import RemoteEmbed

    with inproc.embed({"gemma3": other}) as f16_embed:
        with inproc.embed({"gemma3": tiny_models["gemma3"]}) as good_embed:
            inproc.wait_ready(f16_embed, good_embed)
            emb = RemoteEmbed(Replicas(HttpClient(timeout=10), retries=2, backoff=0.01),
                              [good_embed.url, f16_embed.url], H)
            assert emb.embed([1, 2]).shape == (2, H)
        with pytest.raises(RemoteError, match="refusing to mix"):
            emb.embed([1, 2])


def test_the_embed_server_never_serves_a_damaged_row_as_immutable(tiny_models, tmp_path):
    """Issue 19 (Medium): a corrupted embedding row went out as NaN under the good file's content-addressed
    URL with a one-year immutable header."""
    vx = tmp_path / "gemma3.vindex"
    shutil.copytree(tiny_models["gemma3"], vx)
    with open(vx / "embeddings.bin", "r+b") as f:
        f.write(np.full(16, np.nan, np.float32).tobytes())  # row 0
    with inproc.embed({"gemma3": vx}) as e:
        inproc.wait_ready(e)
        bad = httpx.get(e.url + "/v1/embed/0")
        assert bad.status_code == 503 and "non-finite" in bad.json()["error"]
        assert "immutable" not in bad.headers.get("cache-control", "") and "etag" not in bad.headers
        good = httpx.get(e.url + "/v1/embed/1")
        assert good.status_code == 200 and "immutable" in good.headers["cache-control"]
        assert good.headers[VINDEX_HEADER]
        r = httpx.post(e.url + "/v1/embed", json={"token_ids": [1, 0]})
        assert r.status_code == 503, r.text
        assert httpx.post(e.url + "/v1/embed", json={"token_ids": [1, 2]}).status_code == 200


def test_verify_weights_refuses_a_damaged_vindex_at_start_and_reports_the_time(tiny_models, damaged, capsys):
    from larql_edge.errors import ChecksumMismatch
    from larql_edge.roles.ffn.cli import main as ffn_main
    from larql_edge.roles.ffn.shard import Shard

    with pytest.raises(ChecksumMismatch, match="down_weights.bin: corrupt"):
        Shard(damaged, LayerRange(0, 0), verify="on")
    assert ffn_main([str(damaged), "--layers", "0-0", "--verify-weights", "auto"]) != 0  # tiny: auto verifies
    err = capsys.readouterr().err
    assert "down_weights.bin: corrupt" in err and "Traceback" not in err
    assert Shard(damaged, LayerRange(0, 0), verify="off").weights.verified is False
    good = Shard(tiny_models["gemma3"], LayerRange(0, 0), verify="auto")
    assert good.weights.verified and good.weights.seconds is not None and good.weights.bytes > 0
    with inproc.embed({"gemma3": tiny_models["gemma3"]}) as e:  # in-process (no CLI): nothing was checked
        inproc.wait_ready(e)
        assert httpx.get(e.url + "/v1/stats").json()["weights_verified"]["verified"] is False
    from larql_edge.roles.embed.cli import main as embed_main

    assert embed_main([str(damaged), "--verify-weights", "on"]) != 0
    assert "down_weights.bin: corrupt" in capsys.readouterr().err


def _q8_embed(vx, cache) -> "inproc.ServerThread":
    from larql_edge.roles.embed.app import create_app
    from larql_edge.roles.embed.config import EmbedConfig, ModelSource
    from larql_edge.testing.servers import ServerThread
    from larql_edge.tools.grid.supervisor import free_port

    port = free_port()
    cfg = EmbedConfig(models=(ModelSource(id="gemma3", path=str(vx)),), port=port, lm_head_cache=str(cache),
                      lm_head_format="q8_0")
    return ServerThread(create_app(cfg), port=port)


def _damage_q8_block(path, token: int, hidden: int = H) -> None:
    """The f16 scale of ``token``'s first Q8_0 block (2 bytes of scale + 32 int8 per block) set to NaN."""
    row_bytes = hidden // 32 * 34
    with open(path, "r+b") as f:
        f.seek(token * row_bytes)
        f.write(np.array([np.nan], np.float16).tobytes())


def test_the_embed_server_never_answers_non_finite_logits(tiny_models, tmp_path):
    """Issue 19: the embedding rows were checked, the logits were not: a damaged lm_head block (a
    quantized block's scale) went out as a 200 with NaN logits (or a NaN-ranked top k), which a sampler
    turns into a wrong token or blames on the caller. Now it is the member's 503 (the router fails over to
    another embed member and cools this one down), damaged while serving or before it started."""
    from larql_edge.wire import embed as ew

    x = np.random.default_rng(3).standard_normal(H).astype(np.float32)
    with _q8_embed(tiny_models["gemma3"], tmp_path / "cache") as good:  # builds the shared Q8_0 copy
        inproc.wait_ready(good)
        lm_head = httpx.get(good.url + "/v1/stats").json()["lm_head"]
        assert lm_head["format"] == "q8_0" and lm_head["storage"] == "mmap (shared copy)", lm_head
        assert httpx.post(good.url + "/v1/logits", json={"residual": x.tolist()}).status_code == 200
    damaged_copy = tmp_path / "damaged"
    shutil.copytree(tmp_path / "cache", damaged_copy)
    _damage_q8_block(lm_head["path"].replace(str(tmp_path / "cache"), str(damaged_copy)), token=3)
    # 1. damaged before the start: said at the warm-up; the embedding rows still serve, the logits are 503s
    with _q8_embed(tiny_models["gemma3"], damaged_copy) as e:
        inproc.wait_ready(e)
        r = httpx.post(e.url + "/v1/logits", json={"residual": x.tolist()})
        assert r.status_code == 503 and "non-finite logits" in r.json()["error"], r.text
        assert httpx.get(e.url + "/v1/embed/3").status_code == 200
    # 2. damaged while serving (the copy is memory-mapped: the file changing under it); through a router
    #    with a good second embed member every answer is the good one's, and only the damaged one failed
    with _q8_embed(tiny_models["gemma3"], tmp_path / "cache") as bad, \
            inproc.embed({"gemma3": tiny_models["gemma3"]}) as good:
        inproc.wait_ready(bad, good)
        for body in ({"residual": x.tolist()}, {"residuals": [x.tolist()] * 2}):
            assert httpx.post(bad.url + "/v1/logits", json=body).status_code == 200
        _damage_q8_block(lm_head["path"], token=3)
        for body in ({"residual": x.tolist()}, {"residuals": [x.tolist()] * 2}):
            r = httpx.post(bad.url + "/v1/logits", json=body)
            assert r.status_code == 503 and "non-finite logits" in r.json()["error"], r.text
        raw = httpx.post(bad.url + "/v1/logits", content=ew.encode_logits_request(x),
                         headers={"content-type": w.CONTENT_TYPE, "accept": w.CONTENT_TYPE})
        assert raw.status_code == 503, raw.status_code
        with inproc.router(static_embed=[bad.url, good.url]) as router:
            wait_grid(router.url, complete=False, embed=2)
            for _ in range(4):
                r = httpx.post(router.url + "/v1/logits", json={"residual": x.tolist()}, timeout=30)
                assert r.status_code == 200, r.text
                assert all(np.isfinite(t["logit"]) for t in r.json()["top_k"])
            members = {m["url"]: m["failures"] for m in httpx.get(router.url + "/v1/grid").json()["members"]}
            assert members[bad.url] >= 1 and members[good.url] == 0, members
