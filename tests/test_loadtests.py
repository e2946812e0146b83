"""The load tests (loadtests/) give verdicts: the scenarios file is consistent with the locust users,
the judge fails what misses a bound, and a 60 s run against real servers (embed server, nginx edge,
router and two FFN shards on Gemma 3 270M) passes every threshold of loadtests/scenarios.toml.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RUN = ROOT / "loadtests" / "run.py"
sys.path.insert(0, str(ROOT / "loadtests"))

import run as loadrun  # noqa: E402  (loadtests/run.py)


def _locust_user_classes() -> set[str]:
    """Concrete user classes of the locustfile, read without importing it (locust patches gevent)."""
    tree = ast.parse((ROOT / "loadtests" / "locustfile.py").read_text())
    out = set()
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            abstract = any(isinstance(s, ast.Assign) and any(getattr(t, "id", "") == "abstract" for t in s.targets)
                           for s in node.body)
            if not abstract and not node.name.startswith("_"):
                out.add(node.name)
    return out


def test_scenarios_use_existing_users_and_bound_every_route():
    scenarios = loadrun.load_scenarios()
    assert {"embed", "edge", "grid", "serve", "soak"} <= set(scenarios)
    users = _locust_user_classes()
    for sc in scenarios.values():
        assert set(sc.users) <= users, (sc.name, set(sc.users) - users)
        assert sc.max_failure_ratio == 0.0, sc.name
        assert sc.p99_ms and all(v > 0 for v in sc.p99_ms.values()), sc.name
        assert sc.clients >= 1 and sc.min_rps > 0, sc.name
        # request names start with the target of a user class the scenario runs
        targets = {"embed", "edge", "router", "serve"}
        assert {n.split()[0] for n in sc.p99_ms} <= targets, sc.name
    assert scenarios["edge"].min_hit_ratio is not None and "edge" in scenarios["edge"].needs
    assert "serve" in scenarios["serve"].needs and scenarios["serve"].users == ["ServeUser"]


def _stats(p99: float, failures: int = 0, rps: float = 100.0) -> dict:
    row = {"type": "GET", "requests": 1000, "failures": failures, "rps": rps, "p50_ms": 1.0, "p99_ms": p99, "max_ms": p99}
    return {"embed GET /v1/embed/{id}": dict(row), "Aggregated": dict(row)}


def test_judge_passes_within_bounds_and_fails_every_kind_of_miss():
    sc = loadrun.Scenario(name="t", description="", needs=["embed"], users=["EmbedRowUser"], clients=1,
                          max_failure_ratio=0.0, min_rps=10, p99_ms={"embed GET /v1/embed/{id}": 50}, min_hit_ratio=0.5)
    hits = {"x_cache": {"HIT": 80, "MISS": 20, "other": 0}}
    assert loadrun.judge(sc, _stats(40), hits)[0]
    assert not loadrun.judge(sc, _stats(60), hits)[0]                       # p99 over its bound
    assert not loadrun.judge(sc, _stats(40, failures=1), hits)[0]           # one failure
    assert not loadrun.judge(sc, _stats(40, rps=5), hits)[0]                # too little load
    assert not loadrun.judge(sc, _stats(40), {"x_cache": {"HIT": 20, "MISS": 80, "other": 0}})[0]  # hit ratio
    assert not loadrun.judge(sc, _stats(40), {})[0]                         # no X-Cache seen at all
    unbounded = _stats(40)
    unbounded["embed GET /v1/stats"] = dict(unbounded["Aggregated"])
    ok, lines = loadrun.judge(sc, unbounded, hits)
    assert not ok and any("no p99 bound" in line for line in lines)          # a route nobody bounds
    missing = {"Aggregated": _stats(40)["Aggregated"]}
    assert not loadrun.judge(sc, missing, hits)[0]                           # a bounded route never ran


def test_durations_parse():
    assert loadrun.parse_duration("60") == 60 and loadrun.parse_duration("60s") == 60
    assert loadrun.parse_duration("10m") == 600 and loadrun.parse_duration("1h30m") == 5400
    for bad in ("", "0", "ten", "5x"):
        with pytest.raises(argparse.ArgumentTypeError):
            loadrun.parse_duration(bad)


@pytest.mark.multiprocess
def test_serve_scenario_without_a_server_is_a_setup_error(tmp_path):
    # Never a skip (CI fails skips): run.py finds larql-serve on PATH only, so a PATH without it is a machine
    # where it is not installed, whether or not this one has it.
    import os
    import shutil

    path = os.pathsep.join(d for d in os.environ.get("PATH", "").split(os.pathsep)
                           if d and shutil.which("larql-serve", path=d) is None)
    r = subprocess.run([sys.executable, str(RUN), "serve", "-d", "5s", "--out", str(tmp_path)], capture_output=True,
                       text=True, timeout=120, cwd=ROOT, env=dict(os.environ, PATH=path))
    assert r.returncode == 2 and "--serve URL" in r.stderr, r.stderr


@pytest.mark.slow
def test_a_missed_bound_exits_nonzero(tiny_models, tmp_path):
    """run.py against a real (tiny) embed server with a bound nobody can meet: exit 1, FAIL in the verdict."""
    strict = tmp_path / "strict.toml"
    strict.write_text('[scenario.strict]\nneeds = ["embed"]\nusers = ["EmbedRowUser"]\nclients = 2\nmin_rps = 1\n'
                      '[scenario.strict.p99_ms]\n"embed GET /v1/embed/{id}" = 0.001\n"embed GET /v1/embed/{id}.json" = 0.001\n')
    out = tmp_path / "report"
    r = subprocess.run([sys.executable, str(RUN), "strict", "--scenarios", str(strict), "-d", "5s", "--vindex",
                        str(tiny_models["gemma3"]), "--out", str(out)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 1, r.stdout + r.stderr
    # Never silent for long (starting servers and the run itself took 50-114 s with no output):
    # a line per stage and every few seconds of the run, on stderr even though it is not a terminal.
    for line in ("starting larql-embed", "larql-embed ready", "warming up", "locust: 2 users for 5s", "locust: done"):
        assert line in r.stderr, r.stderr
    assert re.search(r"locust: \d+s of 5s", r.stderr), r.stderr
    verdict = json.loads((out / "verdict.json").read_text())
    assert verdict["passed"] is False
    assert any(c.startswith("FAIL") and "p99" in c for c in verdict["checks"])
    assert any(c.startswith("PASS") and "failures 0" in c for c in verdict["checks"])


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_ci_load_run_60s_passes_every_threshold(gemma_f16, tmp_path):
    """The soak scenario for 60 s: embed server, nginx edge, router and two shards on Gemma 3 270M."""
    out = tmp_path / "report"
    r = subprocess.run([sys.executable, str(RUN), "soak", "-d", "60s", "--vindex", str(gemma_f16), "--out", str(out)],
                       capture_output=True, text=True, timeout=800, cwd=ROOT)
    print(r.stdout)
    assert r.returncode == 0, (r.stdout + r.stderr)[-6000:]
    verdict = json.loads((out / "verdict.json").read_text())
    assert verdict["passed"] and verdict["seconds"] == 60
    assert all(c.startswith("PASS") for c in verdict["checks"])
    for report in ("locust_stats.csv", "locust_failures.csv", "locust_stats_history.csv", "locust.html", "verdict.txt"):
        assert (out / report).stat().st_size > 0, report
    stats = verdict["stats"]
    for name in ("embed GET /v1/embed/{id}", "edge GET /v1/embed/{id}", "router STEP token", "router POST /v1/walk-ffn"):
        assert stats[name]["requests"] > 0, name


@pytest.mark.multiprocess
def test_cpu_hogs_stop_by_themselves_when_nobody_stops_them():
    """A crashed test process never runs `cpu_hogs`'s finally: the hogs carry their own time limit."""
    import time

    from larql_edge.testing.load import cpu_hogs

    with cpu_hogs(1, limit_s=2) as proc:
        assert proc is not None and proc.poll() is None  # running
        deadline = time.monotonic() + 30
        while proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert proc.poll() is not None, "stress-ng ran past its --timeout"
