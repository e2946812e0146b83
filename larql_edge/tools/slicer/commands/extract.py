from __future__ import annotations

import argparse

from larql_edge.config import Flags
from larql_edge.format.index import EXTRACT_LEVELS, QUANTS
from larql_edge.format.vindex import DTYPES
from larql_edge.tools.slicer.extract import PACKAGED, extract


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "extract",
        help="build a vindex from a GGUF file, a Hugging Face folder or a packaged model",
        description="Build a LARQL v2 vindex. SOURCE is a .gguf file, a Hugging Face model folder "
        f"(config.json, *.safetensors, tokenizer.json), or a packaged model: {', '.join(PACKAGED)}.",
    )
    p.add_argument("source", metavar="SOURCE")
    f = Flags(p)
    f.add("--output", "-o", required=True, metavar="OUT", help="vindex folder to create")
    f.choice("--level", choices=EXTRACT_LEVELS, default="all", help="browse < attention < inference < all")
    f.choice("--dtype", choices=sorted(DTYPES), default="f16",
             help="storage dtype of the weight files (f32 is bit-exact to the dequantized source)")
    f.choice("--quant", choices=QUANTS, default="none",
             help="q4k: LARQL's quantized layout (Q4_K/Q6_K blocks; a GGUF's own Q4_K/Q6_K kept, other types "
                  "requantized as LARQL does); gguf: larql-edge's own variant keeping every GGUF tensor in its "
                  "block type (no requantization; LARQL cannot load it)")
    f.switch("--force", help="replace OUT if it is a vindex folder")
    f.switch("--quiet", help="no progress bars")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    extract(args.source, args.output, level=args.level, dtype=args.dtype, force=args.force, progress=not args.quiet,
            quant=args.quant)
    return 0
