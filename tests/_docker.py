"""Docker helpers for the container tests: the engine rule, the image build, containers on a private
network (testcontainers, Ryuk disabled), and cleanup of everything a test session creates.

The rule (as tests/test_base_image.py): with no reachable Docker engine the tests skip, except
under CI (env CI set), where that is a failure: CI machines of this project have an engine.

Every container, network and volume made here is named ``larql-test-...`` and labelled with the
session id, and is removed when its test ends, failure or not; `purge_session` removes anything of
the session left behind (a test killed mid-way), at the end of the session.
"""

from __future__ import annotations

import os

# Before testcontainers is imported anywhere: Ryuk is an image we could not pull (no registry).
os.environ["TESTCONTAINERS_RYUK_DISABLED"] = "true"

import json
import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from larql_edge.tools.grid.supervisor import free_port  # noqa: F401  (the tests call dk.free_port)

ROOT = Path(__file__).resolve().parents[1]
BUILD_IMAGES = ROOT / "docker" / "build-images.sh"
INSTALL_COMPOSE = ROOT / "docker" / "install-compose.sh"
TAG = os.environ.get("LARQL_IMAGE_TAG", "latest")
SESSION = uuid.uuid4().hex[:8]
LABEL = "larql-test-session"
PREFIX = f"larql-test-{SESSION}"
BUILD_TIMEOUT = float(os.environ.get("LARQL_IMAGE_BUILD_TIMEOUT", 45 * 60))


def image(role: str) -> str:
    return f"larql-{role}:{TAG}"


# ---- the engine rule ---------------------------------------------------------------------------

