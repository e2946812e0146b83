"""The gguf vindex decodes what llama.cpp decodes from the same GGUF: an independent implementation.

llama.cpp cannot be built under CI (its sdist compiles for ~15 min on 2 cores), so its greedy
continuations are a committed file, `tests/data/llama_cpp_greedy.json`, written by
``python benchmarks/llama_cpp_parity.py --write-golden tests/data/llama_cpp_greedy.json`` with
llama-cpp-python built for the ISA of the ggml wheel our kernels come from (version, build and
settings in the file; llama.cpp's defaults) on the packaged GGUFs: per prompt and step, llama.cpp's token,
its runner-up and its top-2 logit margin. Our greedy continuation (default backend: the one-graph
step on ggml's kernels) must equal llama.cpp's token for token, except that it may part at a step
where llama.cpp's own margin is a near-tie (< 0.1 logit), and then only to llama.cpp's runner-up.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from larql_edge.model.forward import Transformer

GOLDEN = Path(__file__).parent / "data" / "llama_cpp_greedy.json"
DATA = json.loads(GOLDEN.read_text()) if GOLDEN.exists() else {"models": {}}
CASES = [(alias, i) for alias, m in DATA["models"].items() for i in range(len(m["prompts"]))]


def test_the_llama_cpp_file_is_whole():
    assert GOLDEN.exists(), f"{GOLDEN} is missing: write it with benchmarks/llama_cpp_parity.py --write-golden"
    assert set(DATA["models"]) == {"gemma3-270m", "smollm2-135m"}
    # which llama.cpp wrote it: its version, its build's CPU features (the libggml-python wheel's ISA:
    # AVX2, not AVX-512; DESIGN.md §4.1) and the settings it ran with
    assert DATA["llama_cpp_python"] and DATA["ggml"] and DATA["build"] != "unknown"
    assert "AVX2 = 1" in DATA["system_info"] and "AVX512" not in DATA["system_info"]
    assert set(DATA["settings"]) >= {"n_threads", "use_extra_bufts", "flash_attn", "GGML_CPU_TILED_MM"}
    for m in DATA["models"].values():
        assert len(m["prompts"]) >= 5
        for p in m["prompts"]:
            assert len(p["ids"]) == len(p["second"]) == len(p["margins"]) == DATA["tokens"] == 32
            assert all(x >= 0 for x in p["margins"]) and p["input_ids"]


@pytest.fixture(scope="module")
def models(real_quantized):
    cache: dict[str, Transformer] = {}

    def get(alias: str) -> Transformer:
        if alias not in cache:
            cache[alias] = Transformer.local(real_quantized(alias, "gguf"))
        return cache[alias]

    return get


# Measured 2026-12-04 against llama-cpp-python 0.3.36 built with the wheel's ISA (AVX2/FMA/F16C, no
# AVX-512, no llamafile; the file records the build and settings), its defaults (CPU_REPACK on, flash
# attention off): 16 of 16 equal up to near-ties, 15 identical token for token; with the one-graph step
# on ggml's repacked Q4_K (as llama.cpp's CPU_REPACK) and Llama's q/k in the GGUF's order, its logits
# are llama.cpp's bit for bit. The one parting (Gemma "Once upon a time", token 10, margin 0.061) is
# llama.cpp's tiled K-quant product for prompts of >= 8 rows (ggml 0.25), which the wheel's ggml 0.20
# lacks; with it off (GGML_CPU_TILED_MM=0) 16 of 16 are identical (DESIGN.md §4.1).


@pytest.mark.slow
@pytest.mark.parametrize("alias,index", CASES, ids=[f"{a}-{i}" for a, i in CASES])
def test_gguf_vindex_greedy_equals_llama_cpp(models, alias, index):
    p = DATA["models"][alias]["prompts"][index]
    m = models(alias)
    assert m.engine() is not None  # the one-graph step is what runs by default on the gguf vindex
    got = list(m.generate(p["input_ids"], DATA["tokens"], stop_ids=[]))
    for k, (ours, theirs) in enumerate(zip(got, p["ids"], strict=True)):
        if ours != theirs:
            assert p["margins"][k] < DATA["near_tie"], (
                f"{p['prompt']!r}: parts from llama.cpp at token {k} (ours {ours}, llama.cpp {theirs}) where "
                f"llama.cpp's top-2 margin is {p['margins'][k]:.3f}, not a near-tie")
            assert ours == p["second"][k], f"{p['prompt']!r}: at the near-tie, token {ours} is not llama.cpp's runner-up"
            break
