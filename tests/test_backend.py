"""The compute-backend seam: selection rules, and the MLX path agreeing with numpy."""

from __future__ import annotations

import numpy as np
import pytest

from larql_edge.model.backend import default_backend_name, get_backend
from larql_edge.model.forward import Transformer
from tests.tinymodel import reference_logits

IDS = [2, 4, 5, 6, 7, 8, 9, 10]


def test_numpy_is_the_default_off_apple_silicon(monkeypatch):
    import platform

    monkeypatch.delenv("LARQL_BACKEND", raising=False)
    if not (platform.system() == "Darwin" and platform.machine() == "arm64"):
        assert default_backend_name() == "numpy"


def test_env_overrides_and_rejects_unknown(monkeypatch):
    monkeypatch.setenv("LARQL_BACKEND", "numpy")
    assert default_backend_name() == "numpy"
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
