"""Configuration is parsed in one place: every flag of every CLI has its environment twin, secrets
have file twins and never show, and a twin holding garbage is a one-line usage error."""

from __future__ import annotations

import argparse

import pytest

from tests._cli import run_cli

CLIS = {
    "larql-slicer": "larql_edge.tools.slicer.cli",
    "larql-embed": "larql_edge.roles.embed.cli",
    "larql-ffn": "larql_edge.roles.ffn.cli",
    "larql-router": "larql_edge.roles.router.cli",
    "larql": "larql_edge.roles.client.cli",
    "larql-grid": "larql_edge.tools.grid.cli",
}


def _parsers(p: argparse.ArgumentParser, name: str):
    yield name, p
    for action in p._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub, sp in action.choices.items():
                yield from _parsers(sp, f"{name} {sub}")


@pytest.mark.parametrize("cli", sorted(CLIS))
def test_every_flag_has_an_env_twin(cli):
    import importlib

    parser = importlib.import_module(CLIS[cli]).build_parser()
    seen = 0
    for name, p in _parsers(parser, cli):
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
