"""What every command-line tool shares: running a parsed command, and human-readable sizes.

`run_command` is the CLIs' one boundary: an error of the tree (`LarqlError`) or of the machine
(`OSError`: a full disk, a folder we may not write) is one line on stderr and its exit code, never
a traceback; Ctrl-C is exit 130. Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import sys

from larql_edge.errors import LarqlError

INTERRUPTED = 130


def human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _os_error_text(e: OSError) -> str:
    where = f": {e.filename}" if e.filename else ""
    return f"{e.strerror or type(e).__name__}{where}"


def run_command(prog: str, args: argparse.Namespace) -> int:
    """Run ``args.func(args)`` (a parsed subcommand) and turn its expected failures into exit codes."""
    name = f"{prog} {args.command}" if getattr(args, "command", None) else prog
    try:
        return int(args.func(args) or 0)
    except LarqlError as e:
        print(f"{name}: error: {e}", file=sys.stderr)
        return e.exit_code
    except OSError as e:
        print(f"{name}: error: {_os_error_text(e)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"\n{name}: interrupted", file=sys.stderr)
        return INTERRUPTED
