"""Command-line flags with ``LARQL_`` environment twins, parsed in one place.

Every flag of every role is declared through `Flags.add`, so its environment twin is derived the
same way everywhere (``--hot-cache`` -> ``LARQL_HOT_CACHE``) and ``--help`` shows it. Secrets (the
Hub token, the grid key) are marked ``secret``: their values never appear in ``--help`` or logs.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Sequence
from typing import Any

TRUE = {"1", "true", "yes", "on"}
FALSE = {"0", "false", "no", "off", ""}


def env_name(flag: str) -> str:
    return "LARQL_" + flag.lstrip("-").replace("-", "_").upper()


def parse_bool(text: str) -> bool:
    t = text.strip().lower()
    if t in TRUE:
        return True
    if t in FALSE:
        return False
    raise argparse.ArgumentTypeError(f"expected a boolean (true/false), got {text!r}")


class Flags:
    def __init__(self, parser: argparse.ArgumentParser):
        self.parser = parser

    def add(
        self,
        flag: str,
        *,
        type: Callable[[str], Any] = str,
        default: Any = None,
        help: str = "",
        secret: bool = False,
        env: str | None = None,
        **kw: Any,
    ) -> None:
        name = env or env_name(flag)
        raw = os.environ.get(name)
        value = default
        if raw is not None and raw != "":
            try:
                value = type(raw)
            except (ValueError, argparse.ArgumentTypeError) as e:
                self.parser.error(f"{name}={'***' if secret else raw!r}: {e}")
        shown = "(set)" if secret and value else ("(unset)" if secret else default)
        text = f"{help} [env {name}; default: {shown}]"
        self.parser.add_argument(flag, type=type, default=value, help=text, **kw)

    def switch(self, flag: str, *, help: str = "", env: str | None = None) -> None:
        name = env or env_name(flag)
        raw = os.environ.get(name)
        default = parse_bool(raw) if raw else False
        self.parser.add_argument(flag, action="store_true", default=default, help=f"{help} [env {name}]")


def positional_list_from_env(values: Sequence[str], env: str) -> list[str]:
    """Positional lists (e.g. VINDEX paths) fall back to a whitespace-separated env twin."""
    if values:
        return list(values)
    raw = os.environ.get(env, "")
    return raw.split()
