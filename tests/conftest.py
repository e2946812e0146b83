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
    from larql_edge.tools.slicer.cache import cached_vindex
    from larql_edge.tools.slicer.errors import SourceError

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
    from larql_edge.tools.slicer.extract import extract
    from tests.tinymodel import make_tiny_model

    root = tmp_path_factory.mktemp("tiny")
    out: dict[str, Path] = {}
    for fam in ("gemma3", "llama"):
        src = make_tiny_model(root / f"{fam}-hf", fam, seed=1 if fam == "gemma3" else 2)
        out[f"{fam}-hf"] = src
        out[fam] = root / f"{fam}.vindex"
        extract(str(src), out[fam], dtype="f32", progress=False, log=lambda m: None)
    return out


# -- the Hub-protocol test server (tests/hubserver) ---------------------------------------------

@pytest.fixture
def hf_env(tmp_path, monkeypatch):
    """Client configuration for the local server: no Xet, no telemetry/agent lookup, no offline mode, fresh home.

    `huggingface_hub.constants` reads the environment at import time, so the module attributes are patched too.
    """
    home = tmp_path / "hf_home"
    for name, value in {
        "HF_HUB_DISABLE_XET": "1",
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "HF_HOME": str(home),
        "NO_PROXY": "127.0.0.1,localhost",
    }.items():
        monkeypatch.setenv(name, value)
    for name in ("HF_HUB_OFFLINE", "HF_TOKEN", "HF_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)
    from huggingface_hub import constants as hf_constants

    monkeypatch.setattr(hf_constants, "HF_HUB_DISABLE_XET", True)
    monkeypatch.setattr(hf_constants, "HF_HUB_DISABLE_TELEMETRY", True)
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", False)
    return home


@pytest.fixture
def hub(hf_env):
    from tests.hubserver import HubServer, local_only_client

    with HubServer() as server, local_only_client() as blocked:
        yield server
        assert blocked == [], f"huggingface_hub tried to reach non-local hosts: {blocked}"


