"""One FFN layer as one ggml graph (`larql_edge.model.ffn_graph`): the same bits as the product-by-
product compact path (the same ggml kernels, activation quantization and GELU table), and, like it,
close to the float32 numpy reference; on the tiny models of both families and 1, 7 and 16 rows."""

from __future__ import annotations

import numpy as np
import pytest

from larql_edge.format.vindex import Vindex
from larql_edge.model import ffn_graph
from larql_edge.model.backend import get_backend
from larql_edge.model.forward import LocalFfn, ffn_compute
from larql_edge.model.kernels import CompactMatrix
from larql_edge.model.kernels._ggml import gelu
from larql_edge.model.ops import gelu_tanh
from larql_edge.model.spec import ModelSpec
from tests._threads import kernel_threads
from tests.tinygguf import tiny_gguf_vindex

ROWS = (1, 7, 16)


def _product_path(gate, up, down, x):
    return down.matmul(gelu(gate.matmul(x)) * up.matmul(x))


# Gemma 3 270M's shapes (hidden 640, padded to 768 for K-quants) at a third of its width
@pytest.mark.parametrize("fmts", [("q4_k", "q6_k"), ("q5_0", "q6_k"), ("q4_1", "q8_0"), ("f16", "f16")])
def test_fused_layer_is_the_product_path_bit_for_bit(fmts):
    rng = np.random.default_rng(3)
    hidden, inter = 640, 768
    wg, wu = (rng.standard_normal((inter, hidden)).astype(np.float32) * 0.05 for _ in range(2))
    wd = rng.standard_normal((hidden, inter)).astype(np.float32) * 0.05
    gate, up = CompactMatrix.quantize(wg, fmts[0]), CompactMatrix.quantize(wu, fmts[0])
    down = CompactMatrix.quantize(wd, fmts[1])
    assert ffn_graph.fusable(gate, up, down)
    if fmts[0] == "q4_k":
        assert gate.repacked  # the graph reads ggml's repacked copy, as the products do
    graphs = ffn_graph.FfnGraphs("gelu_tanh")
    for n in ROWS:
        x = rng.standard_normal((n, hidden)).astype(np.float32)
        got = graphs.run(gate, up, down, x)
        np.testing.assert_array_equal(got, _product_path(gate, up, down, x))
        ref = gelu_tanh(x @ gate.dequantize().T) * (x @ up.dequantize()[:, :hidden].T)
        ref = ref @ down.dequantize()[:, :inter].T
        assert np.abs(got - ref).max() <= 0.05 * np.abs(ref).max()  # 8-bit activations (DESIGN §4)
    # the same graph serves another layer of the same kind: its weight pointers move per call
    g2 = CompactMatrix.quantize(wg[::-1].copy(), fmts[0])
    x = rng.standard_normal((1, hidden)).astype(np.float32)
    np.testing.assert_array_equal(graphs.run(g2, up, down, x), _product_path(g2, up, down, x))
    np.testing.assert_array_equal(graphs.run(gate, up, down, x), _product_path(gate, up, down, x))


def test_what_is_not_fused():
    rng = np.random.default_rng(0)
    f32 = CompactMatrix.from_array(rng.standard_normal((64, 32)).astype(np.float32))
    q = CompactMatrix.quantize(rng.standard_normal((64, 32)).astype(np.float32), "q8_0")
    dq = CompactMatrix.quantize(rng.standard_normal((32, 64)).astype(np.float32), "q8_0")
    assert ffn_graph.fusable(q, q, dq)
    assert not ffn_graph.fusable(f32, q, dq)  # float32 weights: the exact BLAS reference
    assert not ffn_graph.fusable(q, q, q)  # shapes that do not chain
    g = ffn_graph.FfnGraphs("gelu_tanh")
    assert g.takes(1) and g.takes(ffn_graph.MAX_ROWS) and not g.takes(ffn_graph.MAX_ROWS + 1) and not g.takes(0)


@pytest.mark.parametrize("fmts", [("q4_k", "q6_k"), ("q5_0", "q6_k"), ("f16", "f16")])
def test_fused_layer_on_two_threads_is_the_one_thread_graph_bit_for_bit(fmts):
    """Rows past PARALLEL_FROM_MACS run the graph on the kernel threads (ggml's pool): every float is
    the one-thread graph's, so a row's value does not depend on the host's thread count."""
    rng = np.random.default_rng(5)
    hidden, inter = 640, 2048  # Gemma 3 270M's FFN: 4+ rows cross PARALLEL_FROM_MACS
    gate, up = (CompactMatrix.quantize(rng.standard_normal((inter, hidden)).astype(np.float32) * 0.05, fmts[0])
                for _ in range(2))
    down = CompactMatrix.quantize(rng.standard_normal((hidden, inter)).astype(np.float32) * 0.05, fmts[1])
    graphs = ffn_graph.FfnGraphs("gelu_tanh")
    for n in (1, 4, 16, 33):
        x = rng.standard_normal((n, hidden)).astype(np.float32)
        with kernel_threads(1):
            one = graphs.run(gate, up, down, x)
        with kernel_threads(2):
            two = graphs.run(gate, up, down, x)
            assert graphs.run(gate, up, down, x[:1])[0].tobytes() == one[0].tobytes()  # a row alone, too
        assert (n * inter * hidden >= ffn_graph.PARALLEL_FROM_MACS) == (n >= 4)
        np.testing.assert_array_equal(two, one)
        np.testing.assert_array_equal(one, _product_path(gate, up, down, x))


@pytest.fixture(scope="module", params=["gemma3", "llama"])
def tiny_quantized(request, tmp_path_factory):
    fam = request.param
    root = tmp_path_factory.mktemp(f"ffn-graph-{fam}")
    qtypes = {"ffn_gate": "Q4_1", "ffn_up": "Q5_0", "ffn_down": "Q8_0", "attn_q": "Q8_0", "attn_k": "Q8_0",
              "attn_v": "Q8_0", "attn_output": "Q8_0", "token_embd": "Q8_0", "output": "Q8_0"}
    return fam, tiny_gguf_vindex(root, fam, 11, qtypes)


@pytest.mark.parametrize("rows", ROWS)
def test_tiny_models_fused_ffn_against_the_product_path_and_numpy(tiny_quantized, rows):
    fam, path = tiny_quantized
    vx = Vindex.open(path)
    spec = ModelSpec.from_index(vx.index)
    compact = LocalFfn(vx, spec, backend=get_backend("compact"))
    ref = LocalFfn(vx, spec, backend=get_backend("numpy"))
    # Gemma's FFN is one graph (its GELU is ggml's); Llama's SiLU stays product by product (ggml's
    # vectorized SiLU rounds otherwise than numpy's, and the shard must not change its values)
    assert (compact.fused is not None) == (fam == "gemma3")
    x = np.random.default_rng(rows).standard_normal((rows, spec.hidden_size)).astype(np.float32)
    for layer in range(spec.num_layers):
        got = compact.ffn(layer, x)
        np.testing.assert_array_equal(got, ffn_compute(compact.layers[layer], x, compact.act, compact.backend))
        want = ref.ffn(layer, x)
        assert np.abs(got - want).max() <= 0.05 * np.abs(want).max()
