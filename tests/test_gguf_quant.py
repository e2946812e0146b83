"""``--quant gguf``: the q4k layout with every tensor kept in the block type its GGUF file gave it.

LARQL's q4k slots are Q4_K/Q6_K only, so a GGUF whose projections are Q5_0, Q8_0 or Q4_1 (both real
models here) must be requantized for LARQL; ``gguf`` keeps those blocks byte for byte, so compute runs
on exactly the GGUF's weights. Tiny GGUFs quantized by gguf-py stand in for the real files.
"""

from __future__ import annotations

import json

import gguf
import httpx
import numpy as np
import pytest

from larql_edge.errors import VindexError
from larql_edge.format import quant as Q
from larql_edge.format.q4k import ATTN_Q4K_MANIFEST, FFN_Q4K_MANIFEST, Q4kWeights
from larql_edge.format.vindex import Vindex
from larql_edge.model import forward
from larql_edge.model.backend import get_backend
from larql_edge.model.forward import Transformer
from larql_edge.roles.client._build import build_remote
from larql_edge.tools.slicer.extract import extract
from larql_edge.wire import embed as ew
from larql_edge.wire import ffn as fw
from tests import _inproc as inproc
from tests._cli import slicer
from tests._grid import remote_args
from tests.tinygguf import hf_to_gguf
from tests.tinymodel import make_tiny_model, reference_logits

GT = gguf.GGMLQuantizationType
IDS = [2, 4, 5, 6, 7, 8, 9]
# Every 32-block type on some projection; the tiny model's widths are multiples of 32, not of 256.
QTYPES = {"attn_q": "Q5_0", "attn_k": "Q4_1", "attn_v": "Q8_0", "attn_output": "Q5_0", "ffn_gate": "Q4_1",
          "ffn_up": "Q5_0", "ffn_down": "Q8_0", "token_embd": "Q8_0", "output": "Q4_1"}
PROJ = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


@pytest.fixture(scope="module", params=["gemma3", "llama"])
def model(request, tmp_path_factory):
    fam = request.param
    root = tmp_path_factory.mktemp(f"gguf-{fam}")
    hf = make_tiny_model(root / "hf", fam, seed=5, gguf_compatible=True)
    g = hf_to_gguf(hf, root / "m.gguf", qtypes=QTYPES)
    out = root / "v"
    extract(str(g), out, quant="gguf", progress=False, log=lambda m: None)
    return {"family": fam, "hf": hf, "gguf": g, "vindex": out, "root": root}


def _gguf_tensors(path):
    return {t.name: t for t in gguf.GGUFReader(str(path)).tensors}


def test_every_tensor_keeps_its_gguf_block_type_and_values(model):
    """Each manifest entry names the GGUF tensor's own type; its blocks decode to exactly what the
    GGUF's decode to (Llama's Q/K rows come back in HF order: llama.cpp's permutation undone)."""
    from larql_edge.tools.slicer.extract._gguf import unpermute_qk

    ix = json.loads((model["vindex"] / "index.json").read_text())
    assert ix["quant"] == "gguf" and ix["has_model_weights"] is True
    cfg = json.loads((model["hf"] / "config.json").read_text())
    T = _gguf_tensors(model["gguf"])
    r = Q4kWeights(model["vindex"])
    r.validate()
    for layer in range(cfg["num_hidden_layers"]):
        for key, kind in PROJ.items():
            t = T[f"blk.{layer}.{kind}.weight"]
            qb = r.tensor(f"layers.{layer}.{key}.weight")
            assert qb.format == QTYPES[kind] == t.tensor_type.name, key
            want = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
            if model["family"] == "llama" and kind in ("attn_q", "attn_k"):
                want = unpermute_qk(want, cfg["num_attention_heads"] if kind == "attn_q" else cfg["num_key_value_heads"])
            else:  # not permuted: the very bytes of the file
                assert qb.data.tobytes() == np.asarray(t.data).tobytes(), key
            assert np.array_equal(Q.dequantize_matrix(qb), want), key
    manifests = [json.loads((model["vindex"] / m).read_text()) for m in (ATTN_Q4K_MANIFEST, FFN_Q4K_MANIFEST)]
    assert {e["format"] for m in manifests for e in m} == {"Q5_0", "Q4_1", "Q8_0"}
    lm = r.lm_head()
    if model["family"] == "llama":  # untied: its own blocks in lm_head_gguf.bin
        assert lm is not None and lm.format == "Q4_1"
        assert lm.data.tobytes() == np.asarray(T["output.weight"].data).tobytes()
    else:
        assert lm is None and Vindex.open(model["vindex"]).tied


def test_the_model_on_gguf_blocks_is_the_gguf_model(model):
    """The GGUF's own weights: a gguf vindex computes what an f32 vindex of the same file computes (the
    f16 embedding table the only rounding) with the numpy reference (blocks dequantized), and the
    compact kernels (blocks as stored, ggml's 8-bit activations) within that rounding; the float
    model differs by the file's quantization."""
    f32 = model["root"] / "f32"
    if not f32.exists():
        extract(str(model["gguf"]), f32, dtype="f32", progress=False, log=lambda m: None)
    same = Transformer.local(f32, backend=get_backend("numpy"))
    want = same.head.logits(same.forward(IDS))
    exact = Transformer.local(model["vindex"], backend=get_backend("numpy"))
    compact = Transformer.local(model["vindex"], backend=get_backend("compact"))
    a = exact.head.logits(exact.forward(IDS))
    b = compact.head.logits(compact.forward(IDS))
    np.testing.assert_allclose(a, want, atol=5e-3, rtol=0)
    # The compact backend is ggml's arithmetic: activations quantized to 8 bits per block as llama.cpp
    # does (Q8_0 / Q8_K), so it differs from the dequantized reference by that rounding compounded over
    # the layers (up to ~3% of the range on these random tiny models; the kernels alone are checked to
    # 1e-4 in test_kernels). Its argmax agrees wherever the reference's top-2 margin exceeds twice that.
    err = float(np.abs(b - a).max())
    assert err <= 0.05 * float(np.abs(a).max()), err
    top2 = np.sort(a, axis=-1)[:, -2:]
    clear = (top2[:, 1] - top2[:, 0]) > 2 * err
    assert (a.argmax(-1) == b.argmax(-1))[clear].all()
    assert np.abs(a - reference_logits(model["hf"], IDS)).max() > 1e-2  # it is the 4-5 bit model, not the float one


