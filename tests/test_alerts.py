"""The alert rules (deploy/prometheus/alerts.yml) and the Prometheus config that loads them, with the
real promtool and prometheus (Debian's `prometheus` package: `apt-get install prometheus`).

- promtool accepts the config and the rules, and the rules' unit tests pass;
- every alert has a unit test in which it fires and one in which it stays silent;
- Prometheus, started with exactly the image's command line, loads every rule and has its
  lifecycle and admin endpoints off (the image's port is published).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import httpx
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
PROM = ROOT / "deploy" / "prometheus"
RULES, RULE_TESTS, CONFIG = PROM / "alerts.yml", PROM / "alerts.test.yml", PROM / "prometheus.yml"
DOCKERFILE = ROOT / "docker" / "Dockerfile.prometheus"
FORBIDDEN_FLAGS = ("--web.enable-lifecycle", "--web.enable-admin-api")


def _tool(name: str) -> str:
    path = shutil.which(name) or (f"/usr/bin/{name}" if os.access(f"/usr/bin/{name}", os.X_OK) else None)
    if path is None:
        msg = f"{name} not found: apt-get install prometheus"
        if os.environ.get("CI"):
            pytest.fail(msg)
        pytest.skip(msg)
    return path


def _promtool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([_tool("promtool"), *args], capture_output=True, text=True, timeout=120, cwd=PROM)


def _alert_names() -> list[str]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [r["alert"] for g in groups for r in g["rules"] if "alert" in r]


@pytest.mark.multiprocess
def test_promtool_accepts_the_config_and_the_rules():
    r = _promtool("check", "config", str(CONFIG))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "1 rule files found" in r.stdout + r.stderr  # the config really loads alerts.yml
    r = _promtool("check", "rules", str(RULES))
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"SUCCESS: {len(_alert_names())} rules found" in r.stdout + r.stderr


@pytest.mark.multiprocess
def test_alert_rule_unit_tests_pass():
    r = _promtool("test", "rules", str(RULE_TESTS))
    assert r.returncode == 0, (r.stdout + r.stderr)[-8000:]
    assert "SUCCESS" in r.stdout


def test_every_alert_has_a_firing_and_a_silent_case():
    names = _alert_names()
    assert len(names) == len(set(names)), "duplicate alert names"
    fires: set[str] = set()
    silent: set[str] = set()
    for case in yaml.safe_load(RULE_TESTS.read_text())["tests"]:
        for t in case.get("alert_rule_test", []):
            (fires if t.get("exp_alerts") else silent).add(t["alertname"])
    assert set(names) - fires == set(), "alerts never tested firing"
    assert set(names) - silent == set(), "alerts never tested silent"
    assert (fires | silent) <= set(names), f"tests of alerts that do not exist: {(fires | silent) - set(names)}"


def test_the_requested_alerts_exist():
    """The issue's list: member down, uncovered layers, error ratio, p99, hot-cache hit ratio,
    memory, serve queue saturation."""
    names = set(_alert_names())
    for wanted in ("LarqlTargetDown", "LarqlLayersUncovered", "LarqlEmbedErrorRatioHigh", "LarqlFfnErrorRatioHigh",
                   "LarqlRouterErrorRatioHigh", "LarqlServeErrorRatioHigh", "LarqlEmbedLatencyP99High",
                   "LarqlFfnLatencyP99High", "LarqlRouterLatencyP99High", "LarqlHotCacheHitRatioLow",
                   "LarqlMemoryHigh", "LarqlMemoryGrowing", "LarqlServeQueueSaturated", "LarqlServeShedding"):
        assert wanted in names, wanted
    for group in yaml.safe_load(RULES.read_text())["groups"]:
        for rule in group["rules"]:
            assert rule["labels"]["severity"] in ("critical", "warning"), rule["alert"]
            assert rule["annotations"]["summary"] and rule["annotations"]["description"], rule["alert"]


def _image_command() -> list[str]:
    m = re.search(r"(?ms)^CMD\s+(\[.*?\])\s*$", DOCKERFILE.read_text().replace("\\\n", ""))
    assert m, "no JSON CMD in docker/Dockerfile.prometheus"
    return json.loads(m.group(1))


def test_no_lifecycle_or_admin_flags_in_the_image_or_compose():
    instructions = "\n".join(line for line in DOCKERFILE.read_text().splitlines() if not line.lstrip().startswith("#"))
    for flag in FORBIDDEN_FLAGS:
        assert flag not in instructions, flag
        assert flag not in _image_command(), flag
    compose = yaml.safe_load((ROOT / "compose.yaml").read_text())
    prom = compose["services"]["prometheus"]
    command = prom.get("command") or []
    command = command.split() if isinstance(command, str) else command
    entrypoint = prom.get("entrypoint") or []
    for flag in FORBIDDEN_FLAGS:
        assert not any(str(c).startswith(flag) for c in [*command, *entrypoint]), flag
    assert "--config.file=/etc/prometheus/prometheus.yml" in (command or _image_command())


@pytest.mark.multiprocess
def test_prometheus_with_the_image_command_loads_the_rules_and_refuses_lifecycle_and_admin(tmp_path):
    """The real prometheus, with the image's CMD (storage and listen address moved to this test)."""
    from larql_edge.tools.grid.supervisor import free_port

    port = free_port()
    argv = [_tool("prometheus")]
    for arg in _image_command():
        if arg.startswith("--config.file="):
            arg = f"--config.file={CONFIG}"
        elif arg.startswith("--storage.tsdb.path="):
            arg = f"--storage.tsdb.path={tmp_path / 'data'}"
        elif arg.startswith("--web.listen-address="):
            arg = f"--web.listen-address=127.0.0.1:{port}"
        argv.append(arg)
    log = tempfile.TemporaryFile()
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=tmp_path,
                            start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, f"prometheus exited {proc.returncode}"
            try:
                if httpx.get(url + "/-/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "prometheus not ready in 60 s"
            time.sleep(0.2)
        groups = httpx.get(url + "/api/v1/rules", timeout=5).json()["data"]["groups"]
        loaded = sorted(r["name"] for g in groups for r in g["rules"])
        assert loaded == sorted(_alert_names())
        assert all(r["health"] in ("ok", "unknown") for g in groups for r in g["rules"])
        # lifecycle off: reload and quit are refused, and Prometheus is still up afterwards
        for path in ("/-/reload", "/-/quit"):
            r = httpx.post(url + path, timeout=5)
            assert r.status_code == 403, (path, r.status_code, r.text)
        # admin API off
        r = httpx.post(url + "/api/v1/admin/tsdb/snapshot", timeout=5)
        assert r.status_code in (403, 404) or r.json().get("errorType") == "unavailable", r.text
        r = httpx.post(url + "/api/v1/admin/tsdb/delete_series", params={"match[]": "up"}, timeout=5)
        assert r.status_code in (403, 404) or r.json().get("errorType") == "unavailable", r.text
        assert proc.poll() is None and httpx.get(url + "/-/ready", timeout=2).status_code == 200
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        log.seek(0)
        print(log.read().decode(errors="replace")[-3000:])
        log.close()
