"""The one-graph-per-step forward (`larql_edge.model.graph`) against the float32 numpy reference.

The graph runs llama.cpp's ops: the same products as the layer-by-layer path, but GELU is ggml's
(a float16 lookup table, as llama.cpp computes Gemma's FFN), so Gemma's logits differ from the
reference by ~1e-3 on these tiny models; Llama's (SiLU) agree to float32 rounding.
"""

from __future__ import annotations

import numpy as np
import pytest

from larql_edge.model import graph as G
from larql_edge.model import speculative as sp
from larql_edge.model.backend import get_backend
from larql_edge.model.forward import KVCache, Transformer
from larql_edge.model.graph import GraphCache
from tests.tinygguf import tiny_gguf_vindex

IDS = [2, 4, 5, 6, 7, 8, 9, 10, 4]  # longer than the tiny Gemma's sliding window (4)
TOL = {"gemma3": 5e-3, "llama": 2e-5}


def _pair(path):
    return (Transformer.local(path, backend=get_backend("numpy")),
            Transformer.local(path, backend=get_backend("compact"), graph=True))


@pytest.mark.parametrize("family", ["gemma3", "llama"])
def test_one_graph_per_step_computes_the_reference_forward(tiny_models, family):
    ref, g = _pair(tiny_models[family])
    assert g.engine() is not None and isinstance(g.new_cache(), GraphCache)
    np.testing.assert_allclose(g.next_logits(IDS), ref.next_logits(IDS), atol=TOL[family], rtol=0)
    # forward() without the head gives every row's residual
    h, want = g.forward(IDS), ref.forward(IDS)
    assert h.shape == want.shape
    np.testing.assert_allclose(h, want, atol=TOL[family] * 4, rtol=0)


@pytest.mark.parametrize("family", ["gemma3", "llama"])
def test_graph_kv_cache_across_steps_and_chunks(tiny_models, family, monkeypatch):
    """Token by token, in odd chunks, past the attention bucket, the prompt chunk and a cache growth:
    each step's logits equal one pass over the whole sequence."""
    monkeypatch.setattr(G, "_FIRST_CAPACITY", 8)  # grow (and copy) the cache a few times
    monkeypatch.setattr(G, "_CHUNK", 16)
    ref, g = _pair(tiny_models[family])
    rng = np.random.default_rng(3)
    seq = [2, *map(int, rng.integers(3, 40, 70))]
    cache = g.new_cache()
    g.forward(seq[:5], cache)
    g.forward(seq[5:40], cache)  # 35 rows: chunks of 16, 16, 3
    assert cache.length == 40 and cache.capacity >= 40
    for i in range(40, len(seq)):
        got = g.next_logits([seq[i]], cache)
        if i % 7 == 0 or i == len(seq) - 1:
            np.testing.assert_allclose(got, ref.next_logits(seq[: i + 1]), atol=TOL[family] * 2, rtol=0)
    np.testing.assert_allclose(g.next_logits(seq), got, atol=1e-4, rtol=0)  # a 71-row prompt, chunked


@pytest.mark.parametrize("family", ["gemma3", "llama"])
def test_graph_cache_rollback(tiny_models, family):
    """Speculative decoding's rollback: forget rejected rows, continue as if they were never seen, also
    past the sliding window with no slack (the graph cache keeps every position)."""
    g = Transformer.local(tiny_models[family], graph=True)
    want = g.next_logits(IDS)
    cache = g.new_cache()
    g.forward(IDS, cache)
    g.forward([33, 34, 35], cache)  # three rejected rows
    cache.truncate(5, g.windows())
    np.testing.assert_allclose(g.next_logits(IDS[5:], cache), want, atol=1e-5, rtol=0)
    tight = g.new_cache()
    for t in IDS:
        g.forward([t], tight)
    tight.truncate(2, g.windows())  # far behind the window of 4: fine here
    np.testing.assert_allclose(g.next_logits(IDS[2:], tight), want, atol=1e-5, rtol=0)
    with pytest.raises(ValueError):
        tight.truncate(tight.length + 1)


@pytest.mark.parametrize("family", ["gemma3", "llama"])
def test_greedy_speculation_on_graph_models(tiny_models, family):
    m = Transformer.local(tiny_models[family], graph=True)
    for prompt in (IDS, IDS[:5], [2, 4, 4, 4, 4]):
        plain = list(m.generate(prompt, 30, stop_ids=[]))
        d = sp.ModelDrafter(Transformer.local(tiny_models[family], graph=True))
        assert list(sp.generate(m, prompt, 30, stop_ids=[], drafter=d)) == plain
        assert list(sp.generate(m, prompt, 30, stop_ids=[])) == plain  # n-gram drafts, more rejections


def test_graph_mode_is_chosen_by_the_weights_and_the_environment(tiny_models, monkeypatch):
    path = tiny_models["llama"]
    assert Transformer.local(path).engine() is None  # float32 weights: the exact BLAS path
    assert isinstance(Transformer.local(path).new_cache(), KVCache)
    assert Transformer.local(path, backend=get_backend("numpy"), graph=True).engine() is None
    monkeypatch.setenv("LARQL_GRAPH", "on")
    assert Transformer.local(path).engine() is not None
    monkeypatch.setenv("LARQL_GRAPH", "sometimes")
    with pytest.raises(ValueError, match="LARQL_GRAPH"):
        Transformer.local(path).engine()


