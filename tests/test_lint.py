"""Lint and types are part of the suite: ruff (pyflakes, pycodestyle, import order, bugbear) over the
code, mypy over the package, both clean."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.multiprocess


def test_ruff_is_clean():
    r = subprocess.run([sys.executable, "-m", "ruff", "check", "larql_edge", "tests", "benchmarks", "loadtests"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr


def test_mypy_is_clean():
    r = subprocess.run([sys.executable, "-m", "mypy"], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout + r.stderr
