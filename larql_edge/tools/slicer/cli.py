"""larql-slicer: build, inspect, verify, slice, publish and pull vindexes.

Each subcommand lives in ``slicer/commands/<name>.py`` and registers itself; this module only
dispatches and turns every LarqlError into one line on stderr and a non-zero exit.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys

from larql_edge.tools.slicer.errors import LarqlError

COMMANDS = ("extract", "slice", "publish", "pull", "inspect", "verify")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="larql-slicer",
        description="Build a LARQL vindex from a real model, slice it into per-role presets, "
        "publish it to and pull it from a Hugging Face Hub.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS:
        if importlib.util.find_spec(f"larql_edge.tools.slicer.commands.{name}") is not None:
            importlib.import_module(f"larql_edge.tools.slicer.commands.{name}").register(sub)
    return parser


def run_command(prog: str, args: argparse.Namespace, errors: tuple[type[Exception], ...] = (LarqlError,)) -> int:
    """Run a parsed subcommand of any larql CLI: an expected error is one line on stderr and exit 1
    (never a traceback), Ctrl-C is exit 130."""
    try:
        return int(args.func(args) or 0)
    except errors as e:
        print(f"{prog} {args.command}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"\n{prog} {args.command}: interrupted", file=sys.stderr)
        return 130


def main(argv: list[str] | None = None) -> int:
    return run_command("larql-slicer", build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
