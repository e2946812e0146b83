"""A build whose kernels part at some row count (ggml with llamafile's sgemm: tinyBLAS from 2 rows of x,
`vec_dot` for one) computes a 1-row product as `min_rows` copies of the row (`_ggml.sgemm_min_rows`).

The padding is forced here on whatever build is installed: on the prebuilt wheel one and two rows take
the same kernel, so a padded product must give the unpadded floats exactly; that checks the plumbing
(the copies in, the one row out, the graph's views) that a llamafile build relies on."""

from __future__ import annotations

import numpy as np
import pytest

from larql_edge.model import ffn_graph
from larql_edge.model.backend import get_backend
from larql_edge.model.forward import Transformer
from larql_edge.model.kernels import CompactMatrix, _ggml


@pytest.mark.parametrize(("features", "machine", "want"), [
    ({"llamafile": True, "avx2": True}, "x86_64", 2),
    ({"llamafile": True}, "AMD64", 2),
    ({"llamafile": False, "avx512": True}, "x86_64", 1),
    ({}, "x86_64", 1),
    ({"llamafile": True, "neon": True}, "aarch64", 1),  # arm64's thresholds (2/4/8 by type) unmeasured
    ({"llamafile": True}, "arm64", 1),
])
def test_the_padding_rule_by_build_and_machine(features, machine, want):
    assert _ggml.sgemm_min_rows(features, machine) == want


@pytest.mark.parametrize("fmt", ["q8_0", "f16", "q4_k", "q6_k", "q5_0", "q4_1"])
def test_a_padded_one_row_product_is_the_plain_one(fmt, monkeypatch):
    rng = np.random.default_rng(5)
    w = rng.standard_normal((48, 300)).astype(np.float32)
    x = rng.standard_normal((1, 300)).astype(np.float32)
    want = CompactMatrix.quantize(w, fmt).matmul(x)
    monkeypatch.setattr(_ggml.lib(), "min_rows", 2)
    m = CompactMatrix.quantize(w, fmt)  # its own graphs, built padded
    got = m.matmul(x)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(m.matmul(x[0]), want[0])  # a vector, too
    two = m.matmul(np.concatenate([x, x * 0.5]))  # 2 rows: not padded
    np.testing.assert_array_equal(two[:1], want)


def test_a_padded_one_row_ffn_layer_is_the_plain_one(monkeypatch):
    rng = np.random.default_rng(6)
    hidden, inter = 640, 768
    gate, up = (CompactMatrix.quantize(rng.standard_normal((inter, hidden)).astype(np.float32) * 0.05, "q4_k")
                for _ in range(2))
    down = CompactMatrix.quantize(rng.standard_normal((hidden, inter)).astype(np.float32) * 0.05, "q6_k")
    x = rng.standard_normal((1, hidden)).astype(np.float32)
    want = ffn_graph.FfnGraphs("gelu_tanh").run(gate, up, down, x)
    monkeypatch.setattr(_ggml.lib(), "min_rows", 2)
    got = ffn_graph.FfnGraphs("gelu_tanh").run(gate, up, down, x)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("family", ["gemma3", "llama"])
def test_a_padded_graph_step_is_the_plain_one(tiny_models, family, monkeypatch):
    """Decode steps (1 row: every product and both attention products padded) and a 3-row chunk."""
    ids = np.random.default_rng(7).integers(3, 40, 36).tolist()

    def run():
        m = Transformer.local(tiny_models[family], backend=get_backend("compact"), graph=True)
        assert m.engine() is not None
        c = m.new_cache()
        out = [m.forward(ids[:30], c)]
        out += [m.forward([t], c) for t in ids[30:33]]
        out.append(m.forward(ids[33:], c))
        return np.concatenate(out)

    want = run()
    monkeypatch.setattr(_ggml.lib(), "min_rows", 2)
    np.testing.assert_array_equal(run(), want)
