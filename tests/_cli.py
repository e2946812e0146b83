"""Run a command-line tool's ``main`` in this process, as a user would run the console script."""

from __future__ import annotations

import contextlib
import io
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class Run:
    returncode: int
    stdout: str
    stderr: str


def run_cli(main: Callable[[list[str]], int], *args: str) -> Run:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(args))
        except SystemExit as e:  # argparse's usage errors
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    return Run(int(code or 0), out.getvalue(), err.getvalue())


def slicer(*args: str) -> Run:
    from larql_edge.tools.slicer.cli import main

    return run_cli(main, *args)


def larql(*args: str) -> Run:
    from larql_edge.roles.client.cli import main

    return run_cli(main, *args)
