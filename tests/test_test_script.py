"""scripts/test's whole-suite run: the image build beside the fast tier, its status, and Ctrl-C.

The script runs as it is, copied beside stand-ins for what it calls (scripts/setup, a `docker` on
PATH, docker/build-images.sh, the venv's python running pytest): those are what would take half an
hour here, and what is checked is the script's own control flow around them.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests._swarm import _alive, _wait_gone

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.multiprocess


@pytest.fixture
def clone(tmp_path):
    (tmp_path / "scripts").mkdir()
    (tmp_path / "docker").mkdir()
    (tmp_path / "venv" / "bin").mkdir(parents=True)
    (tmp_path / "bin").mkdir()
    shutil.copy(ROOT / "scripts" / "test", tmp_path / "scripts" / "test")
    stubs = {
        "scripts/setup": "#!/bin/sh\nexit 0\n",
        "bin/docker": "#!/bin/sh\nexit 0\n",  # `docker version` answers: an engine is there
        # the build records its pid (to look for it afterwards), then works for BUILD_S seconds
        "docker/build-images.sh": '#!/bin/bash\necho $$ > "$MARK/build.pid"\nsleep "$BUILD_S"\n'
                                  'date +%s.%N > "$MARK/build.done"\necho\necho "build-images: ${BUILD_S}s in all (builder: stand-in)"\n'
                                  'echo "  image larql-ffn   1s"\nexit "$BUILD_RC"\n',
        # pytest: logs its tier and when it ran, then works for PYTEST_S seconds
        "venv/bin/python": '#!/bin/bash\necho "$(date +%s.%N) $*" >> "$MARK/pytest.log"\nsleep "$PYTEST_S"\n',
    }
    for rel, text in stubs.items():
        p = tmp_path / rel
        p.write_text(text)
        p.chmod(0o755)
    return tmp_path


def _env(clone: Path, **kw: str) -> dict[str, str]:
    env = dict(os.environ, PATH=f"{clone / 'bin'}:{os.environ['PATH']}", LARQL_VENV=str(clone / "venv"),
               MARK=str(clone), BUILD_S="1", BUILD_RC="0", PYTEST_S="0")
    env.pop("TEST_WORKERS", None)
    env.update(kw)
    return env


def test_the_build_runs_beside_the_fast_tier_and_the_slow_tier_waits_for_it(clone):
    r = subprocess.run([str(clone / "scripts" / "test")], env=_env(clone, BUILD_S="3", PYTEST_S="1"),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    runs = [ln.split(" ", 1) for ln in (clone / "pytest.log").read_text().splitlines()]
    assert [args for _, args in runs] == [
        "-m pytest --durations=25 -n 3 --dist loadfile -m not slow", "-m pytest --durations=25 -m slow"]
    fast_at, slow_at = (float(t) for t, _ in runs)
    build_done = float((clone / "build.done").read_text())
    assert fast_at < build_done, "the fast tier waited for the build"
    assert build_done <= slow_at, "the slow tier started before the build was done"
    assert "build-images: 3s in all" in r.stdout and "image larql-ffn" in r.stdout  # the build's summary


def test_a_failed_build_fails_the_suite_with_its_log_and_the_slow_tier_still_runs(clone):
    r = subprocess.run([str(clone / "scripts" / "test")], env=_env(clone, BUILD_RC="3"),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 3
    assert "docker/build-images.sh failed (exit 3" in r.stderr
    assert "build-images: 1s in all" in r.stdout  # the whole log is shown
    assert len((clone / "pytest.log").read_text().splitlines()) == 2


def test_ctrl_c_during_the_fast_tier_stops_the_build_too(clone):
    # A terminal's Ctrl-C: SIGINT to the foreground process group, with SIGINT at its default (a
    # suite launched in the background would inherit it ignored).
    p = subprocess.Popen([str(clone / "scripts" / "test")], env=_env(clone, BUILD_S="60", PYTEST_S="60"),
                         start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    build_pid = None
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not (build_pid and (clone / "pytest.log").exists()):
            if (clone / "build.pid").exists() and (clone / "build.pid").read_text().strip():
                build_pid = int((clone / "build.pid").read_text())
            time.sleep(0.1)
        assert build_pid and _alive(build_pid), "the build did not start"
        os.killpg(p.pid, signal.SIGINT)
        _, err = p.communicate(timeout=20)
        assert p.returncode == 130, err
        assert "stopped the image build" in err
        assert not _wait_gone([build_pid], 10), "the image build was left running after Ctrl-C"
        assert len((clone / "pytest.log").read_text().splitlines()) == 1  # no slow tier after it
    finally:
        for pid in (p.pid, build_pid):
            if pid:
                try:
                    os.killpg(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        if p.poll() is None:
            p.wait(10)
