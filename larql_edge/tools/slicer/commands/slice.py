from __future__ import annotations

import argparse

from larql_edge.tools.slicer.slice import ALIASES, PARTS, PRESETS, describe, slice_vindex


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "slice",
        help="carve a vindex into a deployment preset (hardlinks when possible)",
        description="Carve a vindex into a deployment variant without re-extracting. Presets: "
        + "; ".join(f"{k}: {'+'.join(v)}" for k, v in PRESETS.items() if k != "all")
        + f"; all: every part. Aliases: {', '.join(f'{a}={t}' for a, t in ALIASES.items())}.",
    )
    p.add_argument("src", metavar="SRC", help="the source vindex")
    p.add_argument("-o", "--output", required=True, metavar="DST", help="the slice folder to create")
    p.add_argument("--preset", help="a preset name (see above)")
    p.add_argument("--parts", default="", help=f"comma-separated parts, united with the preset ({', '.join(PARTS)})")
    p.add_argument("--force", action="store_true", help="replace DST if it exists")
    p.add_argument("--dry-run", action="store_true", help="print the plan; write nothing")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    plan = slice_vindex(args.src, args.output, preset=args.preset, parts=args.parts.split(","),
                        force=args.force, dry_run=args.dry_run)
    what = args.preset or "+".join(plan.parts)
    print(f"{'Plan for' if args.dry_run else 'Sliced'} {plan.src} -> {plan.dst} [{what}]")
    for line in describe(plan, dry_run=args.dry_run):
        print(line)
    return 0
