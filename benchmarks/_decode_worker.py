"""One decode measurement in a process of its own (benchmarks/quantized.py starts it per configuration).

    python benchmarks/_decode_worker.py VINDEX [--ffn URL --embed URL] [--tokens 32] [--rounds 3]

Prints one JSON line: the best tokens/s of greedy decode (prefill excluded) over the rounds, the
generated ids and this process's peak RSS. ``LARQL_BACKEND`` chooses the compute backend.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

for _v in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_v] = "1"
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import psutil  # noqa: E402

from larql_edge.format.vindex import Vindex  # noqa: E402
from larql_edge.model.forward import Transformer  # noqa: E402

PROMPT = [2, 818, 5279, 529, 7001, 563]  # Gemma's "The capital of France is"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("vindex")
    ap.add_argument("--ffn")
    ap.add_argument("--embed")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt-ids", default=None, help="comma-separated prompt ids (default: a Gemma prompt)")
    args = ap.parse_args()
    ids = [int(i) for i in args.prompt_ids.split(",")] if args.prompt_ids else PROMPT
    if args.ffn:
        from larql_edge.net.remote import RemoteSettings
        from larql_edge.roles.client._build import build_remote

        model = build_remote(Vindex.open(args.vindex), RemoteSettings(ffn=args.ffn, embed=args.embed, timeout=120.0, retries=2))
    else:
        model = Transformer.local(args.vindex)
    rates, out = [], []
    model.next_logits(ids, model.new_cache())  # warm: kernels, page cache, connections
    for _ in range(args.rounds):
        cache = model.new_cache()
        logits = model.next_logits(ids, cache)
        out = []
        t0 = time.perf_counter()
        for _ in range(args.tokens):
            tok = int(np.argmax(logits))
            out.append(tok)
            logits = model.next_logits([tok], cache)
        rates.append(args.tokens / (time.perf_counter() - t0))
    peak = psutil.Process().memory_info().rss
    print(json.dumps({"rate": max(rates), "rates": rates, "ids": out, "rss_mb": round(peak / 2**20, 1)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
