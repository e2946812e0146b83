"""Shared fixtures: golden outputs, cached real-model vindexes, tiny in-test models."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

DATA = Path(__file__).parent / "data"
GOLDEN = {"gemma3-270m": DATA / "golden" / "gemma-3-270m.json", "smollm2-135m": DATA / "golden" / "smollm2-135m-instruct.json"}


def pytest_configure(config):
    # Tests share 2 cores between servers and clients: pin BLAS threads (DESIGN.md §7).
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def golden():
    def load(model: str) -> dict:
        return json.loads(GOLDEN[model].read_text())

    return load


def _real_vindex(alias: str, dtype: str) -> Path:
    from slicer.cache import cached_vindex
    from slicer.errors import SourceError

    try:
        return cached_vindex(alias, level="all", dtype=dtype, log=lambda m: None)
    except SourceError as e:
        if os.environ.get("CI"):
            raise
        pytest.skip(f"real model unavailable: {e}")


@pytest.fixture(scope="session")
def gemma_f32() -> Path:
    return _real_vindex("gemma3-270m", "f32")


@pytest.fixture(scope="session")
def gemma_f16() -> Path:
    return _real_vindex("gemma3-270m", "f16")


@pytest.fixture(scope="session")
def smol_f32() -> Path:
    return _real_vindex("smollm2-135m", "f32")


@pytest.fixture(scope="session")
def smol_f16() -> Path:
    return _real_vindex("smollm2-135m", "f16")


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    """Tiny random HF folders for each family, and their extracted f32 vindexes."""
    from slicer.extract import extract
    from tests.tinymodel import make_tiny_model

    root = tmp_path_factory.mktemp("tiny")
    out: dict[str, Path] = {}
    for fam in ("gemma3", "llama"):
        src = make_tiny_model(root / f"{fam}-hf", fam, seed=1 if fam == "gemma3" else 2)
        out[f"{fam}-hf"] = src
        out[fam] = root / f"{fam}.vindex"
        extract(str(src), out[fam], dtype="f32", progress=False, log=lambda m: None)
    return out
