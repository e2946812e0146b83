"""extract -> vindex -> forward equals an independent numpy forward over the source tensors."""

from __future__ import annotations

import numpy as np
import pytest

from larql_edge.format.vindex import Vindex
from larql_edge.model.forward import Transformer
from tests.tinymodel import reference_logits

IDS = [2, 4, 5, 6, 7, 8, 9, 10, 4]  # longer than the tiny Gemma's sliding window (4)


@pytest.mark.parametrize("family", ["gemma3", "llama"])
def test_forward_matches_reference(tiny_models, family):
    m = Transformer.local(tiny_models[family])
    h = m.forward(IDS)
    got = m.head.logits(h)
    want = reference_logits(tiny_models[f"{family}-hf"], IDS)
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("family", ["gemma3", "llama"])
def test_kv_cache_decode_equals_full_forward(tiny_models, family):
    """Feeding tokens one at a time through the cache gives the same logits as one full pass."""
    m = Transformer.local(tiny_models[family])
    want = reference_logits(tiny_models[f"{family}-hf"], IDS)
    cache = m.new_cache()
    m.forward(IDS[:3], cache)
    for i in range(3, len(IDS)):
        got = m.next_logits([IDS[i]], cache)
        np.testing.assert_allclose(got, want[i], atol=1e-5, rtol=0)


def test_generate_greedy_is_argmax_chain(tiny_models):
    m = Transformer.local(tiny_models["llama"])
    out = list(m.generate(IDS[:4], max_tokens=5, stop_ids=[]))
    seq = IDS[:4]
    for tok in out:
        want = int(np.argmax(reference_logits(tiny_models["llama-hf"], seq)[-1]))
        assert tok == want
        seq = seq + [tok]


def test_tied_model_has_no_lm_head_file(tiny_models):
    assert Vindex.open(tiny_models["gemma3"]).tied
    assert not Vindex.open(tiny_models["llama"]).tied
    assert Vindex.open(tiny_models["llama"]).has("lm_head.bin")