def engine_problem() -> str | None:
    if shutil.which("docker") is None:
        return "docker CLI not found"
    try:
        proc = subprocess.run(["docker", "version", "--format", "{{.Server.Version}}"],
                              capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        return "docker version timed out"
    if proc.returncode != 0 or not proc.stdout.strip():
        return f"no Docker engine reachable: {proc.stderr.strip()[:300]}"
    return None


def require_engine() -> None:
    problem = engine_problem()
    if problem:
        if os.environ.get("CI"):
            pytest.fail(f"CI is set but {problem}")
        pytest.skip(problem)


def client():
    import docker

    return docker.from_env(timeout=300)


# ---- running commands ----------------------------------------------------------------------------

def run(cmd, *, timeout: float, env: dict | None = None, check: bool = True, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=timeout, cwd=cwd,
                          env=None if env is None else {**os.environ, **env}, stdin=subprocess.DEVNULL)
    if check and proc.returncode != 0:
        pytest.fail(f"command failed ({proc.returncode}): {' '.join(map(str, cmd))}\n"
                    f"--- stdout ---\n{proc.stdout[-5000:]}\n--- stderr ---\n{proc.stderr[-5000:]}")
    return proc


def build_images() -> dict:
    """docker/build-images.sh once: base images, wheelhouse, every image. Returns its timings."""
    t0 = time.monotonic()
    proc = run(["bash", BUILD_IMAGES, "--tag", TAG], timeout=BUILD_TIMEOUT)
    seconds = time.monotonic() - t0
    report = proc.stderr[proc.stderr.rfind("build-images:"):]
    print(f"\n[containers] docker/build-images.sh took {seconds:.0f}s\n{report}")
    return {"seconds": seconds, "report": report}


# ---- containers on a private network ----------------------------------------------------------

class Grid:
    """Containers on one user-defined bridge network, addressed by name; removed on exit.

    Ports are published on 127.0.0.1 only (random host ports), so the host reaches a container
    the way a user would, and nothing is reachable from elsewhere.
    """

    def __init__(self, name: str):
        from testcontainers.core.network import Network

        self.name = f"{PREFIX}-{name}"
        self.network = Network(docker_network_kw={"labels": {LABEL: SESSION}, "driver": "bridge"})
        self.network.name = self.name
        self.containers: dict[str, object] = {}
        self.docker = client()

    def __enter__(self) -> "Grid":
        self.network.create()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        for c in reversed(list(self.containers.values())):
            try:
                c.stop()  # removes the container (force) and its anonymous volumes
            except Exception:
                pass
        self.containers.clear()
        try:
            self.network.remove()
        except Exception:
            pass

    def start(self, alias: str, role: str, *, command: list[str] | None = None, env: dict | None = None,
              ports: tuple[int, ...] = (), entrypoint: list[str] | None = None, **docker_kwargs):
        from testcontainers.core.container import DockerContainer

        c = (DockerContainer(image(role))
             .with_name(f"{self.name}-{alias}")
             .with_network(self.network)
             .with_network_aliases(alias))
        for k, v in (env or {}).items():
            c.with_env(k, v)
        for p in ports:
            c.ports[f"{p}/tcp"] = ("127.0.0.1", None)
        if command:
            c.with_command(command)
        kwargs = {"labels": {LABEL: SESSION}, **docker_kwargs}  # e.g. read_only=True, tmpfs={...}
        # testcontainers >= 4.15 passes its own tmpfs= to create(): mounts go through its setter.
        for path, opts in kwargs.pop("tmpfs", {}).items():
            c.tmpfs[path] = opts
        if entrypoint:
            kwargs["entrypoint"] = entrypoint
        c.with_kwargs(**kwargs)
        self.containers[alias] = c
        c.start()
        return c

    def wrapped(self, alias: str):
        return self.containers[alias].get_wrapped_container()

    def url(self, alias: str, port: int) -> str:
        w = self.wrapped(alias)
        w.reload()
        binding = w.attrs["NetworkSettings"]["Ports"][f"{port}/tcp"][0]
        return f"http://127.0.0.1:{binding['HostPort']}"

    def wait_healthy(self, *aliases: str, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        pending = list(aliases)
        while pending:
            for alias in list(pending):
                w = self.wrapped(alias)
                w.reload()
                state = w.attrs["State"]
                if state["Status"] in ("exited", "dead"):
                    raise AssertionError(f"{alias} exited ({state.get('ExitCode')}):\n{self.logs(alias)}")
                if state.get("Health", {}).get("Status") == "healthy":
                    pending.remove(alias)
            if pending and time.monotonic() > deadline:
                raise AssertionError(f"not healthy after {timeout}s: {pending}\n"
                                     + "\n".join(f"--- {a} ---\n{self.logs(a)}" for a in pending))
            if pending:
                time.sleep(1)

    def logs(self, alias: str, tail: int = 60) -> str:
        try:
            return self.wrapped(alias).logs(tail=tail).decode(errors="replace")
        except Exception as e:  # noqa: BLE001 - diagnostics only
            return f"<no logs: {e}>"

    def run_once(self, alias: str, role: str, command: list[str], *, env: dict | None = None,
                 timeout: float = 300) -> tuple[int, str, str]:
        """Run a one-shot container (the client) on the network; (exit code, stdout, stderr)."""
        c = self.start(alias, role, command=command, env=env)
        w = c.get_wrapped_container()
        try:
            code = w.wait(timeout=timeout)["StatusCode"]
        except Exception as e:
            raise AssertionError(f"{alias} did not finish in {timeout}s: {e}\n{self.logs(alias)}") from None
        out = w.logs(stdout=True, stderr=False).decode(errors="replace")
        err = w.logs(stdout=False, stderr=True).decode(errors="replace")
        self.containers.pop(alias).stop()
        return code, out, err


def purge_session() -> None:
    """Remove every container, network and volume this session labelled (leftovers of a crash)."""
    if engine_problem():
        return
    d = client()
    flt = {"label": f"{LABEL}={SESSION}"}
    for c in d.containers.list(all=True, filters=flt):
        c.remove(force=True, v=True)
    for n in d.networks.list(filters=flt):
        try:
            n.remove()
        except Exception:
            pass
    for v in d.volumes.list(filters=flt):
        try:
            v.remove(force=True)
        except Exception:
            pass


# ---- docker compose ------------------------------------------------------------------------------

def compose_cmd() -> list[str]:
    """`docker compose` (v2, or v1 through docker/install-compose.sh's shim), else `docker-compose`."""
    if subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
        return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    msg = "neither `docker compose` nor `docker-compose` works (run docker/install-compose.sh)"
    if os.environ.get("CI"):
        pytest.fail(msg)
    pytest.skip(msg)


@contextmanager
def compose_project(name: str, env: dict[str, str]) -> Iterator[tuple[list[str], dict[str, str]]]:
    """A compose project named larql-test-...; always `down -v` (containers, network, volumes)."""
    project = f"{PREFIX}-{name}"
    base = [*compose_cmd(), "-p", project, "-f", str(ROOT / "compose.yaml")]
    full_env = {**env, "COMPOSE_PROJECT_NAME": project}
    try:
        yield base, full_env
    finally:
        subprocess.run([*base, "--profile", "client", "down", "-v", "--remove-orphans", "--timeout", "10"],
                       capture_output=True, text=True, timeout=300, cwd=ROOT, env={**os.environ, **full_env},
                       stdin=subprocess.DEVNULL)


def compose_container(project: str, service: str):
    """The container of a compose service (v1 and v2 both label them)."""
    d = client()
    found = d.containers.list(all=True, filters={"label": [f"com.docker.compose.project={project}",
                                                           f"com.docker.compose.service={service}"]})
    return found[0] if found else None


def health(container) -> str:
    container.reload()
    state = container.attrs["State"]
    return state.get("Health", {}).get("Status") or state["Status"]


def json_line(text: str) -> dict:
    """The last line of ``text`` that parses as a JSON object (a CLI's --json output)."""
    for line in reversed(text.strip().splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                continue
    raise AssertionError(f"no JSON object in output:\n{text[-3000:]}")


def larql_scrape_targets(prometheus_url: str, count: int, timeout: float) -> list[dict]:
    """Prometheus's active ``larql-*`` targets once ``count`` of them are up (within ``timeout`` s)."""
    import httpx

    deadline = time.monotonic() + timeout
    while True:
        targets = httpx.get(f"{prometheus_url}/api/v1/targets", timeout=5).json()
        larql = [t for t in targets["data"]["activeTargets"] if t["labels"]["job"].startswith("larql-")]
        if len(larql) == count and all(t["health"] == "up" for t in larql):
            return larql
        assert time.monotonic() < deadline, [(t["scrapeUrl"], t["health"], t["lastError"]) for t in larql]
        time.sleep(2)
