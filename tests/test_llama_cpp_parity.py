"""The gguf vindex decodes what llama.cpp decodes from the same GGUF: an independent implementation.

llama.cpp cannot be built under CI (its sdist compiles for ~15 min on 2 cores), so its greedy
continuations are a committed file, `tests/data/llama_cpp_greedy.json`, written by
``python benchmarks/llama_cpp_parity.py --write-golden tests/data/llama_cpp_greedy.json`` with
llama-cpp-python (version in the file) on the packaged GGUFs: per prompt and step, llama.cpp's token,
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


# Measured 2026-12-04 (llama-cpp-python 0.3.36): 14 of 16 continuations equal llama.cpp's up to
# near-ties; two part just above the 0.1 bound, each to llama.cpp's runner-up. The cause, traced op by
# op with llama.cpp's own tensors (DESIGN.md §4.1, benchmarks/llama_cpp_trace.py): attention's float16
# products sum the same exact terms in another order (llama.cpp's native build: llamafile's 16-lane
# AVX-512 tinyBLAS; the libggml-python wheel: 8-lane AVX2 vec_dot), ~1e-7 relative, amplified to 0.2-0.4
# logit by float16 softmax @ V and 8-bit activations; llama.cpp itself moves as much between its own
# settings (15 of 16 without its repacked Q4_K, 12 of 16 with flash attention, same rule). Strict, so a
# fix turns them red.
KNOWN_PARTING = {
    ("gemma3-270m", 0): "parts at token 18 at a 0.116 margin (llama.cpp's runner-up): attention's f16 summation "
                        "order (tinyBLAS AVX-512 vs the wheel's AVX2 vec_dot), DESIGN.md §4.1; issue 17",
    ("smollm2-135m", 4): "parts at token 9 at a 0.175 margin (llama.cpp's runner-up): attention's f16 summation "
                         "order (tinyBLAS AVX-512 vs the wheel's AVX2 vec_dot), DESIGN.md §4.1; issue 17",
}


@pytest.mark.slow
@pytest.mark.parametrize("alias,index", [
    pytest.param(a, i, marks=pytest.mark.xfail(reason=KNOWN_PARTING[(a, i)], strict=True)) if (a, i) in KNOWN_PARTING
    else (a, i) for a, i in CASES], ids=[f"{a}-{i}" for a, i in CASES])
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
