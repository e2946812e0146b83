"""Greedy continuations of larql-edge's quantized vindexes against llama.cpp's on the same GGUF.

    python benchmarks/llama_cpp_parity.py [--tokens 32] [--quants gguf,q4k] [--no-extra-buffers] [--flash-attn]
                                          [--no-tiled-mm] [--out benchmarks/results/llama_cpp_parity.txt]
    python benchmarks/llama_cpp_parity.py --write-golden tests/data/llama_cpp_greedy.json [--build "CMAKE_ARGS"]

Needs ``llama_cpp`` (llama-cpp-python; it compiles from its sdist, ~11-20 min on 2 cores:
``pip wheel --no-deps llama-cpp-python``), which the project does not depend on. For each prompt of
both packaged models (the golden prompts and a few more), llama.cpp (1 thread) decodes greedily from
the prompt's ids and records, per step, its token, its runner-up and its own top-2 logit margin.

``--write-golden`` writes those records to a JSON file that CI checks the gguf vindex against
(`tests/test_llama_cpp_parity.py`: llama.cpp is too slow to build there). Without it, larql-edge's
local forward on the ``gguf`` and ``q4k`` vindexes (default backend) decodes the same prompts and a
token where they part is reported with llama.cpp's margin there: under 0.1 logit is a near-tie,
where two correct implementations of the same weights may differ. llama.cpp's own run is also judged
against the golden file by the same rule (its agreement with itself under this run's settings).

llama.cpp's defaults are kept unless a flag says otherwise: ``--no-extra-buffers`` turns off its extra
weight buffer types (CPU_REPACK / AMX: repacked weights with their own kernels; llama-cpp-python 0.3.36's
AMX path segfaults in decode on this container's Sapphire Rapids CPU, so runs here need it),
``--flash-attn`` turns on flash attention (llama-cli's default is auto, llama-cpp-python's off),
``--no-tiled-mm`` sets ``GGML_CPU_TILED_MM=0``: ggml 0.25's tiled K-quant kernel for products of >= 8
rows (a prompt's prefill; Q6_K here), which the libggml-python wheel (ggml 0.20) does not have.

The reference build (DESIGN.md §4.1): llama-cpp-python built with the ISA of the libggml-python wheel
our kernels come from (CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON
-DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX512=OFF -DGGML_LLAMAFILE=OFF -DGGML_AMX_TILE=OFF
-DGGML_AMX_INT8=OFF" pip wheel --no-deps llama-cpp-python==0.3.36), so that both sides run ggml's AVX2
kernels; a native build (AVX-512, llamafile's tinyBLAS) sums attention in other orders.
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
sys.path.insert(0, str(ROOT))
GOLDEN = ROOT / "tests" / "data" / "golden"
MODELS = {"gemma3-270m": "gemma-3-270m.json", "smollm2-135m": "smollm2-135m-instruct.json"}
EXTRA_PROMPTS = ["The quick brown fox", "Water boils at a temperature of", "Once upon a time, in a small village,",
                 "import numpy as np\n", "The three primary colors are"]
NEAR_TIE = 0.1


def prompts_for(alias: str) -> list[dict]:
    """The golden prompts (their own ids) and the extra ones, tokenized by the model's tokenizer."""
    from tokenizers import Tokenizer

    from larql_edge.format.vindex import Vindex
    from larql_edge.tools.slicer.cache import cached_vindex

    golden = json.loads((GOLDEN / MODELS[alias]).read_text())
    out = [{"prompt": p["prompt"], "input_ids": list(p["input_ids"])} for p in golden["prompts"]]
    tok = Tokenizer.from_file(str(Vindex.open(cached_vindex(alias, quant="gguf", log=lambda m: None)).tokenizer_path))
    out += [{"prompt": t, "input_ids": tok.encode(t).ids} for t in EXTRA_PROMPTS]
    return out


