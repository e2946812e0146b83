"""The compute-backend seam: selection rules; the compact (ggml, weights as stored) and MLX paths
agreeing with the reference; the compact one holding no float32 copy of an f16 or quantized weight."""

from __future__ import annotations

import os

import numpy as np
import pytest

from larql_edge.model.backend import default_backend_name, get_backend
from larql_edge.model.forward import Transformer
from tests.tinymodel import reference_logits

IDS = [2, 4, 5, 6, 7, 8, 9, 10]


def test_compact_is_the_default_here(monkeypatch):
    monkeypatch.delenv("LARQL_BACKEND", raising=False)
    assert default_backend_name() == "compact"


def test_selection_rule_per_platform():
    """The same rule decides on every platform: ggml (compact) wherever it loads, Macs included; MLX
    only on native Apple Silicon without ggml; else the float32 reference."""
    from larql_edge.model.backend import choose_backend

    for system, machine in [("Linux", "x86_64"), ("Linux", "aarch64"), ("Darwin", "arm64"), ("Darwin", "x86_64")]:
        assert choose_backend(system, machine, ggml=True, mlx=True) == "compact"
        assert choose_backend(system, machine, ggml=True, mlx=False) == "compact"
    assert choose_backend("Darwin", "arm64", ggml=False, mlx=True) == "mlx"
    assert choose_backend("Darwin", "arm64", ggml=False, mlx=False) == "numpy"
    assert choose_backend("Linux", "x86_64", ggml=False, mlx=True) == "numpy"
    assert choose_backend("Darwin", "x86_64", ggml=False, mlx=True) == "numpy"


def test_kernel_info_names_the_library():
    from larql_edge.model.kernels import kernel_info

    info = kernel_info()
    assert info["library"].startswith("ggml") and info["version"].split()[0].count(".") == 2
    assert info["threads"] >= 1 and isinstance(info["cpu_features"], list)
    # CI installs the published wheel: it must say so (a ggml compiled here says "native")
    assert info["build"] == ("prebuilt" if os.environ.get("CI") else info["build"])
    assert info["build"] in {"prebuilt", "native"}


def test_build_kind_tells_a_published_wheel_from_a_local_build():
    from larql_edge.model.kernels._ggml import build_kind

    assert build_kind(["cp311-cp311-manylinux_2_17_x86_64", "cp311-cp311-manylinux2014_x86_64"]) == "prebuilt"
    assert build_kind(["py3-none-macosx_14_0_arm64"]) == "prebuilt"
    assert build_kind(["cp311-cp311-linux_x86_64"]) == "native"  # pip wheel from the sdist, not repaired
    assert build_kind([]) == "unknown"



def test_env_overrides_and_rejects_unknown(monkeypatch):
    monkeypatch.setenv("LARQL_BACKEND", "numpy")
    assert default_backend_name() == "numpy"
    monkeypatch.setenv("LARQL_BACKEND", "compact")
    assert default_backend_name() == "compact"
    monkeypatch.setenv("LARQL_BACKEND", "cuda")
    with pytest.raises(ValueError, match="cuda"):
        default_backend_name()


@pytest.mark.parametrize("family", ["gemma3", "llama"])
def test_mlx_backend_matches_reference(tiny_models, family):
    pytest.importorskip("mlx.core", reason="mlx is not installed (pip install 'larql-edge[test]' on linux/x86_64)")
    be = get_backend("mlx")
    m = Transformer.local(tiny_models[family], backend=be)
    got = m.head.logits(m.forward(IDS))
    np.testing.assert_allclose(got, reference_logits(tiny_models[f"{family}-hf"], IDS), atol=1e-4, rtol=0)
    assert list(m.generate(IDS[:3], 4, stop_ids=[])) == list(Transformer.local(tiny_models[family]).generate(IDS[:3], 4, stop_ids=[]))


@pytest.mark.parametrize("family", ["gemma3", "llama"])
def test_compact_backend_matches_the_reference(tiny_models, family):
    """f32 tiny vindexes: the compact backend multiplies f32 weights with BLAS, as numpy does."""
    be = get_backend("compact")
    m = Transformer.local(tiny_models[family], backend=be)
    got = m.head.logits(m.forward(IDS))
    np.testing.assert_allclose(got, reference_logits(tiny_models[f"{family}-hf"], IDS), atol=1e-4, rtol=0)


@pytest.mark.slow  # tens of seconds in-process (tests/conftest.py: the tiers)
def test_compact_backend_keeps_f16_and_blocks_as_stored(tmp_path):
    """An f16 memory map and quantized blocks are multiplied in place: the backend's matrix shares the
    bytes it was given (no float32 copy), and its products agree with the dequantized reference."""
    from larql_edge.format.quant import QBlocks, dequantize_matrix, quantize_matrix

    rng = np.random.default_rng(0)
    w = rng.standard_normal((48, 256)).astype(np.float32)
    x = rng.standard_normal((3, 256)).astype(np.float32)
    f16 = np.memmap(tmp_path / "w.f16", dtype=np.float16, mode="w+", shape=w.shape)
    f16[:] = w
    f16.flush()
    ro = np.memmap(tmp_path / "w.f16", dtype=np.float16, mode="r", shape=w.shape)
    be = get_backend("compact")
    m = be.prepare(ro)
    assert m.fmt == "f16" and np.shares_memory(m.data, ro)
    xh = x.astype(np.float16).astype(np.float32)  # ggml's f16 dot product takes x in f16, as llama.cpp's
    np.testing.assert_allclose(be.linear(x, m), xh @ ro.astype(np.float32).T, rtol=1e-5, atol=1e-4)
    for fmt in ("Q4_K", "Q6_K", "Q8_0", "Q5_0", "Q4_1"):
        q = quantize_matrix(w, fmt)
        cm = be.prepare(q)
        if fmt != "Q6_K":  # LARQL's Q6_K layout is re-laid-out to ggml's once (same size)
            assert np.shares_memory(cm.data, q.data), fmt
        assert cm.nbytes == q.data.nbytes, fmt
        assert cm.fmt != "f32", fmt
        # ggml quantizes x to 8 bits per block too (as llama.cpp does): ~1e-2 of the largest output
        want = x @ dequantize_matrix(q).T
        np.testing.assert_allclose(be.linear(x, cm), want, rtol=0, atol=2e-2 * np.abs(want).max(), err_msg=fmt)
    assert isinstance(q, QBlocks)
