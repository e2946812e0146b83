"""The embed server on the real models against the golden outputs (Hugging Face transformers, f32).

Gemma 3 270M is served from an f16 ``embed`` preset (the table stays f16 at rest), SmolLM2-135M
from an f32 one. The residual sent to ``/v1/logits`` is the pre-final-norm residual of the local
forward pass over the f32 vindex, so the server's final norm + lm_head + softcap is what is tested.
"""

from __future__ import annotations

import httpx
import numpy as np
import pytest

from larql_edge.model import ops
from larql_edge.model.forward import Transformer
from larql_edge.testing.servers import running_server
from tests.test_embed_server import BIN, embed_preset

pytestmark = pytest.mark.slow

MODELS = {"gemma": "gemma3-270m", "smol": "smollm2-135m"}


@pytest.fixture(scope="module")
def server(gemma_f16, smol_f32, tmp_path_factory):
    root = tmp_path_factory.mktemp("real-embed")
    args = [f"gemma={embed_preset(gemma_f16, root / 'gemma')}", f"smol={embed_preset(smol_f32, root / 'smol')}", "--blas-threads", "1"]
    with running_server("larql-embed", args, timeout=600) as srv, httpx.Client(base_url=srv.url, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def residuals(gemma_f32, smol_f32, golden):
    """Pre-final-norm residual of the last position, per model and golden prompt."""
    out = {}
    for mid, path in (("gemma", gemma_f32), ("smol", smol_f32)):
        model = Transformer.local(path)
        out[mid] = [model.forward(p["input_ids"])[-1].astype(np.float32) for p in golden(MODELS[mid])["prompts"]]
        del model
    return out


@pytest.mark.parametrize("mid", ["gemma", "smol"])
def test_embedding_rows_equal_golden(server, golden, mid):
    g = golden(MODELS[mid])
    for row in g["embedding_rows"]:
        tid = row["token_id"]
        got = np.frombuffer(server.get(f"/v1/{mid}/embed/{tid}").content, "<f4")
        np.testing.assert_allclose(got[:8], row["scaled_first8"], atol=1e-3)
        assert abs(np.linalg.norm(got) - row["scaled_l2"]) <= 1e-3 * row["scaled_l2"]
        posted = server.post(f"/v1/{mid}/embed", json={"token_ids": [tid]}).json()["residual"][0]
        np.testing.assert_array_equal(np.array(posted, np.float32), got)


@pytest.mark.parametrize("mid", ["gemma", "smol"])
def test_logits_give_golden_top10(server, golden, residuals, mid):
    g = golden(MODELS[mid])
    for prompt, x in zip(g["prompts"], residuals[mid], strict=True):
        want_ids = prompt["top10_ids"]
        # JSON request, JSON top-k
        top = server.post(f"/v1/{mid}/logits", json={"residual": x.tolist(), "top_k": 10}).json()["top_k"]
        assert [t["token_id"] for t in top] == want_ids, prompt["prompt"]
        np.testing.assert_allclose([t["logprob"] for t in top], prompt["top10_logprobs"], atol=0.05)
        assert [t["token"] for t in top] == prompt["top10_text"]
        # binary request, JSON top-k
        hdr = {"content-type": BIN}
        top_b = server.post(f"/v1/{mid}/logits?top_k=10", content=x.tobytes(), headers=hdr).json()["top_k"]
        assert [t["token_id"] for t in top_b] == want_ids
        # raw logits
        raw = server.post(f"/v1/{mid}/logits", content=x.tobytes(), headers={**hdr, "accept": BIN})
        logits = np.frombuffer(raw.content, "<f4")
        assert logits.size == g["config"]["vocab_size"]
        lp = ops.log_softmax(logits)
        assert np.argsort(-lp, kind="stable")[:10].tolist() == want_ids
        np.testing.assert_allclose(lp[want_ids], prompt["top10_logprobs"], atol=0.05)


def test_f16_table_is_served_without_a_copy(server):
    s = server.get("/v1/gemma/stats").json()
    assert s["embeddings"]["dtype"] == "f16" and s["embeddings"]["storage"] == "pread"
    assert s["lm_head_tied"] is True and s["vocab_size"] == 262_144
    # the f16 lm_head is multiplied in place, straight from the vindex's map: no copy at all
    assert s["lm_head"]["format"] == "f16" and s["lm_head"]["storage"] == "mmap (vindex)"