def llama_cpp_greedy(gguf: Path, prompts: list[list[int]], tokens: int, extra_buffers: bool = True,
                     flash_attn: bool = False) -> list[dict]:
    import llama_cpp.llama as llama_py
    import numpy as np
    from llama_cpp import Llama

    # `Llama` does not expose llama_model_params.use_extra_bufts: its defaults are wrapped for the load.
    low = llama_py.llama_cpp
    default_params = low.llama_model_default_params

    def params():
        p = default_params()
        p.use_extra_bufts = extra_buffers
        return p

    low.llama_model_default_params = params
    try:
        # logits_all: m.scores then holds every evaluated position's logits (a short context keeps that
        # table small: 128 x 262,144 floats for Gemma).
        m = Llama(model_path=str(gguf), n_threads=1, n_threads_batch=1, n_ctx=128, verbose=False, logits_all=True,
                  flash_attn=flash_attn)
    finally:
        low.llama_model_default_params = default_params
    out = []
    for ids in prompts:
        m.reset()
        m.eval(ids)
        rec: dict[str, list] = {"ids": [], "second": [], "margins": []}
        for _ in range(tokens):
            scores = np.asarray(m.scores[m.n_tokens - 1], dtype=np.float64)
            top2 = np.argsort(scores)[-2:]
            rec["ids"].append(int(top2[1]))
            rec["second"].append(int(top2[0]))
            rec["margins"].append(round(float(scores[top2[1]] - scores[top2[0]]), 5))
            m.eval([int(top2[1])])
        out.append(rec)
    return out


def _llama(fn, *args, **kwargs):
    """``fn`` run in a fresh process: llama.cpp's libggml (0.25) and the libggml-python wheel's (0.20)
    share their library names, so in one process one binds the other's symbols."""
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context

    with ProcessPoolExecutor(1, mp_context=get_context("spawn")) as ex:
        return ex.submit(fn, *args, **kwargs).result()


def _llama_info() -> dict:
    """llama-cpp-python's version, the ggml inside it (its own libggml-base) and its build's CPU features."""
    import ctypes

    import llama_cpp

    base = ctypes.CDLL(str(Path(llama_cpp.__file__).parent / "lib" / "libggml-base.so"))
    base.ggml_version.restype = base.ggml_commit.restype = ctypes.c_char_p
    return {"version": llama_cpp.__version__, "ggml": f"{base.ggml_version().decode()} (commit {base.ggml_commit().decode()})",
            "system_info": llama_cpp.llama_print_system_info().decode().strip()}


