"""The embed server over HTTP, on tiny vindexes sliced to the ``embed`` preset (the fast tier).

The server runs in-process (real HTTP on loopback from a thread); the expected values come from the
vindex itself (table x embed_scale) and from `larql_edge.model.forward.LocalHead` (final norm,
lm_head, softcap). The multi-worker test runs the console script.
"""

from __future__ import annotations

import asyncio
import fnmatch
import json
import shutil
import struct
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from larql_edge.format.vindex import Vindex
from larql_edge.model import ops
from larql_edge.model.forward import LocalHead
from larql_edge.model.spec import ModelSpec
from larql_edge.testing.servers import running_server
from larql_edge.tools.slicer.slice import slice_vindex
from tests import _inproc as inproc
from tests._cli import run_cli

BIN = "application/x-larql-ffn"
REPO = Path(__file__).resolve().parent.parent


def embed_preset(src: Path, dst: Path) -> Path:
    slice_vindex(src, dst, preset="embed", log=lambda m: None)
    return dst


@pytest.fixture(scope="module")
def presets(tiny_models, tmp_path_factory):
    from larql_edge.tools.slicer.extract import extract

    root = tmp_path_factory.mktemp("embed-presets")
    gemma_f16 = root / "gemma3-f16.vindex"
    extract(str(tiny_models["gemma3-hf"]), gemma_f16, dtype="f16", progress=False, log=lambda m: None)
    return {
        "gemma": embed_preset(gemma_f16, root / "gemma-embed"),  # tied, f16 at rest, softcapped
        "llama": embed_preset(tiny_models["llama"], root / "llama-embed"),  # untied, f32
        "root": root,
    }


@pytest.fixture(scope="module")
def srv(presets):
    with inproc.embed({"gemma": presets["gemma"], "llama": presets["llama"]}, max_tokens=16, max_body=4096,
                      max_top_k=20, batch_wait_ms=20, hot_cache=8, lm_head_cache=presets["root"] / "lm-head") as s:
        inproc.wait_ready(s)
        s.client = httpx.Client(base_url=s.url, timeout=30)
        yield s
        s.client.close()


@pytest.fixture(scope="module")
def ref(presets):
    out = {}
    for mid in ("gemma", "llama"):
        vx = Vindex.open(presets[mid])
        spec = ModelSpec.from_index(vx.index)
        out[mid] = {
            "vx": vx,
            "spec": spec,
            "rows": np.asarray(vx.embeddings(), dtype=np.float32) * np.float32(spec.embed_scale),
            "head": LocalHead(vx, spec),
        }
    return out


def _err(r: httpx.Response, status: int) -> str:
    assert r.status_code == status, (r.status_code, r.text)
    body = r.json()
    assert set(body) == {"error"} and isinstance(body["error"], str) and body["error"]
    return body["error"]


# -- the embed preset ------------------------------------------------------------------------------


def test_serves_from_the_embed_preset_alone(presets, srv):
    from larql_edge.format.presets import PARTS, PRESETS
    from larql_edge.roles.embed.banner import banner

    allowed = [pat for part in PRESETS["embed"] for pat in PARTS[part]] + ["index.json"]
    for mid in ("gemma", "llama"):  # the preset folders hold nothing the slicer's embed preset does not
        names = [p.name for p in presets[mid].iterdir()]
        assert all(any(fnmatch.fnmatch(n, pat) for pat in allowed) for n in names), names
        assert "lm_head.bin" in names  # untied: the real lm_head; tied: the link to embeddings.bin
    r = srv.client.get("/v1/ready").json()
    assert r["status"] == "ready" and r["models"] == ["gemma", "llama"]
    text = banner(srv.app.ctx.cfg, list(srv.app.ctx.registry.models.values()))
    assert "Ready." in text and "Mode:       embed-service" in text