def test_verify_slice_and_every_role_serve_a_gguf_vindex(model, tmp_path, monkeypatch):
    v = model["vindex"]
    # the embed server serves the f16 token rows; the local one-graph step would decode them from the
    # tied Q8_0 table as llama.cpp does (forward.EXACT_TOKEN_ROWS): compare on the same rows
    monkeypatch.setattr(forward, "EXACT_TOKEN_ROWS", False)
    assert slicer("verify", str(v)).returncode == 0
    r = slicer("slice", str(v), "--preset", "server", "--output", str(tmp_path / "server"))
    assert r.returncode == 0, r.stderr
    names = {p.name for p in (tmp_path / "server").iterdir()}
    assert {"interleaved_q4k.bin", FFN_Q4K_MANIFEST} <= names and "attn_weights_q4k.bin" not in names
    local = Transformer.local(v)
    hidden = Vindex.open(v).hidden_size
    with inproc.grid(v, ["0-0", "1-1"]) as g:
        url = g["router"].url
        x = np.random.default_rng(1).standard_normal(hidden).astype(np.float32)
        r = httpx.post(url + "/v1/logits", content=ew.encode_logits_request(x),
                       headers={"content-type": fw.CONTENT_TYPE, "accept": fw.CONTENT_TYPE})
        np.testing.assert_allclose(ew.decode_logits_response(r.content), local.head.logits(x[None])[0], atol=1e-4, rtol=0)
        h = np.random.default_rng(2).standard_normal((3, hidden)).astype(np.float32)
        r = httpx.post(url + "/v1/walk-ffn", content=fw.encode_request(1, h), headers={"content-type": fw.CONTENT_TYPE})
        np.testing.assert_allclose(fw.decode_response(r.content, hidden)[1], local.ffn_provider.ffn(1, h), atol=1e-5, rtol=0)
        remote = build_remote(Vindex.open(v), remote_args(ffn=url))
        np.testing.assert_allclose(remote.next_logits(IDS), local.next_logits(IDS), atol=1e-4, rtol=0)


def test_transcode_keeps_every_computable_type_and_falls_back_to_q8_0():
    rng = np.random.default_rng(9)
    w = rng.standard_normal((4, 512)).astype(np.float32)
    for name in ("Q8_0", "Q5_0", "Q4_1"):
        raw = gguf.quants.quantize(w, GT[name])
        qb, kept = Q.transcode_gguf(name, raw, 4, 512, None)
        assert kept and qb.format == name and qb.data.tobytes() == raw.tobytes()
    q4 = Q.quantize_q4_k(w).reshape(4, -1)
    qb, kept = Q.transcode_gguf("Q4_K", q4, 4, 512, None)
    assert kept and qb.format == "Q4_K" and qb.data.tobytes() == q4.tobytes()
    q6 = Q.q6k_to_ggml(Q.quantize_q6_k(w)).reshape(4, -1)
    qb, kept = Q.transcode_gguf("Q6_K", q6, 4, 512, None)  # re-laid-out to LARQL's Q6_K, same values
    assert kept and qb.format == "Q6_K" and np.array_equal(Q.dequantize_matrix(qb), gguf.quants.dequantize(q6, GT.Q6_K))
    qb, kept = Q.transcode_gguf("F16", w.astype(np.float16), 4, 512, None)  # no kernel reads F16 blocks: Q8_0
    assert not kept and qb.format == "Q8_0" and (qb.padded_cols, qb.logical_cols) == (512, 512)
    odd = rng.standard_normal((2, 80)).astype(np.float32)  # 32-block types pad to 32, not 256
    qb, _ = Q.transcode_gguf("F32", odd, 2, 80, None)
    assert (qb.format, qb.padded_cols, qb.logical_cols) == ("Q8_0", 96, 80)


def test_a_gguf_source_is_required_and_bad_manifests_are_named(model, tmp_path):
    r = slicer("extract", str(model["hf"]), "--quant", "gguf", "--output", str(tmp_path / "x"))
    assert r.returncode != 0 and "not a GGUF source" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not (tmp_path / "x").exists()
    # A q4k vindex may not carry gguf-only formats (LARQL would panic on them); a gguf one no unknown ones.
    import shutil

    copy = tmp_path / "v"
    shutil.copytree(model["vindex"], copy)
    ix = json.loads((copy / "index.json").read_text())
    (copy / "index.json").write_text(json.dumps(ix | {"quant": "q4k"}))
    with pytest.raises(VindexError, match="unknown format 'Q5_0' \\(Q4_K or Q6_K\\)"):
        Q4kWeights(copy).attn(0)
    (copy / "index.json").write_text(json.dumps(ix))
    m = json.loads((copy / ATTN_Q4K_MANIFEST).read_text())
    m[0]["format"] = "Q9_Z"
    (copy / ATTN_Q4K_MANIFEST).write_text(json.dumps(m))
    with pytest.raises(VindexError, match="unknown format 'Q9_Z'"):
        Q4kWeights(copy).attn(0)
