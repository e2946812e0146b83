from __future__ import annotations

import argparse

from larql_edge.format.vindex import Vindex


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("verify", help="recompute every checksum of a vindex; exit 1 on any problem")
    p.add_argument("vindex", metavar="VINDEX")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    vx = Vindex.open(args.vindex)
    problems = vx.verify()
    if problems:
        for line in problems:
            print(f"FAIL {line}")
        print(f"{vx.path}: {len(problems)} problem(s)")
        return 1
    print(f"{vx.path}: OK ({len(vx.checksums)} files verified)")
    return 0
