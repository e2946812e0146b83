from __future__ import annotations

import argparse
import json

from larql_edge.format.vindex import Vindex


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("inspect", help="show a vindex's model, level, dtype and files")
    p.add_argument("vindex", metavar="VINDEX")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run)


def human(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def run(args: argparse.Namespace) -> int:
    vx = Vindex.open(args.vindex)
    ix = vx.index
    files = {f.name: f.stat().st_size for f in vx.files()}
    info = {
        "path": str(vx.path),
        "model": vx.model,
        "family": vx.family,
        "extract_level": ix.get("extract_level"),
        "dtype": ix.get("dtype"),
        "tied": vx.tied,
        "has_model_weights": ix.get("has_model_weights"),
        "num_layers": vx.num_layers,
        "hidden_size": vx.hidden_size,
        "intermediate_size": ix.get("intermediate_size"),
        "vocab_size": vx.vocab_size,
        "embed_scale": ix.get("embed_scale"),
        "files": files,
    }
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    print(f"Vindex      {info['path']}")
    print(f"Model       {info['model']}  (family {info['family']})")
    print(f"Level       {info['extract_level']}   dtype {info['dtype']}   "
          f"lm_head {'tied to embeddings' if info['tied'] else 'separate (lm_head.bin)'}")
    print(f"Shape       {info['num_layers']} layers, hidden {info['hidden_size']}, "
          f"intermediate {info['intermediate_size']}, vocab {info['vocab_size']:,}")
    print("Files")
    for name, size in files.items():
        print(f"  {name:<24} {human(size):>10}")
    print(f"  {'total':<24} {human(sum(files.values())):>10}")
    return 0