def parting(got: list[int], want: dict) -> str | None:
    """None when ``got`` is llama.cpp's continuation up to a near-tie (where they may part, to its
    runner-up: the rule of tests/test_llama_cpp_parity.py), else why not."""
    for k, (a, b) in enumerate(zip(got, want["ids"], strict=False)):
        if a != b:
            if want["margins"][k] < NEAR_TIE and a == want["second"][k]:
                return None
            if want["margins"][k] < NEAR_TIE:
                return f"parts at token {k} at a near-tie ({want['margins'][k]:.3f}), but to {a}, not the runner-up {want['second'][k]}"
            return f"parts at token {k}: {a}, llama.cpp {b} (its top-2 margin {want['margins'][k]:.3f} >= {NEAR_TIE})"
    if len(got) != len(want["ids"]):
        return f"{len(got)} tokens, llama.cpp {len(want['ids'])}"
    return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--quants", default="gguf,q4k")
    ap.add_argument("--write-golden", metavar="JSON", help="write llama.cpp's continuations to this file (no comparison)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "llama_cpp_parity.txt"))
    ap.add_argument("--no-extra-buffers", dest="extra_buffers", action="store_false",
                    help="llama.cpp without its extra weight buffer types (CPU_REPACK, AMX)")
    ap.add_argument("--flash-attn", action="store_true", help="llama.cpp with flash attention")
    ap.add_argument("--no-tiled-mm", dest="tiled_mm", action="store_false",
                    help="llama.cpp without ggml's tiled K-quant products (GGML_CPU_TILED_MM=0)")
    ap.add_argument("--build", default=os.environ.get("LLAMA_CPP_CMAKE_ARGS", ""),
                    help="how the llama-cpp-python in use was built (its CMAKE_ARGS), recorded in the golden file")
    args = ap.parse_args()
    settings = dict(extra_buffers=args.extra_buffers, flash_attn=args.flash_attn)
    if not args.tiled_mm:
        os.environ["GGML_CPU_TILED_MM"] = "0"  # read once, at ggml's first product
    import importlib.util

    if importlib.util.find_spec("llama_cpp") is None:
        print("llama_cpp (llama-cpp-python) is not installed: nothing to compare against", file=sys.stderr)
        return 2
    info = _llama(_llama_info)
    from larql_edge.model.forward import Transformer
    from larql_edge.tools.slicer.cache import cached_vindex
    from larql_edge.tools.slicer.extract import resolve

    if args.write_golden:
        data = {"about": "llama.cpp's greedy continuations of the packaged GGUFs (written by "
                         "benchmarks/llama_cpp_parity.py --write-golden; checked by tests/test_llama_cpp_parity.py)",
                "llama_cpp_python": info["version"], "ggml": info["ggml"], "build": args.build or "unknown",
                "system_info": info["system_info"],
                "settings": {"n_threads": 1, "n_ctx": 128, "use_extra_bufts": args.extra_buffers,
                             "flash_attn": args.flash_attn, "GGML_CPU_TILED_MM": int(args.tiled_mm)},
                "tokens": args.tokens, "near_tie": NEAR_TIE, "models": {}}
        for alias in MODELS:
            _, gguf = resolve(alias)
            ps = prompts_for(alias)
            ref = _llama(llama_cpp_greedy, Path(gguf), [p["input_ids"] for p in ps], args.tokens, **settings)
            data["models"][alias] = {"gguf_file": Path(gguf).name,
                                     "prompts": [{**p, **r} for p, r in zip(ps, ref, strict=True)]}
        Path(args.write_golden).write_text(json.dumps(data, indent=1) + "\n")
        print(f"wrote {args.write_golden}")
        return 0

    golden_file = ROOT / "tests" / "data" / "llama_cpp_greedy.json"
    golden = json.loads(golden_file.read_text())["models"] if golden_file.exists() else {}
    from larql_edge.model.kernels import _ggml

    lines = [f"llama.cpp {info['version']} (llama-cpp-python, ggml {info['ggml']}, 1 thread, "
             f"{settings | {'tiled_mm': args.tiled_mm}}) vs larql-edge (default backend; ggml "
             f"{_ggml.lib().info()['version']}), greedy, {args.tokens} tokens; "
             f"a parting is allowed where llama.cpp's top-2 margin < {NEAR_TIE}, to its runner-up",
             f"llama.cpp system info: {info['system_info']}" + (f"; built with {args.build}" if args.build else "")]
    for alias in MODELS:
        _, gguf = resolve(alias)
        ps = prompts_for(alias)
        ref = _llama(llama_cpp_greedy, Path(gguf), [p["input_ids"] for p in ps], args.tokens, **settings)
        if alias in golden and args.tokens == 32:
            # llama.cpp itself (this run's settings) against the committed golden run, by the same rule
            gp = {p["prompt"]: p for p in golden[alias]["prompts"]}
            verdicts = [parting(r["ids"], gp[p["prompt"]]) for p, r in zip(ps, ref, strict=True) if p["prompt"] in gp]
            lines.append(f"  {alias:<13} llama.cpp (this run) vs the golden file: equal up to near-ties on "
                         f"{sum(v is None for v in verdicts)} of {len(verdicts)}")
            lines += [f"    {v}" for v in verdicts if v]
        for quant in args.quants.split(","):
            model = Transformer.local(str(cached_vindex(alias, quant=quant, log=lambda m: None)))
            same = ok = 0
            for p, want in zip(ps, ref, strict=True):
                got = list(model.generate(p["input_ids"], args.tokens, stop_ids=[]))
                k = next((i for i, (a, b) in enumerate(zip(got, want["ids"], strict=True)) if a != b), None)
                why = parting(got, want)
                ok += why is None
                if k is None:
                    same += 1
                    verdict = "identical"
                else:
                    verdict = why or f"parts at token {k} at a near-tie (llama.cpp's margin {want['margins'][k]:.3f})"
                lines.append(f"  {alias:<13} {quant:<5} {p['prompt'][:36]!r:<40} {verdict}")
            lines.append(f"  {alias:<13} {quant:<5} identical on {same} of {len(ps)} prompts, "
                         f"equal up to near-ties on {ok} of {len(ps)}")
    text = "\n".join(lines)
    print(text)
    Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
