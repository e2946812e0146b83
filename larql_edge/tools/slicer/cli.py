"""larql-slicer: build, inspect, verify, slice, publish and pull vindexes.

Each subcommand lives in ``larql_edge/tools/slicer/commands/<name>.py`` and registers itself; this
module only dispatches (through `larql_edge.console.run_command`: one line and a non-zero exit for
every error a user can cause).
"""

from __future__ import annotations

import argparse
import importlib
import sys

from larql_edge.console import run_command

COMMANDS = ("extract", "slice", "publish", "pull", "inspect", "verify")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="larql-slicer",
        description="Build a LARQL vindex from a real model, slice it into per-role presets, "
        "publish it to and pull it from a Hugging Face Hub. Every flag has a LARQL_ environment twin.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(f"larql_edge.tools.slicer.commands.{name}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    return run_command("larql-slicer", build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
