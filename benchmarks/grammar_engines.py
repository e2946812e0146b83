"""Grammar engines for structured output: the allowed-token mask's time per token on a real vocabulary.

    python benchmarks/grammar_engines.py [--model gemma3-270m] [--out benchmarks/results/grammar_engines.txt]

For each candidate engine (llguidance, outlines-core, xgrammar: whichever imports here) and each of the
20 schemas of `larql_edge.testing.schemas`: the grammar's compile time, then a walk through the
tokens of that schema's valid instance (as the model's tokenizer encodes it), timing the mask of every
step (``f32``-free: a bitmask of ``ceil(vocab / 32)`` words) and the advance by the token. The baseline,
measured in the same run, is the lm_head product of one row (the work a decode step does per sequence
on the embed server), so the ratio says what share of a step's head the mask adds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

for _v in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "RAYON_NUM_THREADS"):
    os.environ[_v] = "1"

import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from larql_edge.format.vindex import Vindex  # noqa: E402
from larql_edge.testing.schemas import SCHEMAS  # noqa: E402


def _instance_ids(tok, instance) -> list[int]:
    return tok.encode(json.dumps(instance), add_special_tokens=False).ids


# json.dumps' separators, no free whitespace (a small model given free whitespace may emit it forever).
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class Llguidance:
    name = "llguidance"

    def __init__(self, tokenizer_json: str, vocab: int, eos: int):
        import llguidance

        self.llg = llguidance
        self.tok = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab, eos_token=eos)
        self.words = (vocab + 31) // 32

    def compile(self, schema: dict):
        g = self.llg.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_STYLE)
        m = self.llg.LLMatcher(self.tok, g, log_level=0)
        if m.is_error():
            raise RuntimeError(m.get_error())
        return m

    def mask(self, m, out: np.ndarray) -> None:
        m.unsafe_compute_mask_ptr(out.ctypes.data, out.nbytes)

    def advance(self, m, token: int) -> bool:
        return m.consume_token(token)


class OutlinesCore:
    name = "outlines-core"

    def __init__(self, tokenizer_json: str, vocab: int, eos: int):
        import outlines_core
        from outlines_core.json_schema import build_regex_from_schema

        self.oc, self.regex = outlines_core, build_regex_from_schema
        # outlines-core wants each token's bytes: the tokenizer's pieces with the sentencepiece space
        # (U+2581), byte-fallback pieces <0xNN> and GPT-2's byte alphabet undone.
        spec = json.loads(tokenizer_json)
        pieces = spec["model"]["vocab"]
        items = pieces.items() if isinstance(pieces, dict) else ((p[0], i) for i, p in enumerate(pieces))
        byte_level = "ByteLevel" in json.dumps(spec.get("decoder") or {})
        unmap = _gpt2_unmap() if byte_level else None
        special = {t["id"] for t in spec.get("added_tokens", []) if t.get("special")}
        vmap: dict[bytes, list[int]] = {}
        for piece, i in items:
            if i == eos or i in special or i >= vocab:
                continue
            if unmap is not None:
                b = bytes(unmap.get(c, 0) for c in piece)
            elif len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                b = bytes([int(piece[3:5], 16)])
            else:
                b = piece.replace("\u2581", " ").encode()
            vmap.setdefault(b, []).append(i)
        self.vocab_obj = outlines_core.Vocabulary(eos, vmap)
        self.words = (vocab + 31) // 32

    def compile(self, schema: dict):
        index = self.oc.Index(self.regex(json.dumps(schema), r" ?"), self.vocab_obj)
        return self.oc.Guide(index)

    def mask(self, g, out: np.ndarray) -> None:
        g.write_mask_into(out.ctypes.data, out.size, 4)

    def advance(self, g, token: int) -> bool:
        g.advance(token, return_tokens=False)
        return True


def _gpt2_unmap() -> dict[str, int]:
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/grammar_engines.txt"))
    ap.add_argument("--engines", default="llguidance,outlines-core,xgrammar")
    ap.add_argument("--schemas", type=int, default=len(SCHEMAS), help="how many of the 20 schemas (outlines-core compiles slowly)")
    args = ap.parse_args()

    from larql_edge.model.spec import ModelSpec
    from larql_edge.roles.embed.head import LogitsHead
    from larql_edge.tools.slicer.cache import cached_vindex

    vx = Vindex.open(cached_vindex(args.model, level="all", dtype="f32", quant="none", log=lambda m: None))
    spec = ModelSpec.from_index(vx.index)
    vocab, eos = spec.vocab_size, spec.eos_token_ids[0]
    tok = vx.load_tokenizer()
    tjson = vx.tokenizer_path.read_text()

    head = LogitsHead(vx, spec, None)
    head.warm_up()
    x = np.random.default_rng(0).standard_normal((1, spec.hidden_size)).astype(np.float32)
    head_ms = []
    for _ in range(10):
        t0 = time.perf_counter()
        row = head.logits(x)[0]
        head_ms.append((time.perf_counter() - t0) * 1e3)
    base = statistics.median(head_ms)
    # The embed server's side of the mask: unpack 32 KB of bits and put -inf where they are 0.
    words = (vocab + 31) // 32
    bits = np.random.default_rng(1).integers(-(2**31), 2**31, words, dtype=np.int64).astype(np.int32)
    apply_ms = []
    for _ in range(20):
        t0 = time.perf_counter()
        allowed = np.unpackbits(bits.view(np.uint8), bitorder="little")[:vocab].astype(bool)
        np.where(allowed, row, np.float32(-np.inf))
        apply_ms.append((time.perf_counter() - t0) * 1e3)
    lines = [f"grammar engines, mask time per token: {args.model}, vocabulary {vocab} ({words * 4} bytes of bitmask), "
             f"{min(args.schemas, len(SCHEMAS))} schemas, 1 thread",
             f"baseline: lm_head of one row {base:.2f} ms (median of 10); applying a bitmask to a row "
             f"{statistics.median(apply_ms):.3f} ms ({statistics.median(apply_ms) / base:.3f}x)"]
    print("\n".join(lines), flush=True)

    for name in args.engines.split(","):
        try:
            if name == "llguidance":
                eng = Llguidance(tjson, vocab, eos)
            elif name == "outlines-core":
                t0 = time.perf_counter()
                eng = OutlinesCore(tjson, vocab, eos)
                print(f"  outlines-core vocabulary built in {time.perf_counter() - t0:.1f} s", flush=True)
            elif name == "xgrammar":
                import xgrammar  # noqa: F401  (needs torch, triton and transformers: not installed here)

                raise RuntimeError("xgrammar imported but has no driver in this benchmark")
            else:
                raise SystemExit(f"unknown engine {name!r}")
        except ImportError as e:
            line = f"{name:14s} not measured: does not import here ({e})"
            print(line, flush=True)
            lines.append(line)
            continue
        compile_ms, mask_ms, adv_ms, failures = [], [], [], []
        for sname, schema, instance in SCHEMAS[: args.schemas]:
            t0 = time.perf_counter()
            try:
                m = eng.compile(schema)
            except Exception as e:  # an engine that cannot compile a schema: counted, reported
                failures.append(f"{sname}: compile: {str(e)[:80]}")
                continue
            compile_ms.append((time.perf_counter() - t0) * 1e3)
            out = np.zeros(eng.words, dtype=np.int32)
            ok = True
            for t in _instance_ids(tok, instance):
                t0 = time.perf_counter()
                eng.mask(m, out)
                t1 = time.perf_counter()
                if not (out[t >> 5] >> (t & 31)) & 1:
                    failures.append(f"{sname}: token {t} ({tok.decode([t])!r}) not allowed")
                    ok = False
                    break
                eng.advance(m, t)
                t2 = time.perf_counter()
                mask_ms.append((t1 - t0) * 1e3)
                adv_ms.append((t2 - t1) * 1e3)
            if ok:
                eng.mask(m, out)
                if not (out[eos >> 5] >> (eos & 31)) & 1:
                    failures.append(f"{sname}: EOS not allowed at the end")
        p50 = statistics.median(mask_ms) if mask_ms else float("nan")
        p99 = sorted(mask_ms)[int(0.99 * (len(mask_ms) - 1))] if mask_ms else float("nan")
        nan = float("nan")
        mean = statistics.fmean(mask_ms) if mask_ms else nan
        line = (f"{name:14s} compile p50 {statistics.median(compile_ms) if compile_ms else nan:8.1f} ms  "
                f"max {max(compile_ms, default=nan):8.1f} ms | mask p50 {p50:.3f} ms p99 {p99:.3f} ms "
                f"mean {mean:.3f} ms ({p50 / base:.1e}x the lm_head row; mean {mean / base:.1e}x) | "
                f"advance p50 {statistics.median(adv_ms) if adv_ms else nan:.3f} ms | {len(mask_ms)} tokens, "
                f"{len(failures)} failures")
        print(line, flush=True)
        lines.append(line)
        lines += [f"    {f}" for f in failures[:10]]
    lines.append("xgrammar: pip requires torch, triton and transformers (several GB with CUDA wheels from PyPI); "
                 "not installed on this CPU-only, numpy-only stack" if "xgrammar" in args.engines else "")
    Path(args.out).write_text("\n".join(line for line in lines if line) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
