from __future__ import annotations

import argparse

from larql_edge.config import Flags
from larql_edge.format.presets import ALIASES, PARTS, PRESETS
from larql_edge.tools.slicer.slice import describe, slice_vindex


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "slice",
        help="carve a vindex into a deployment preset (hardlinks when possible)",
        description="Carve a vindex into a deployment variant without re-extracting. Presets: "
        + "; ".join(f"{k}: {'+'.join(v)}" for k, v in PRESETS.items() if k != "all")
        + f"; all: every part. Aliases: {', '.join(f'{a}={t}' for a, t in ALIASES.items())}.",
    )
    p.add_argument("src", metavar="SRC", help="the source vindex")
    f = Flags(p)
    f.add("--output", "-o", required=True, metavar="DST", help="the slice folder to create")
    f.add("--preset", help="a preset name (see above)")
    f.add("--parts", default="", help=f"comma-separated parts, united with the preset ({', '.join(PARTS)})")
    f.switch("--force", help="replace DST if it is a vindex folder")
    f.switch("--dry-run", help="print the plan; write nothing")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    plan = slice_vindex(args.src, args.output, preset=args.preset, parts=args.parts.split(","),
                        force=args.force, dry_run=args.dry_run)
    what = args.preset or "+".join(plan.parts)
    print(f"{'Plan for' if args.dry_run else 'Sliced'} {plan.src} -> {plan.dst} [{what}]")
    for line in describe(plan, dry_run=args.dry_run):
        print(line)
    return 0
