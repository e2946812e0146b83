"""The local forward on the real models against an independent implementation's outputs.

Golden outputs: Hugging Face transformers 5.x, float32, loading the same GGUF files
(tests/data/golden, copied from the design's shared/golden). The vindexes are f32, so the
comparison measures our math, not storage rounding.
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
