"""Configuration is parsed in one place: every flag of every CLI has its environment twin, secrets
have file twins and never show, and a twin holding garbage is a one-line usage error."""

from __future__ import annotations

import argparse
import contextlib
import io

import pytest

from tests._cli import run_cli

CLIS = {
    "larql-slicer": "larql_edge.tools.slicer.cli",
    "larql-embed": "larql_edge.roles.embed.cli",
    "larql-ffn": "larql_edge.roles.ffn.cli",
    "larql-router": "larql_edge.roles.router.cli",
    "larql": "larql_edge.roles.client.cli",
    "larql-grid": "larql_edge.tools.grid.cli",
    "larql-serve": "larql_edge.roles.serve.cli",
    "larql-delay-proxy": "larql_edge.tools.delay_proxy",
}


def _parsers(p: argparse.ArgumentParser, name: str, path: tuple[str, ...] = ()):
    yield name, p, path
    for action in p._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub, sp in action.choices.items():
                yield from _parsers(sp, f"{name} {sub}", (*path, sub))


@pytest.mark.parametrize("cli", sorted(CLIS))
def test_every_flag_has_an_env_twin(cli):
    import importlib

    parser = importlib.import_module(CLIS[cli]).build_parser()
    seen = 0
    for name, p, _ in _parsers(parser, cli):
        for action in p._actions:
            if not action.option_strings or isinstance(action, argparse._HelpAction):
                continue
            seen += 1
            assert action.help and "[env " in action.help, f"{name} {action.option_strings}: no environment twin"
    assert seen >= 3


def test_secrets_never_show_and_have_file_twins(monkeypatch, tmp_path):
    from larql_edge.roles.router.cli import build_parser

    monkeypatch.setenv("LARQL_GRID_KEY", "s3cret-value")
    text = build_parser().format_help()
    assert "s3cret-value" not in text and "(set)" in text and "--grid-key-file" in text and "LARQL_GRID_KEY_FILE" in text


def test_a_bad_twin_is_a_usage_error(monkeypatch):
    from larql_edge.roles.ffn.cli import main

    monkeypatch.setenv("LARQL_PORT", "eighty")
    r = run_cli(main, "x")
    assert r.returncode == 2 and "LARQL_PORT='eighty'" in r.stderr and "Traceback" not in r.stderr


def test_slicer_flags_take_their_twins(monkeypatch, tiny_models, tmp_path):
    from larql_edge.tools.slicer.cli import main

    monkeypatch.setenv("LARQL_OUTPUT", str(tmp_path / "from-env"))
    monkeypatch.setenv("LARQL_PRESET", "attn")
    r = run_cli(main, "slice", str(tiny_models["gemma3"]))
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "from-env" / "attn_weights.bin").is_file()


def _numeric_flags():
    import importlib

    for cli in sorted(CLIS):
        parser = importlib.import_module(CLIS[cli]).build_parser()
        for name, p, path in _parsers(parser, cli):
            for action in p._actions:
                if action.option_strings and getattr(action.type, "__name__", "") in ("int", "float"):
                    yield cli, parser, path, max(action.option_strings, key=len), name


def test_every_numeric_flag_refuses_a_negative_value(monkeypatch):
    """``--hot-cache -5`` was accepted as 0 rows: every size, count, port and time of every CLI is
    refused when negative (flag or twin) with one usage line, the refusal living in `Flags`."""
    from larql_edge.config import env_name

    flags = list(_numeric_flags())
    assert len(flags) >= 30 and any(f[3] == "--hot-cache" for f in flags)
    for _cli, parser, path, flag, name in flags:
        for value in ("-5", "-0.5", "nan"):
            err = io.StringIO()
            with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as e:
                parser.parse_args([*path, f"{flag}={value}"])
            assert e.value.code == 2, f"{name} {flag}={value} accepted"
            last = err.getvalue().strip().splitlines()[-1]
            assert flag in last and (">= 0" in last or "finite" in last or "invalid" in last), f"{name}: {last}"
    monkeypatch.setenv(env_name("--hot-cache"), "-5")
    from larql_edge.roles.embed.cli import main

    r = run_cli(main, "x.vindex")
    assert r.returncode == 2 and "LARQL_HOT_CACHE='-5': must be >= 0" in r.stderr and "Traceback" not in r.stderr
