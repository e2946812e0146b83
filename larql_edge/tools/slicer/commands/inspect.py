from __future__ import annotations

import argparse
import json

from larql_edge.config import Flags
from larql_edge.console import human
from larql_edge.errors import SetupError
from larql_edge.format.vindex import Vindex


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("inspect", help="show a vindex's model, level, dtype and files (or, with --backend, "
                                       "the compute backend: kernel library, version, CPU features)")
    p.add_argument("vindex", metavar="VINDEX", nargs="?")
    flags = Flags(p)
    flags.switch("--json", help="machine-readable output")
    flags.switch("--backend", help="show the compute backend this process would use (no VINDEX needed)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.backend:
        from larql_edge.model.backend import backend_info

        b = backend_info()
        if args.json:
            print(json.dumps(b, indent=2))
        else:
            print(f"Backend     {b['backend']}")
            for key, label in (("library", "Library"), ("version", "Version"), ("build", "Build"), ("path", "Path"),
                               ("cpu_features", "CPU"), ("threads", "Threads")):
                if key in b:
                    v = b[key]
                    print(f"{label:<11} {' '.join(v) if isinstance(v, list) else v}")
        if args.vindex is None:
            return 0
        print()
    if args.vindex is None:
        raise SetupError("give a VINDEX to inspect (or --backend)")
    vx = Vindex.open(args.vindex)
    ix = vx.index
    files = {f.name: f.stat().st_size for f in vx.files()}
    info = {
        "path": str(vx.path),
        "model": vx.model,
        "family": vx.family,
        "extract_level": ix.extract_level,
        "dtype": ix.dtype,
        "quant": ix.quant,
        "tied": vx.tied,
        "has_model_weights": ix.has_model_weights,
        "num_layers": vx.num_layers,
        "hidden_size": vx.hidden_size,
        "intermediate_size": ix.intermediate_size,
        "vocab_size": vx.vocab_size,
        "embed_scale": ix.embed_scale,
        "files": files,
    }
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    links = {f.name for f in vx.files() if f.is_symlink()}
    print(f"Vindex      {info['path']}")
    print(f"Model       {info['model']}  (family {info['family']})")
    print(f"Level       {info['extract_level']}   dtype {info['dtype']}   quant {info['quant']}   "
          f"lm_head {'tied to embeddings' if info['tied'] else 'separate (lm_head.bin)'}")
    print(f"Shape       {info['num_layers']} layers, hidden {info['hidden_size']}, "
          f"intermediate {info['intermediate_size']}, vocab {info['vocab_size']:,}")
    print("Files")
    for name, size in files.items():
        note = f"  -> {(vx.path / name).readlink()}" if name in links else ""
        print(f"  {name:<28} {human(size):>10}{note}")
    on_disk = sum(size for name, size in files.items() if name not in links)
    print(f"  {'total on disk':<28} {human(on_disk):>10}")
    return 0
