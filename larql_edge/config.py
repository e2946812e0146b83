"""Configuration, parsed in one place: command-line flags with ``LARQL_`` environment twins, and the
few settings every process reads from the environment.

Every flag of every CLI is declared through `Flags`, so its environment twin is derived the same
way everywhere (``--hot-cache`` -> ``LARQL_HOT_CACHE``) and ``--help`` shows it. A flag given on the
command line beats its twin. Secrets (the Hub token, the grid key) are marked ``secret``: their
values never appear in ``--help``, logs or error messages, and each has a ``_FILE`` twin, as a flag
(``--grid-key-file PATH``) and in the environment (``LARQL_GRID_KEY_FILE``), because Docker Swarm and
Kubernetes hand secrets to a process as files.

Process-wide settings (`cache_dir`, `backend_name`) are read here and nowhere else.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from larql_edge.errors import SetupError

TRUE = {"1", "true", "yes", "on"}
FALSE = {"0", "false", "no", "off", ""}
BLAS_ENV = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")
SECRET_MAX_BYTES = 64 << 10


def env_name(flag: str, prefix: str = "LARQL_") -> str:
    return prefix + flag.lstrip("-").replace("-", "_").upper()


def parse_bool(text: str) -> bool:
    t = text.strip().lower()
    if t in TRUE:
        return True
    if t in FALSE:
        return False
    raise argparse.ArgumentTypeError(f"expected a boolean (true/false), got {text!r}")


def read_secret_file(path: str, what: str) -> str:
    """The secret held in a file (one trailing newline stripped); the message never holds the value."""
    try:
        with open(path, "rb") as f:
            data = f.read(SECRET_MAX_BYTES + 1)
    except OSError as e:
        raise ValueError(f"{what} {path}: cannot read it ({e.strerror or type(e).__name__})") from None
    if len(data) > SECRET_MAX_BYTES:
        raise ValueError(f"{what} {path}: larger than {SECRET_MAX_BYTES} bytes: not a secret file")
    try:
        text = data.decode("utf-8").rstrip("\r\n")
    except UnicodeDecodeError:
        raise ValueError(f"{what} {path}: not UTF-8 text") from None
    if not text:
        raise ValueError(f"{what} {path}: the file is empty")
    return text


def _non_negative(type: Callable[[str], Any]) -> Callable[[str], Any]:
    """Every numeric flag is a size, count, port, time or seed: a negative one (``--hot-cache -5``)
    is a usage error, not silently 0 rows; a float must also be finite."""

    def parse(text: str) -> Any:
        value = type(text)
        if value != value or value in (float("inf"), float("-inf")):
            raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
        if value < 0:
            raise argparse.ArgumentTypeError(f"must be >= 0, got {text!r}")
        return value

    parse.__name__ = type.__name__  # argparse's "invalid int value: 'x'" names the base type
    return parse


class _SecretFile(argparse.Action):
    """``--x-file PATH``: read the secret now and store it where ``--x`` would."""

    def __call__(self, parser, namespace, values, option_string=None):
        try:
            setattr(namespace, self.dest, read_secret_file(str(values), option_string or "secret file"))
        except ValueError as e:
            parser.error(str(e))


class Flags:
    """Declares flags on one argparse parser (a CLI or one of its subcommands)."""

    def __init__(self, parser: argparse.ArgumentParser | argparse._ActionsContainer, prefix: str = "LARQL_",
                 owner: argparse.ArgumentParser | None = None):
        """``parser`` may be an argument group; then ``owner`` is the parser that reports errors."""
        self.parser = parser
        self.prefix = prefix
        self.owner = owner or parser

    def _error(self, message: str) -> None:
        self.owner.error(message)  # type: ignore[attr-defined]

    def _env_default(self, name: str, type: Callable[[str], Any], default: Any, secret: bool) -> Any:
        raw = os.environ.get(name)
        if raw is None or raw == "":
            return default
        try:
            return type(raw)
        except (ValueError, argparse.ArgumentTypeError) as e:
            self._error(f"{name}={'***' if secret else repr(raw)}: {e}")

    def add(
        self,
        *names: str,
        type: Callable[[str], Any] = str,
        default: Any = None,
        help: str = "",
        secret: bool = False,
        env: str | None = None,
        required: bool = False,
        path_twin: bool = False,
        **kw: Any,
    ) -> None:
        """``add("--output", "-o", ...)``: the first long name gives the env twin (or ``env=``).

        ``path_twin``: the flag names a file (a certificate, a key) and has ``_FILE`` twins too
        (``--x-file PATH``, ``LARQL_X_FILE``), the names Swarm and Kubernetes deployments use for
        mounted secrets; they mean the same as ``--x``."""
        long = next(n for n in names if n.startswith("--"))
        name = env or env_name(long, self.prefix)
        if type in (int, float):
            type = _non_negative(type)
        value = self._env_default(name, type, default, secret)
        file_env = name + "_FILE"
        if path_twin and value in (None, "") and os.environ.get(file_env):
            value = os.environ[file_env]
        if secret and value in (None, "") and os.environ.get(file_env):
            try:
                value = read_secret_file(os.environ[file_env], file_env)
            except ValueError as e:
                self._error(str(e))
        if required and value is not None:
            required = False  # the environment twin provides it
        shown = ("(set)" if value else "(unset)") if secret else default
        text = f"{help} [env {name}{' or ' + file_env if secret or path_twin else ''}; default: {shown}]"
        if required:
            text = f"{help} (required) [env {name}]"
        self.parser.add_argument(*names, type=type, default=value, help=text, required=required, **kw)
        if secret:
            dest = long.lstrip("-").replace("-", "_")
            self.parser.add_argument(f"{long}-file", dest=dest, action=_SecretFile, metavar="PATH",
                                     help=f"read {long} from this file (a mounted secret) [env {file_env}]")
        elif path_twin:
            dest = long.lstrip("-").replace("-", "_")
            self.parser.add_argument(f"{long}-file", dest=dest, metavar="PATH", default=argparse.SUPPRESS,
                                     help=f"the same as {long} [env {file_env}]")

    def switch(self, *names: str, help: str = "", env: str | None = None) -> None:
        long = next(n for n in names if n.startswith("--"))
        name = env or env_name(long, self.prefix)
        raw = os.environ.get(name)
        try:
            default = parse_bool(raw) if raw else False
        except argparse.ArgumentTypeError as e:
            self._error(f"{name}={raw!r}: {e}")
        self.parser.add_argument(*names, action="store_true", default=default, help=f"{help} [env {name}]")

    def toggle(self, name: str, *, default: bool, help: str = "", env: str | None = None) -> None:
        """``--x`` / ``--no-x`` (argparse's BooleanOptionalAction), the twin taking true/false."""
        var = env or env_name(name, self.prefix)
        raw = os.environ.get(var)
        try:
            value = parse_bool(raw) if raw else default
        except argparse.ArgumentTypeError as e:
            self._error(f"{var}={raw!r}: {e}")
        self.parser.add_argument(name, action=argparse.BooleanOptionalAction, default=value,
                                 help=f"{help} [env {var}; default: {str(default).lower()}]")

    def choice(self, *names: str, choices: Sequence[str], default: str, help: str = "", env: str | None = None) -> None:
        long = next(n for n in names if n.startswith("--"))
        name = env or env_name(long, self.prefix)
        value = os.environ.get(name) or default
        if value not in choices:
            self._error(f"{name}={value!r}: choose one of {', '.join(choices)}")
        self.parser.add_argument(*names, choices=choices, default=value, help=f"{help} [env {name}; default: {default}]")


def positional_list_from_env(values: Sequence[str], env: str) -> list[str]:
    """Positional lists (e.g. VINDEX paths) fall back to a whitespace-separated env twin."""
    if values:
        return list(values)
    return os.environ.get(env, "").split()


# -- process-wide settings ------------------------------------------------------------------------


def cache_dir() -> Path:
    """Where extracted vindexes, slices and lm_head compute copies are cached (``LARQL_CACHE_DIR``)."""
    return Path(os.environ.get("LARQL_CACHE_DIR") or Path.home() / ".cache" / "larql-edge")


def backend_name() -> str:
    """``LARQL_BACKEND``: ``compact``, ``numpy``, ``mlx`` or empty (choose automatically)."""
    wanted = os.environ.get("LARQL_BACKEND", "").strip().lower()
    if wanted not in ("", "compact", "numpy", "mlx"):
        raise ValueError(f"LARQL_BACKEND={wanted!r}: expected compact, numpy or mlx")
    return wanted


def graph_mode() -> str:
    """``LARQL_GRAPH``: ``auto`` (default: a local model on compact weights runs each step as one ggml
    graph), ``on`` (also on float32 weights) or ``off`` (layer by layer, product by product)."""
    wanted = os.environ.get("LARQL_GRAPH", "").strip().lower() or "auto"
    aliases = {"1": "on", "true": "on", "yes": "on", "0": "off", "false": "off", "no": "off"}
    wanted = aliases.get(wanted, wanted)
    if wanted not in ("auto", "on", "off"):
        raise ValueError(f"LARQL_GRAPH={wanted!r}: expected auto, on or off")
    return wanted


def kernel_threads() -> int | None:
    """``LARQL_KERNEL_THREADS``: threads one compact-weight product may use (None: every CPU allowed)."""
    env = os.environ.get("LARQL_KERNEL_THREADS", "").strip()
    if not env:
        return None
    try:
        n = int(env)
    except ValueError:
        n = 0
    if n < 1:
        raise SetupError(f"LARQL_KERNEL_THREADS={env!r}: expected a positive integer")
    return n


def export_blas_threads(threads: int) -> None:
    """Pin BLAS/OpenMP threads for this process's libraries yet to load and for its children."""
    for var in BLAS_ENV:
        os.environ[var] = str(threads)
