from __future__ import annotations

import argparse

from larql_edge.tools.slicer.extract import PACKAGED, extract
from larql_edge.format.vindex import DTYPES, EXTRACT_LEVELS


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "extract",
        help="build a vindex from a GGUF file, a Hugging Face folder or a packaged model",
        description="Build a LARQL v2 vindex. SOURCE is a .gguf file, a Hugging Face model folder "
        f"(config.json, *.safetensors, tokenizer.json), or a packaged model: {', '.join(PACKAGED)}.",
    )
    p.add_argument("source", metavar="SOURCE")
    p.add_argument("-o", "--output", required=True, metavar="OUT", help="vindex folder to create")
    p.add_argument("--level", choices=EXTRACT_LEVELS, default="all",
                   help="browse < attention < inference < all (default: all)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="f16",
                   help="storage dtype of the weight files (default: f16; f32 is bit-exact to the dequantized source)")
    p.add_argument("--force", action="store_true", help="replace OUT if it exists")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    extract(args.source, args.output, level=args.level, dtype=args.dtype, force=args.force, progress=not args.quiet)
    return 0
