"""Greedy continuations of larql-edge's quantized vindexes against llama.cpp's on the same GGUF.

    python benchmarks/llama_cpp_parity.py [--tokens 16] [--out benchmarks/results/llama_cpp_parity.txt]

Needs ``llama_cpp`` (llama-cpp-python; it compiles from its sdist, ~11 min on 2 cores:
``pip wheel --no-deps llama-cpp-python``), which the project does not depend on. For each golden
prompt of both packaged models, llama.cpp (2 threads) and larql-edge's local forward on the
``gguf`` and ``q4k`` vindexes (compact backend) decode greedily from the golden input ids; a
token where they part is reported with llama.cpp's own top-2 margin at that step (a near-tie,
under 0.5 logits, is where two correct implementations of the same weights may differ).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

for _v in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_v] = "1"
ROOT = Path(__file__).resolve().parent.parent
GOLDEN = ROOT / "tests" / "data" / "golden"
MODELS = {"gemma3-270m": "gemma-3-270m.json", "smollm2-135m": "smollm2-135m-instruct.json"}


def llama_cpp_greedy(gguf: Path, prompts: list[list[int]], tokens: int) -> list[tuple[list[int], list[float]]]:
    import numpy as np
    from llama_cpp import Llama

    # logits_all: m.scores then holds every evaluated position's logits (a short context keeps that
    # table small: 128 x 262,144 floats for Gemma).
    m = Llama(model_path=str(gguf), n_threads=2, n_ctx=128, verbose=False, logits_all=True)
    out = []
    for ids in prompts:
        m.reset()
        m.eval(ids)
        toks, margins = [], []
        for _ in range(tokens):
            scores = np.asarray(m.scores[m.n_tokens - 1], dtype=np.float64)
            top2 = np.sort(scores)[-2:]
            t = int(np.argmax(scores))
            toks.append(t)
            margins.append(float(top2[1] - top2[0]))
            m.eval([t])
        out.append((toks, margins))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "llama_cpp_parity.txt"))
    args = ap.parse_args()
    try:
        import llama_cpp
    except ImportError:
        print("llama_cpp (llama-cpp-python) is not installed: nothing to compare against", file=sys.stderr)
        return 2
    from larql_edge.model.forward import Transformer
    from larql_edge.tools.slicer.cache import cached_vindex
    from larql_edge.tools.slicer.extract import resolve

    lines = [f"llama.cpp {llama_cpp.__version__} (llama-cpp-python, 2 threads) vs larql-edge (compact backend), "
             f"greedy, {args.tokens} tokens from the golden input ids"]
    for alias, golden_file in MODELS.items():
        golden = json.loads((GOLDEN / golden_file).read_text())
        prompts = [p["input_ids"] for p in golden["prompts"]]
        _, gguf = resolve(alias)
        ref = llama_cpp_greedy(Path(gguf), prompts, args.tokens)
        for quant in ("gguf", "q4k"):
            model = Transformer.local(cached_vindex(alias, quant=quant, log=lambda m: None))
            same = 0
            for p, ids, (want, margins) in zip(golden["prompts"], prompts, ref, strict=True):
                got = list(model.generate(ids, args.tokens, stop_ids=[]))
                k = next((i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b), None)
                if k is None:
                    same += 1
                    verdict = "identical"
                else:
                    tie = "a near-tie" if margins[k] < 0.5 else "NOT a near-tie"
                    verdict = f"parts at token {k} (llama.cpp's top-2 margin there {margins[k]:.3f}: {tie})"
                lines.append(f"  {alias:<13} {quant:<5} {p['prompt'][:40]!r:<44} {verdict}")
            lines.append(f"  {alias:<13} {quant:<5} identical on {same} of {len(prompts)} prompts")
    text = "\n".join(lines)
    print(text)
    Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
