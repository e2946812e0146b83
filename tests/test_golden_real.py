"""The local forward on the real models against an independent implementation's outputs.

Golden outputs: Hugging Face transformers 5.x, float32, loading the same GGUF files
(tests/data/golden, copied from the design's shared/golden). The f32 vindexes measure our math,
not storage rounding; the quantized ones (q4k, gguf) what their storage and ggml's 8-bit activations
cost, on the compact kernels (and, for gguf, that its weights are exactly the GGUF's, on numpy).
"""

from __future__ import annotations

import numpy as np
import pytest
from tokenizers import Tokenizer

from larql_edge.format.vindex import Vindex
from larql_edge.model.forward import Transformer, top_k

pytestmark = pytest.mark.slow

MODELS = [("gemma3-270m", "gemma_f32"), ("smollm2-135m", "smol_f32")]


@pytest.fixture(scope="module", params=MODELS, ids=[m for m, _ in MODELS])
def case(request, golden):
    model, fixture = request.param
    path = request.getfixturevalue(fixture)
    return golden(model), path, Transformer.local(path), Tokenizer.from_file(str(path / "tokenizer.json"))


def test_tokenizer_ids_identical(case):
    g, _, _, tok = case
    for p in g["prompts"]:
        assert tok.encode(p["prompt"]).ids == p["input_ids"], p["prompt"]


def test_top10_and_logprobs(case):
    g, _, model, _ = case
    for p in g["prompts"]:
        got = top_k(model.next_logits(p["input_ids"]), 10)
        assert [i for i, _ in got] == p["top10_ids"], p["prompt"]
        delta = max(abs(lp - want) for (_, lp), want in zip(got, p["top10_logprobs"], strict=True))
        assert delta <= 2e-3, (p["prompt"], delta)


def test_greedy_continuation_16_tokens(case):
    g, _, model, tok = case
    for p in g["prompts"]:
        if "greedy_ids" not in p:
            continue
        out = list(model.generate(p["input_ids"], 16, temperature=0.0, stop_ids=[]))
        assert out == p["greedy_ids"]
        assert tok.decode(out) == p["greedy_text"]


@pytest.mark.parametrize("fixture", ["gemma_f32", "gemma_f16", "smol_f32"])
def test_embedding_rows(request, golden, fixture):
    model = "gemma3-270m" if fixture.startswith("gemma") else "smollm2-135m"
    g = golden(model)
    vx = Vindex.open(request.getfixturevalue(fixture))
    assert vx.embed_scale == pytest.approx(g["embedding_scale"], rel=1e-6)
    for row in g["embedding_rows"]:
        raw = np.asarray(vx.embeddings()[row["token_id"]], dtype=np.float32)
        scaled = raw * np.float32(vx.embed_scale)
        np.testing.assert_allclose(raw[:8], row["raw_first8"], atol=1e-3, rtol=0)
        np.testing.assert_allclose(scaled[:8], row["scaled_first8"], atol=1e-3, rtol=0)
        assert float(np.linalg.norm(raw)) == pytest.approx(row["raw_l2"], abs=1e-3)
        assert float(np.linalg.norm(scaled)) == pytest.approx(row["scaled_l2"], abs=1e-3 * max(1, row["scaled_l2"]))


# -- quantized vindexes --------------------------------------------------------------------------

QUANTIZED = [("gemma3-270m", "gemma_f16", "gguf"), ("smollm2-135m", "smol_f16", "gguf"),
             ("gemma3-270m", "gemma_f16", "q4k"), ("smollm2-135m", "smol_f16", "q4k")]


def _worst_delta(model: Transformer, g: dict) -> tuple[float, list[np.ndarray]]:
    """max |log-prob - reference| over each prompt's reference top 10; and each prompt's log-probs."""
    from larql_edge.model import ops

    lps = [ops.log_softmax(model.next_logits(p["input_ids"])) for p in g["prompts"]]
    worst = max(float(abs(lp[i] - w)) for lp, p in zip(lps, g["prompts"], strict=True)
                for i, w in zip(p["top10_ids"], p["top10_logprobs"], strict=True))
    return worst, lps


def _misordered(lp: np.ndarray, p: dict, margin: float) -> list[tuple[int, int]]:
    """Pairs of the reference top 10 that come out in the other order although the reference puts
    more than ``margin`` between them (closer pairs are near-ties the comparison cannot settle)."""
    ids, ref = p["top10_ids"], p["top10_logprobs"]
    return [(ids[i], ids[j]) for i in range(10) for j in range(i + 1, 10)
            if ref[i] - ref[j] > margin and not lp[ids[i]] > lp[ids[j]]]


@pytest.mark.parametrize("model,f16,quant", QUANTIZED, ids=[f"{m}-{q}" for m, _, q in QUANTIZED])
def test_quantized_vindex_against_the_reference(request, golden, real_quantized, model, f16, quant):
    """On the default backend (ggml's kernels, which quantize each activation to 8 bits per block as
    llama.cpp does): the reference's top-10 order holds wherever its margin exceeds twice our own
    error, and that error is bounded and reported (DESIGN.md §4). gguf keeps the GGUF's own blocks;
    q4k is LARQL's layout, whose Q4_K/Q6_K slots requantize the GGUF's Q5_0/Q8_0/Q4_1 tensors."""
    g = golden(model)
    m = Transformer.local(real_quantized(model, quant))  # the default backend: compact (ggml) kernels
    worst, lps = _worst_delta(m, g)
    f16_worst, _ = _worst_delta(Transformer.local(request.getfixturevalue(f16)), g)
    print(f"{model} {quant}: max |d log-prob| {worst:.4f} (f16 vindex {f16_worst:.4f})")
    for lp, p in zip(lps, g["prompts"], strict=True):
        assert not _misordered(lp, p, 2 * worst), (p["prompt"], _misordered(lp, p, 2 * worst))
    assert worst < (1.0 if quant == "gguf" else 2.0), worst  # 8-bit activations / requantized 4-bit weights


@pytest.mark.parametrize("model,f16", [("gemma3-270m", "gemma_f16"), ("smollm2-135m", "smol_f16")])
def test_gguf_vindex_is_exactly_the_gguf_on_the_reference_backend(request, golden, real_quantized, model, f16):
    """The gguf vindex holds exactly the GGUF's weights: computed in float32 (numpy, the reference
    backend) it is at least as close to the reference as the f16 vindex, with the same top-10 order
    and the same greedy continuation."""
    from larql_edge.model.backend import get_backend

    g = golden(model)
    m = Transformer.local(real_quantized(model, "gguf"), backend=get_backend("numpy"))
    worst, lps = _worst_delta(m, g)
    f16_worst, _ = _worst_delta(Transformer.local(request.getfixturevalue(f16), backend=get_backend("numpy")), g)
    assert worst <= f16_worst, (worst, f16_worst)
    for p in g["prompts"]:
        assert [int(i) for i in np.argsort(-lps[g["prompts"].index(p)])[:10]] == p["top10_ids"], p["prompt"]
        if "greedy_ids" in p:
            assert list(m.generate(p["input_ids"], 16, temperature=0.0, stop_ids=[])) == p["greedy_ids"]
