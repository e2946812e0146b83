"""The folder tree is the architecture: imports flow one way, down the layers of docs/architecture.md.

    base (errors, config, console) < format, wire < model < net < service < roles < tools < testing

A module imports from its own layer or below, never above; a role never imports another role.
"""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "larql_edge"
RANK = {"errors": 0, "config": 0, "console": 0, "format": 1, "wire": 1, "model": 2, "net": 3, "service": 4, "roles": 5,
        "tools": 6, "testing": 7}


def _layer(module: str) -> tuple[str, str | None]:
    parts = module.split(".")
    top = parts[1] if len(parts) > 1 else ""
    sub = parts[2] if top == "roles" and len(parts) > 2 else None
    return top, sub


def _imports(path: Path) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append(node.module)
        elif isinstance(node, ast.Import):
            out += [a.name for a in node.names]
    return [m for m in out if m.startswith("larql_edge.")]


def test_imports_flow_down_the_layers():
    bad = []
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG.parent).with_suffix("")
        module = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
        top, role = _layer(module)
        if top not in RANK:
            continue
        for imp in _imports(path):
            itop, irole = _layer(imp)
            if itop not in RANK:
                continue
            if RANK[itop] > RANK[top]:
                bad.append(f"{module} imports {imp} (layer {itop} is above {top})")
            elif top == itop == "roles" and role != irole:
                bad.append(f"{module} imports {imp} (a role never imports another role)")
    assert not bad, "\n".join(bad)


def test_every_package_is_in_a_layer():
    tops = {p.name for p in PKG.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    mods = {p.stem for p in PKG.glob("*.py") if p.stem != "__init__"}
    assert tops | mods == set(RANK)