def test_refuses_a_folder_missing_preset_files(presets, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(presets["gemma"], broken)
    (broken / "norms.bin").unlink()
    (broken / "tokenizer.json").unlink()
    from larql_edge.roles.embed.cli import main

    r = run_cli(main, str(broken), "--port", "1")
    assert r.returncode == 2
    assert "tokenizer.json" in r.stderr and "norm" in r.stderr


# -- embeddings ------------------------------------------------------------------------------------


def test_post_embed_json(srv, ref):
    ids = [2, 4, 5, 4]
    r = srv.client.post("/v1/embed", json={"token_ids": ids, "seq_len": 4})
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/json")
    body = r.json()
    assert body["seq_len"] == 4 and body["hidden_size"] == 32 and body["model"] == "gemma"
    np.testing.assert_array_equal(np.array(body["residual"], dtype=np.float32), ref["gemma"]["rows"][ids])


def test_post_embed_binary_and_accept(srv, ref):
    ids = list(range(20))[:16]  # 16 = the published max_tokens of this server
    r = srv.client.post("/v1/embed", content=struct.pack(f"<I{len(ids)}I", len(ids), *ids), headers={"content-type": BIN})
    assert r.status_code == 200 and r.headers["content-type"] == BIN
    seq, hidden = struct.unpack_from("<II", r.content)
    assert (seq, hidden) == (16, 32) and len(r.content) == 8 + 4 * 16 * 32
    got = np.frombuffer(r.content, "<f4", offset=8).reshape(seq, hidden)
    np.testing.assert_array_equal(got, ref["gemma"]["rows"][ids])
    # a JSON request asking for binary gets binary; a binary request asking for JSON gets JSON
    r = srv.client.post("/v1/embed", json={"token_ids": [3]}, headers={"accept": BIN})
    assert r.headers["content-type"] == BIN and len(r.content) == 8 + 4 * 32
    r = srv.client.post("/v1/embed", content=struct.pack("<II", 1, 3), headers={"content-type": BIN, "accept": "application/json"})
    assert r.json()["seq_len"] == 1


def test_get_row_representations(srv, ref):
    want = ref["gemma"]["rows"][7]
    r = srv.client.get("/v1/embed/7")
    assert r.status_code == 200 and r.headers["content-type"] == BIN
    np.testing.assert_array_equal(np.frombuffer(r.content, "<f4"), want)
    for resp in (srv.client.get("/v1/embed/7", headers={"accept": "application/json"}), srv.client.get("/v1/embed/7.json")):
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("application/json")
        body = resp.json()
        assert body["token_id"] == 7 and body["hidden_size"] == 32
        np.testing.assert_array_equal(np.array(body["embedding"], np.float32), want)
    # the untied f32 model through its prefix
    r = srv.client.get("/v1/llama/embed/7")
    np.testing.assert_array_equal(np.frombuffer(r.content, "<f4"), ref["llama"]["rows"][7])


def test_caching_headers_etag_and_304(srv, ref):
    sha = ref["gemma"]["vx"].checksums["embeddings.bin"]
    r = srv.client.get("/v1/gemma/embed/9")
    tag = f'"{sha}-9-bin"'
    assert r.headers["etag"] == tag
    assert r.headers["cache-control"] == "public, max-age=31536000, immutable"
    assert r.headers["vary"] == "Accept"
    j = srv.client.get("/v1/gemma/embed/9.json")
    assert j.headers["etag"] == f'"{sha}-9-json"' != tag
    for inm in (tag, f'"nope", {tag}', f"W/{tag}", "*"):
        r304 = srv.client.get("/v1/gemma/embed/9", headers={"if-none-match": inm})
        assert r304.status_code == 304, inm
        assert r304.content == b""
        for h in ("etag", "cache-control", "vary"):
            assert r304.headers[h] == r.headers[h]
    assert srv.client.get("/v1/gemma/embed/9", headers={"if-none-match": '"other"'}).status_code == 200
    # the JSON tag does not validate the binary representation
    assert srv.client.get("/v1/gemma/embed/9", headers={"if-none-match": j.headers["etag"]}).status_code == 200
    h = srv.client.head("/v1/gemma/embed/9")
    assert h.status_code == 200 and h.content == b"" and h.headers["etag"] == tag
    assert h.headers["content-length"] == str(4 * 32)
    # the unprefixed URL of a multi-model server depends on X-Model-Id too
    assert srv.client.get("/v1/embed/9").headers["vary"] == "Accept, X-Model-Id"


def test_content_addressed_rows(srv, ref):
    for mid in ("gemma", "llama"):
        sha = ref[mid]["vx"].checksums["embeddings.bin"]
        r = srv.client.get(f"/v1/models/{sha}/embed/11")
        assert r.status_code == 200 and r.headers["vary"] == "Accept"
        np.testing.assert_array_equal(np.frombuffer(r.content, "<f4"), ref[mid]["rows"][11])
        assert srv.client.get(f"/v1/models/{sha}/embed/11.json").json()["token_id"] == 11
    _err(srv.client.get("/v1/models/" + "0" * 64 + "/embed/11"), 404)


# -- logits ------------------------------------------------------------------------------------------


def _residual(i: int, hidden: int = 32) -> np.ndarray:
    return (np.random.default_rng(i).standard_normal(hidden) * 3).astype(np.float32)


@pytest.mark.parametrize("mid", ["gemma", "llama"])
def test_logits_json_top_k(srv, ref, mid):
    x = _residual(1)
    want = ref[mid]["head"].logits(x[None])[0]
    lp = ops.log_softmax(want)
    order = np.argsort(-want, kind="stable")[:5]
    r = srv.client.post(f"/v1/{mid}/logits", json={"residual": x.tolist(), "top_k": 5})
    assert r.status_code == 200, r.text
    top = r.json()["top_k"]
    assert [t["token_id"] for t in top] == order.tolist()
    tok = ref[mid]["vx"].tokenizer_path
    from tokenizers import Tokenizer

    tk = Tokenizer.from_file(str(tok))
    for t in top:
        i = t["token_id"]
        assert abs(t["logprob"] - lp[i]) < 1e-4 and abs(t["prob"] - np.exp(lp[i])) < 1e-4
        assert abs(t["logit"] - want[i]) < 1e-4
        assert t["token"] == tk.decode([i], skip_special_tokens=False)
    if mid == "gemma":  # the tiny Gemma has a final softcap of 30
        assert np.abs(want).max() <= 30


def test_logits_binary_request_and_raw_logits(srv, ref):
    x = _residual(2)
    want = ref["llama"]["head"].logits(x[None])[0]
    hdr = {"content-type": BIN, "x-model-id": "llama"}
    r = srv.client.post("/v1/logits?top_k=3", content=x.tobytes(), headers=hdr)
    assert [t["token_id"] for t in r.json()["top_k"]] == np.argsort(-want, kind="stable")[:3].tolist()
    raw = srv.client.post("/v1/logits", content=x.tobytes(), headers={**hdr, "accept": BIN})
    assert raw.headers["content-type"] == BIN and len(raw.content) == 4 * want.size
    np.testing.assert_allclose(np.frombuffer(raw.content, "<f4"), want, atol=1e-4, rtol=1e-5)
    raw_json_req = srv.client.post("/v1/llama/logits", json={"residual": x.tolist()}, headers={"accept": BIN})
    np.testing.assert_allclose(np.frombuffer(raw_json_req.content, "<f4"), want, atol=1e-4, rtol=1e-5)


def test_logits_temperature(srv, ref):
    x = _residual(3)
    want = ref["gemma"]["head"].logits(x[None])[0]
    r = srv.client.post("/v1/logits", json={"residual": x.tolist(), "top_k": 4, "temperature": 2.0}).json()
    lp2 = ops.log_softmax(want / 2.0)
    for t in r["top_k"]:
        assert abs(t["logprob"] - lp2[t["token_id"]]) < 1e-4
    assert r["temperature"] == 2.0 and r["greedy"] is False
    # temperature 0 is greedy: same order, probabilities of temperature 1, raw logits unscaled
    g = srv.client.post("/v1/logits", json={"residual": x.tolist(), "top_k": 4, "temperature": 0}).json()
    assert g["greedy"] is True and g["top_k"][0]["token_id"] == int(np.argmax(want))
    lp1 = ops.log_softmax(want)
    for t in g["top_k"]:
        assert abs(t["logprob"] - lp1[t["token_id"]]) < 1e-4
    raw = srv.client.post("/v1/logits", json={"residual": x.tolist(), "temperature": 0}, headers={"accept": BIN})
    np.testing.assert_allclose(np.frombuffer(raw.content, "<f4"), want, atol=1e-4, rtol=1e-5)
    raw2 = srv.client.post("/v1/logits", json={"residual": x.tolist(), "temperature": 2}, headers={"accept": BIN})
    np.testing.assert_allclose(np.frombuffer(raw2.content, "<f4"), want / 2, atol=1e-4, rtol=1e-5)


def test_concurrent_logits_share_a_product(srv, ref):
    xs = [_residual(100 + i) for i in range(12)]

    async def fire():
        async with httpx.AsyncClient(base_url=srv.url, timeout=30) as c:
            return await asyncio.gather(*(c.post("/v1/gemma/logits", json={"residual": x.tolist(), "top_k": 1}) for x in xs))

    before = srv.client.get("/v1/gemma/stats").json()["logits_batching"]
    outs = asyncio.run(fire())
    after = srv.client.get("/v1/gemma/stats").json()["logits_batching"]
    for x, r in zip(xs, outs, strict=True):
        assert r.json()["top_k"][0]["token_id"] == int(np.argmax(ref["gemma"]["head"].logits(x[None])[0]))
    assert after["rows"] - before["rows"] == 12
    assert after["batches"] - before["batches"] < 12  # some requests shared a product
    assert after["largest_batch"] > 1


def test_logits_rows_with_token_masks(srv, ref):
    """Structured output's form: ``?rows=N&masked=i,j`` appends a bitmask per listed row, applied before top-k."""
    from larql_edge.wire import embed as ew

    vocab = ref["gemma"]["spec"].vocab_size
    xs = np.stack([_residual(200 + i) for i in range(3)])
    want = ref["gemma"]["head"].logits(xs)
    rng = np.random.default_rng(5)
    allowed = rng.random((2, vocab)) < 0.1
    allowed[1, :] = False
    allowed[1, [7, 11, 13]] = True  # fewer allowed tokens than top_k: fewer answered
    bits = np.zeros((2, ew.mask_words(vocab)), dtype=np.uint32)
    for r in range(2):
        for t in np.nonzero(allowed[r])[0]:
            bits[r, t >> 5] |= np.uint32(1 << (t & 31))
    np.testing.assert_array_equal(ew.allowed_tokens(bits, vocab), allowed)
    body = ew.encode_logits_masked_rows_request(xs, bits)
    r = srv.client.post("/v1/gemma/logits?rows=3&top_k=5&masked=0,2", content=body, headers={"content-type": BIN})
    assert r.status_code == 200, r.text
    rows = r.json()["rows"]
    unmasked = srv.client.post("/v1/gemma/logits?rows=3&top_k=5", content=ew.encode_logits_rows_request(xs),
                               headers={"content-type": BIN}).json()["rows"]
    assert rows[1] == unmasked[1]  # the row without a mask is untouched
    for got, row, ok in ((rows[0], want[0], allowed[0]), (rows[2], want[2], allowed[1])):
        masked_row = np.where(ok, row, -np.inf)
        lp = ops.log_softmax(masked_row.astype(np.float64))
        expect = [int(i) for i in np.argsort(-masked_row, kind="stable")[: min(5, int(ok.sum()))]]
        assert [t["token_id"] for t in got] == expect
        for t in got:
            assert abs(t["logprob"] - lp[t["token_id"]]) < 1e-4  # renormalised over the allowed tokens
    assert len(rows[2]) == 3
    raw = srv.client.post("/v1/gemma/logits?rows=3&masked=0,2", content=body, headers={"content-type": BIN, "accept": BIN})
    got = np.frombuffer(raw.content, "<f4").reshape(3, vocab)
    assert np.all(np.isneginf(got[0][~allowed[0]])) and np.all(np.isfinite(got[0][allowed[0]]))
    np.testing.assert_allclose(got[1], want[1], atol=1e-4, rtol=1e-5)
    # every mistake is a 400 naming it
    nothing = bits.copy()
    nothing[1] = 0
    cases = [("rows=3&masked=0,2", ew.encode_logits_masked_rows_request(xs, nothing), "allows no token"),
             ("rows=3&masked=0,2", body[:-4], "token masks"),
             ("rows=3&masked=2,0", body, "ascending"),
             ("rows=3&masked=0,0", body, "ascending"),
             ("rows=3&masked=3", body, "masked"),
             ("rows=3&masked=", body, "masked"),
             ("rows=3&masked=a", body, "masked"),
             ("masked=0", xs[0].tobytes(), "rows=N")]
    for query, content, words in cases:
        assert words in _err(srv.client.post(f"/v1/gemma/logits?{query}", content=content, headers={"content-type": BIN}), 400)
    assert "binary" in _err(srv.client.post("/v1/gemma/logits?masked=0", json={"residuals": xs.tolist()}), 400)


def test_logits_rows_with_extra_ids(srv, ref):
    """``?rows=N&extra=i,j`` ends the body with a token-id list per listed row; the answer's "extra" gives
    those ids' log-probabilities and logits whatever their rank (masked-out ids left out), and every
    other byte of the answer is what the request without them gets."""
    from larql_edge.wire import embed as ew

    vocab = ref["gemma"]["spec"].vocab_size
    xs = np.stack([_residual(300 + i) for i in range(3)])
    want = ref["gemma"]["head"].logits(xs)
    last = [int(np.argsort(want[r])[0]) for r in range(3)]  # each row's least likely token
    lists = [[last[0], 5], [last[2], int(np.argmax(want[2]))]]
    body = ew.encode_logits_rows_request(xs) + ew.encode_extra_ids(lists)
    r = srv.client.post("/v1/gemma/logits?rows=3&top_k=4&extra=0,2", content=body, headers={"content-type": BIN})
    assert r.status_code == 200, r.text
    got = r.json()
    plain = srv.client.post("/v1/gemma/logits?rows=3&top_k=4", content=ew.encode_logits_rows_request(xs),
                            headers={"content-type": BIN}).json()
    assert got["rows"] == plain["rows"] and "extra" not in plain
    assert [[t["token_id"] for t in e] for e in got["extra"]] == [lists[0], [], lists[1]]
    for e, row in zip(got["extra"], want, strict=True):
        lp = ops.log_softmax(row.astype(np.float64))
        for t in e:
            assert abs(t["logprob"] - lp[t["token_id"]]) < 1e-4 and abs(t["logit"] - row[t["token_id"]]) < 1e-4
    # with a mask: a disallowed id is left out
    bits = np.zeros((1, ew.mask_words(vocab)), dtype=np.uint32)
    bits[0, 0] = 0b111000  # tokens 3, 4, 5
    both = ew.encode_logits_masked_rows_request(xs, bits) + ew.encode_extra_ids([[5, 7]])
    m = srv.client.post("/v1/gemma/logits?rows=3&top_k=2&masked=1&extra=1", content=both, headers={"content-type": BIN})
    assert m.status_code == 200, m.text
    assert [t["token_id"] for t in m.json()["extra"][1]] == [5]
    # every mistake is a 400 naming it
    too_many = ew.encode_logits_rows_request(xs) + np.uint32(ew.MAX_EXTRA_IDS + 1).tobytes()  # refused on the count
    cases = [("rows=3&extra=0,2", body[:-4], "extra"),
             ("rows=3&extra=0,2", body + b"\0\0\0\0", "after"),
             ("rows=3&extra=0", too_many, "at most"),
             ("rows=3&extra=0", ew.encode_logits_rows_request(xs) + ew.encode_extra_ids([[vocab]]), "vocabulary"),
             ("rows=3&extra=2,0", body, "ascending"),
             ("rows=3&extra=3", body, "extra"),
             ("extra=0", xs[0].tobytes(), "rows=N")]
    for query, content, words in cases:
        assert words in _err(srv.client.post(f"/v1/gemma/logits?{query}", content=content, headers={"content-type": BIN}), 400)
    raw = srv.client.post("/v1/gemma/logits?rows=3&extra=0,2", content=body, headers={"content-type": BIN, "accept": BIN})
    assert "raw logits" in _err(raw, 400)
    assert "binary" in _err(srv.client.post("/v1/gemma/logits?extra=0", json={"residuals": xs.tolist()}), 400)


# -- tokenizer ---------------------------------------------------------------------------------------


def test_tokens(srv):
    r = srv.client.get("/v1/token/encode", params={"text": "the capital of france"}).json()
    assert r["text"] == "the capital of france" and len(r["token_ids"]) == 4
    with_bos = srv.client.get("/v1/token/encode", params={"text": "paris", "add_special_tokens": "true"}).json()
    assert with_bos["token_ids"][0] == 2  # the tiny Gemma's BOS
    ids = ",".join(map(str, r["token_ids"]))
    assert srv.client.get(f"/v1/token/decode?ids={ids}").json()["text"] == "the capital of france"
    batch = srv.client.post("/v1/token/encode", json={"texts": ["paris", "the city"]}).json()
    assert [len(t) for t in batch["token_ids"]] == [1, 2]
    dec = srv.client.post("/v1/token/decode", json={"ids": batch["token_ids"]}).json()
    assert dec["texts"] == ["paris", "the city"]
    assert srv.client.post("/v1/llama/token/decode", json={"ids": r["token_ids"]}).json()["text"] == "the capital of france"


# -- service ------------------------------------------------------------------------------------------


def test_stats(srv, ref):
    s = srv.client.get("/v1/stats").json()
    for k in ("model", "hidden_size", "vocab_size", "embed_size_gb", "lm_head_tied", "mode", "loaded", "memory_mb"):
        assert k in s, k
    assert s["model_id"] == "gemma" and s["mode"] == "embed-service" and s["lm_head_tied"] is True
    assert s["loaded"] == {"embeddings": True, "lm_head": True, "tokenizer": True}
    assert s["embeddings"]["dtype"] == "f16" and s["lm_head"]["format"] == "f16" and s["lm_head"]["storage"] == "mmap (vindex)"
    assert s["limits"] == {
        "max_tokens_per_request": 16, "max_body_bytes": 4096, "max_top_k": 20,
        "max_text_chars": 100_000, "batch_wait_ms": 20.0, "max_batch": 64,
    }  # fmt: skip
    assert {"capacity", "size", "hits", "misses", "hit_rate"} <= set(s["hot_cache"]) and s["hot_cache"]["capacity"] == 8
    ls = srv.client.get("/v1/llama/stats").json()
    assert ls["lm_head_tied"] is False and ls["embeddings"]["dtype"] == "f32"
    assert ls["lm_head"]["format"] == "f32" and ls["lm_head"]["storage"] == "mmap (vindex)"
    assert srv.client.get("/v1/stats", headers={"x-model-id": "llama"}).json()["model_id"] == "llama"
    assert srv.client.get("/v1/health").json() == {"status": "ok"}


def test_models_and_routing(srv, ref):
    m = srv.client.get("/v1/models").json()
    assert m["default"] == "gemma" and [x["id"] for x in m["models"]] == ["gemma", "llama"]
    sha = ref["llama"]["vx"].checksums["embeddings.bin"]
    assert m["models"][1]["embeddings_sha256"] == sha and m["models"][1]["embed_url"] == f"/v1/models/{sha}/embed/{{id}}"
    row = lambda r: np.frombuffer(r.content, "<f4")  # noqa: E731
    np.testing.assert_array_equal(row(srv.client.get("/v1/embed/5")), ref["gemma"]["rows"][5])
    np.testing.assert_array_equal(row(srv.client.get("/v1/embed/5", headers={"x-model-id": "llama"})), ref["llama"]["rows"][5])
    np.testing.assert_array_equal(row(srv.client.get("/v1/llama/embed/5")), ref["llama"]["rows"][5])
    # the path wins over the header
    np.testing.assert_array_equal(row(srv.client.get("/v1/gemma/embed/5", headers={"x-model-id": "llama"})), ref["gemma"]["rows"][5])
    r = srv.client.post("/v1/embed", json={"token_ids": [5]}, headers={"x-model-id": "llama"})
    np.testing.assert_array_equal(np.array(r.json()["residual"][0], np.float32), ref["llama"]["rows"][5])
    assert "unknown model" in _err(srv.client.get("/v1/nope/embed/5"), 404)
    _err(srv.client.post("/v1/embed", json={"token_ids": [5]}, headers={"x-model-id": "nope"}), 404)
    _err(srv.client.post("/v1/nope/logits", json={"residual": [0.0] * 32}), 404)
    _err(srv.client.get("/v1/nope/stats"), 404)


def test_openapi_is_served_committed_and_complete(srv):
    served = srv.client.get("/openapi.json").json()
    committed = json.loads((REPO / "openapi" / "embed.json").read_text())
    assert served == committed, "regenerate: python -m larql_edge.roles.embed.openapi > openapi/embed.json"
    from larql_edge.roles.embed.openapi import openapi_spec

    assert openapi_spec() == committed
    documented = {p.replace("{", "<").replace("}", ">") for p in committed["paths"]}
    # every route the server answers is described (path params normalised to <name>)
    expected = {
        "/v1/embed", "/v1/<model_id>/embed", "/v1/embed/<token>", "/v1/<model_id>/embed/<token>",
        "/v1/models/<sha>/embed/<token>", "/v1/logits", "/v1/<model_id>/logits", "/v1/token/encode",
        "/v1/<model_id>/token/encode", "/v1/token/decode", "/v1/<model_id>/token/decode", "/v1/stats",
        "/v1/<model_id>/stats", "/v1/models", "/v1/health", "/v1/ready", "/metrics", "/openapi.json",
        "/v1/membership/leave",  # a grid member's (with --join)
    }  # fmt: skip
    assert documented == expected


def test_app_routes_match_the_openapi_paths(presets):

    from larql_edge.roles.embed.app import create_app
    from larql_edge.roles.embed.config import EmbedConfig, ModelSource
    from larql_edge.roles.embed.openapi import openapi_spec

    app = create_app(EmbedConfig(models=(ModelSource("gemma", str(presets["gemma"])),)))
    app.router.finalize()
    routes = {"/" + r.path for r in app.router.routes}
    normalise = lambda p: p.replace(":str", "")  # noqa: E731
    documented = {p.replace("{", "<").replace("}", ">") for p in openapi_spec()["paths"]}
    assert {normalise(r) for r in routes} == documented - {"/v1/membership/leave"}  # not a grid member


# -- bad input ----------------------------------------------------------------------------------------

J = {"content-type": "application/json"}
B = {"content-type": BIN}
BAD = [
    ("GET", "/v1/embed/99999", {}, 404),
    ("GET", "/v1/embed/-1", {}, 400),
    ("GET", "/v1/embed/1.5", {}, 400),
    ("GET", "/v1/embed/abc", {}, 400),
    ("GET", "/v1/embed/1", {"headers": {"accept": "text/html"}}, 406),
    ("POST", "/v1/embed", {"json": {"token_ids": [99999]}}, 400),
    ("POST", "/v1/embed", {"json": {"token_ids": [-3]}}, 400),
    ("POST", "/v1/embed", {"json": {"token_ids": [1.5]}}, 400),
    ("POST", "/v1/embed", {"json": {"token_ids": ["1"]}}, 400),
    ("POST", "/v1/embed", {"json": {"token_ids": [True]}}, 400),
    ("POST", "/v1/embed", {"json": {"token_ids": []}}, 400),
    ("POST", "/v1/embed", {"json": {"tokens": [1]}}, 400),
    ("POST", "/v1/embed", {"json": {"token_ids": [1, 2], "seq_len": 3}}, 400),
    ("POST", "/v1/embed", {"json": {"token_ids": list(range(17))}}, 413),
    ("POST", "/v1/embed", {"content": b'{"token_ids": [1,', "headers": J}, 400),
    ("POST", "/v1/embed", {"content": b"[1, 2]", "headers": J}, 400),
    ("POST", "/v1/embed", {"content": b"token_ids=1", "headers": {"content-type": "text/plain"}}, 415),
    ("POST", "/v1/embed", {"content": b"{}"}, 400),  # no Content-Type: binary (RFC 9110 §8.3), and malformed
    ("POST", "/v1/embed", {"content": struct.pack("<II", 2, 1), "headers": B}, 400),
    ("POST", "/v1/embed", {"content": struct.pack("<II", 1, 1) + b"\x00", "headers": B}, 400),
    ("POST", "/v1/embed", {"content": b"\x01\x00", "headers": B}, 400),
    ("POST", "/v1/embed", {"content": struct.pack("<I", 0), "headers": B}, 400),
    ("POST", "/v1/embed", {"content": struct.pack("<II", 1, 99999), "headers": B}, 400),
    ("POST", "/v1/logits", {"json": {"residual": [0.5] * 31}}, 400),
    ("POST", "/v1/logits", {"content": b'{"residual": [' + b"1," * 31 + b"NaN]}", "headers": J}, 400),
    ("POST", "/v1/logits", {"content": b'{"residual": [' + b"1," * 31 + b"Infinity]}", "headers": J}, 400),
    ("POST", "/v1/logits", {"json": {"residual": [0.5] * 31 + ["x"]}}, 400),
    ("POST", "/v1/logits", {"json": {"top_k": 3}}, 400),
    ("POST", "/v1/logits", {"json": {"residual": [0.5] * 32, "top_k": 0}}, 400),
    ("POST", "/v1/logits", {"json": {"residual": [0.5] * 32, "top_k": -2}}, 400),
    ("POST", "/v1/logits", {"json": {"residual": [0.5] * 32, "top_k": 21}}, 400),  # > max_top_k
    ("POST", "/v1/logits", {"json": {"residual": [0.5] * 32, "top_k": 100_000}}, 400),  # > vocab
    ("POST", "/v1/logits", {"json": {"residual": [0.5] * 32, "top_k": 2.5}}, 400),
    ("POST", "/v1/logits", {"json": {"residual": [0.5] * 32, "temperature": -1}}, 400),
    ("POST", "/v1/logits", {"json": {"residual": [0.5] * 32, "temperature": "hot"}}, 400),
    ("POST", "/v1/logits", {"content": b'{"residual": [' + b"1," * 31 + b'1], "temperature": NaN}', "headers": J}, 400),
    ("POST", "/v1/logits", {"content": np.ones(31, "<f4").tobytes(), "headers": B}, 400),
    ("POST", "/v1/logits", {"content": np.ones(32, "<f4").tobytes()[:-2], "headers": B}, 400),
    ("POST", "/v1/logits", {"content": np.full(32, np.inf, "<f4").tobytes(), "headers": B}, 400),
    ("POST", "/v1/logits?top_k=0", {"content": np.ones(32, "<f4").tobytes(), "headers": B}, 400),
    ("POST", "/v1/logits?temperature=-1", {"content": np.ones(32, "<f4").tobytes(), "headers": B}, 400),
    ("POST", "/v1/logits", {"content": b"x" * 5000, "headers": J}, 413),
    ("POST", "/v1/embed", {"content": b"\x00" * 5000, "headers": B}, 413),
    ("GET", "/v1/token/encode", {}, 400),
    ("GET", "/v1/token/decode?ids=1,x", {}, 400),
    ("GET", "/v1/token/decode?ids=99999", {}, 400),
    ("POST", "/v1/token/encode", {"json": {"text": 5}}, 400),
    ("POST", "/v1/token/decode", {"json": {"ids": "1"}}, 400),
    ("POST", "/v1/token/decode", {"content": b"1,2", "headers": {"content-type": "text/plain"}}, 415),
    ("GET", "/v1/nowhere", {}, 404),
    ("GET", "/v2/embed/1", {}, 404),
    ("DELETE", "/v1/embed/1", {}, 405),
    ("GET", "/v1/logits", {}, 405),
]


@pytest.mark.parametrize("method,path,kw,status", BAD, ids=[f"{m} {p} {s} #{i}" for i, (m, p, _, s) in enumerate(BAD)])
def test_bad_input_gets_4xx_json_and_server_keeps_serving(srv, method, path, kw, status):
    _err(srv.client.request(method, path, **kw), status)
    assert srv.client.get("/v1/health").status_code == 200
    assert srv.client.post("/v1/embed", json={"token_ids": [1]}).status_code == 200


# -- metrics ------------------------------------------------------------------------------------------


def _metric(text: str, name: str, **labels) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            if all(f'{k}="{v}"' in line for k, v in labels.items()):
                total += float(line.rsplit(" ", 1)[1])
    return total


def test_metrics_count_what_was_served(srv):
    m0 = srv.client.get("/metrics").text
    for i in range(5):
        srv.client.get(f"/v1/gemma/embed/{i + 20}")
    srv.client.get("/v1/gemma/embed/20")
    srv.client.get("/v1/gemma/embed/999999")
    srv.client.post("/v1/logits", json={"residual": [0.1] * 32})
    assert srv.client.get("/v1/no/such/route").status_code == 404
    m1 = srv.client.get("/metrics")
    assert m1.headers["content-type"].startswith("text/plain")
    t = m1.text
    route = "/v1/<model_id:str>/embed/<token:str>"
    d = lambda name, **kw: _metric(t, name, **kw) - _metric(m0, name, **kw)  # noqa: E731
    assert d("larql_embed_requests_total", route=route, status="200") == 6
    assert d("larql_embed_requests_total", route=route, status="404") == 1
    assert d("larql_embed_errors_total", route=route, type="not_found") == 1
    assert d("larql_embed_request_duration_seconds_count", route=route) == 7
    assert d("larql_embed_hot_cache_hits_total", model="gemma") + d("larql_embed_hot_cache_misses_total", model="gemma") == 6
    assert d("larql_embed_logits_batch_size_count", model="gemma") == 1
    assert 'le="1e-05"' in t  # duration buckets reach down to 10 microseconds
    assert _metric(t, "larql_embed_model_info", model_id="llama", lm_head_tied="false") == 1
    assert d("larql_embed_errors_total", route="unmatched") == 1


@pytest.mark.multiprocess
def test_metrics_add_up_across_workers(presets):
    """Two workers answer from one port; /metrics on either reports the requests of both."""
    args = [f"llama={presets['llama']}", "--workers", "2", "--blas-threads", "1", "--lm-head-cache", ""]
    with running_server("larql-embed", args, timeout=120) as s, httpx.Client(base_url=s.url) as c:
        pids = set()
        for _ in range(200):  # new connections spread over the workers: wait until both are ready
            with httpx.Client(base_url=s.url) as one:
                r = one.get("/v1/ready")
                if r.status_code == 200:
                    pids.add(r.json()["pid"])
            if len(pids) == 2:
                break
            time.sleep(0.05)
        assert len(pids) == 2
        n = 40
        for i in range(n):
            with httpx.Client(base_url=s.url) as one:
                assert one.get(f"/v1/embed/{i % 30}").status_code == 200
        # each worker flushes its counts every second (and before its own render)
        for _ in range(50):
            t = c.get("/metrics").text
            served = _metric(t, "larql_embed_requests_total", route="/v1/embed/<token:str>", status="200")
            lookups = _metric(t, "larql_embed_hot_cache_hits_total") + _metric(t, "larql_embed_hot_cache_misses_total")
            if served == lookups == n:
                break
            time.sleep(0.1)
        assert served == n and lookups == n
        assert _metric(t, "larql_embed_model_info", model_id="llama") == 1
