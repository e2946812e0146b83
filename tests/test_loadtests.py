"""The locust load tests run, bounded, against a real embed server and see no failures."""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

import pytest

from larql_edge.testing.servers import running_server

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]


def test_locust_embed_users_against_embed_server(tiny_models, tmp_path):
    with running_server("larql-embed", [str(tiny_models["gemma3"]), "--blas-threads", "1",
                                         "--lm-head-cache", str(tmp_path / "lmc")]) as srv:
        prefix = tmp_path / "locust"
        r = subprocess.run(
            [sys.executable, "-m", "locust", "-f", str(ROOT / "loadtests" / "locustfile.py"), "--headless",
             "-u", "4", "-r", "4", "-t", "6s", "--host", srv.url, "--csv", str(prefix), "--only-summary",
             "EmbedGetUser", "EmbedPostUser", "LogitsUser"],
            capture_output=True, text=True, timeout=120, cwd=ROOT,
        )
        assert r.returncode == 0, r.stderr[-3000:]
    with open(f"{prefix}_stats.csv") as f:
        rows = {row["Name"]: row for row in csv.DictReader(f)}
    agg = rows["Aggregated"]
    assert int(agg["Request Count"]) > 20
    assert int(agg["Failure Count"]) == 0
    for name in ("/v1/embed/{id}", "/v1/embed (32 ids)", "/v1/logits top-k"):
        assert int(rows[name]["Request Count"]) > 0, name