@pytest.fixture(scope="module", params=["gemma3", "llama"])
def quantized(request, tmp_path_factory):
    fam = request.param
    root = tmp_path_factory.mktemp(f"graph-gguf-{fam}")
    qtypes = {"attn_q": "Q5_0", "attn_k": "Q4_1", "attn_v": "Q8_0", "attn_output": "Q5_0", "ffn_gate": "Q4_1",
              "ffn_up": "Q5_0", "ffn_down": "Q8_0", "token_embd": "Q8_0", "output": "Q4_1"}
    return fam, tiny_gguf_vindex(root, fam, 7, qtypes)


def test_graph_on_gguf_blocks_is_the_product_by_product_path(quantized):
    """On quantized blocks the graph is chosen by default and computes what the product-by-product
    compact path computes (the same ggml kernels and activation quantization)."""
    fam, path = quantized
    g, p = Transformer.local(path), Transformer.local(path, graph=False)
    assert g.engine() is not None and p.engine() is None
    a, b = g.next_logits(IDS), p.next_logits(IDS)
    # not bit for bit: the graph keeps llama.cpp's float16 KV cache and GELU table, and any such
    # rounding moves some 8-bit activation roundings downstream (as in test_gguf_quant: ~3% of the range)
    assert np.abs(a - b).max() <= 0.05 * np.abs(b).max()
    cache = g.new_cache()
    g.forward(IDS[:4], cache)
    for t in IDS[4:-1]:
        g.next_logits([t], cache)
    np.testing.assert_allclose(g.next_logits([IDS[-1]], cache), a, atol=5e-3 * np.abs(a).max(), rtol=0)


def test_trace_names_the_ops_as_llama_cpp_and_changes_no_value(quantized, monkeypatch):
    """graph.TRACE (benchmarks/llama_cpp_trace.py) gives the graph's tensors llama.cpp's names and keeps
    every result readable after the compute; the logits stay bit for bit those of an untraced graph."""
    fam, path = quantized
    plain = Transformer.local(path).next_logits(IDS)
    monkeypatch.setattr(G, "TRACE", True)
    m = Transformer.local(path)
    traced = m.next_logits(IDS)
    np.testing.assert_array_equal(traced, plain)
    step = next(reversed(m.engine()._graphs.values()))
    n = m.spec.num_layers
    for name in ("attn_norm-0", "Qcur-0", "Kcur-0", "kq-0", "kq_soft_max-0", "kqv_out-0", "ffn_out-0",
                 f"l_out-{n - 1}", "result_output"):
        assert name in step.named, name
    assert len(step.named["Qcur-0"]) == 2  # after its product and after RoPE, as llama.cpp names both
    assert ("ffn_geglu-0" if fam == "gemma3" else "ffn_swiglu-0") in step.named
    kq = step.named["kq-0"][0].contents
    assert (kq.ne[1], kq.ne[2]) == (len(IDS), m.spec.num_q_heads) and kq.flags & 2  # GGML_TENSOR_FLAG_OUTPUT


class _Remote:
    """An FFN provider that is not `LocalFfn` (as the grid client's is), over local weights."""

    def __init__(self, ffn):
        self.inner = ffn
        self.calls = 0

    def ffn(self, layer, x):
        self.calls += 1
        return self.inner.ffn(layer, x)


@pytest.mark.parametrize("family", ["gemma3", "llama"])
def test_attention_only_graphs_with_a_remote_ffn(tiny_models, family):
    """The split grid's client: attention halves as graphs, the FFN a call between them; the same
    logits as the whole-step graph, step after step (up to GELU: the remote FFN computes the exact
    tanh form, the whole-step graph ggml's table)."""
    whole = Transformer.local(tiny_models[family], graph=True)
    split = Transformer.local(tiny_models[family], graph=True)
    split.ffn_provider = _Remote(split.ffn_provider)
    assert split.engine() is not None and not split.engine().has_ffn
    c1, c2 = whole.new_cache(), split.new_cache()
    np.testing.assert_allclose(split.next_logits(IDS[:6], c2), whole.next_logits(IDS[:6], c1), atol=TOL[family], rtol=0)
    for t in IDS[6:]:
        np.testing.assert_allclose(split.next_logits([t], c2), whole.next_logits([t], c1), atol=TOL[family], rtol=0)
    assert split.ffn_provider.calls == whole.spec.num_layers * (1 + len(IDS[6:]))


def test_two_models_stepping_on_two_threads_at_once_give_each_ones_own_logits(tiny_models):
    """Two models in one process, each on its own thread, at 2 kernel threads: the process's one ggml
    thread pool works on one graph at a time (two at once corrupted each other's work: NaN rows to the
    router, then a segfault, in test_swarm's in-process streams)."""
    import threading

    from larql_edge.model.kernels import get_threads, set_threads

    before = get_threads()
    set_threads(2)
    try:
        models = [Transformer.local(tiny_models[f], backend=get_backend("compact"), graph=True)
                  for f in ("gemma3", "llama", "gemma3", "llama")]
        want = [m.next_logits(IDS) for m in models]
        bad: list[str] = []

        def spin(i: int) -> None:
            m = models[i]
            for r in range(150):
                got = m.next_logits(IDS)
                if not np.array_equal(got, want[i]):
                    bad.append(f"model {i} round {r}: max |diff| {np.nanmax(np.abs(got - want[i]))}")
                    return

        threads = [threading.Thread(target=spin, args=(i,), daemon=True) for i in range(len(models))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not any(t.is_alive() for t in threads), "a step hung (ggml's pool on two graphs at once)"
        assert not bad, bad
    finally:
        set_threads(before)
