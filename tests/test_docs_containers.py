"""docs/containers.md names what ships: every compose service, every image docker/build-images.sh
builds (base images included), and every setting compose.yaml reads from the environment.

It lagged: the `serve` service, the `larql-serve` and `larql-varnish` images and `LARQL_EDGE=varnish`
were missing. The lists come from the files that define them, so a new service or image fails here
until the docs name it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DOC = (ROOT / "docs" / "containers.md").read_text()


def compose_services() -> list[str]:
    return sorted(yaml.safe_load((ROOT / "compose.yaml").read_text())["services"])


def built_images() -> list[str]:
    """The images build-images.sh makes: its ALL list (larql-ROLE) and the base images it imports."""
    script = (ROOT / "docker" / "build-images.sh").read_text()
    roles = re.search(r"^ROLES=\(([^)]*)\)", script, re.M)
    every = re.search(r'^ALL=\("\$\{ROLES\[@\]\}" ([^)]*)\)', script, re.M)
    assert roles and every, "build-images.sh: no ROLES=(...) / ALL=(...) lists"
    names = [f"larql-{n}" for n in roles.group(1).split() + every.group(1).split()]
    bases = sorted(set(re.findall(r"(larql-base[a-z-]*:bookworm)", script)))
    return names + bases


def test_every_compose_service_is_documented():
    services = compose_services()
    assert {"serve", "grid", "edge", "slicer"} <= set(services)
    missing = [s for s in services if f"`{s}`" not in DOC]
    assert not missing, f"compose services not named in docs/containers.md: {missing}"


def test_every_image_is_documented():
    images = built_images()
    assert {"larql-serve", "larql-varnish", "larql-base:bookworm"} <= set(images)
    missing = [i for i in images if f"`{i}`" not in DOC]
    assert not missing, f"images not named in docs/containers.md: {missing}"
    compose_images = {re.sub(r":\$\{.*", "", str(s.get("image", "")))
                      for s in yaml.safe_load((ROOT / "compose.yaml").read_text())["services"].values()}
    assert compose_images - {""} <= set(images), "compose names an image build-images.sh does not build"


def test_every_compose_setting_is_documented():
    text = (ROOT / "compose.yaml").read_text()
    settings = sorted(set(re.findall(r"\$\{(LARQL_[A-Z_]+)", text)))
    assert "LARQL_EDGE" in settings
    missing = [s for s in settings if s not in DOC]
    assert not missing, f"compose.yaml settings not named in docs/containers.md: {missing}"
    assert "LARQL_EDGE=varnish" in DOC


def documented_sizes() -> dict[str, float]:
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^\| `(larql-[a-z]+)` \|.*\| (\d+) MB \|\s*$", DOC, re.M)}


def test_every_built_image_has_a_documented_size():
    sizes = documented_sizes()
    missing = [i for i in built_images() if ":" not in i and i not in sizes]
    assert not missing, f"images without a size in docs/containers.md's table: {missing}"


@pytest.mark.docker
def test_documented_image_sizes_are_the_built_ones():
    """The table was ~217 MB low: each documented size is within 15% of the image built here (as
    `docker images` counts, 10^6 bytes). CI builds the images before the tests (.ci/run)."""
    import subprocess

    from tests import _docker as dk

    dk.require_engine()
    off = {}
    for name, mb in documented_sizes().items():
        r = subprocess.run(["docker", "image", "inspect", "-f", "{{.Size}}", dk.image(name.removeprefix("larql-"))],
                           capture_output=True, text=True, timeout=60)
        if r.returncode != 0:
            pytest.fail(f"{name} is not built here: run docker/build-images.sh ({r.stderr.strip()[:200]})")
        actual = int(r.stdout) / 1e6
        if abs(actual - mb) > 0.15 * actual:
            off[name] = f"documented {mb:.0f} MB, built {actual:.0f} MB"
    assert not off, off


def test_the_readme_names_every_tool_scripts_test_installs():
    """`scripts/test` installed more tools than the README's getting-started line listed."""
    setup = (ROOT / "scripts" / "setup").read_text()
    tools = re.findall(r"missing\+=\(([a-z-]+)\)", setup)
    assert {"nginx", "varnish", "prometheus"} <= set(tools)
    tools += ["helm", "kubectl"]  # scripts/install-k8s-tools, from PyPI
    readme = (ROOT / "README.md").read_text()
    start = readme.index("## Getting started")
    section = readme[start:readme.index("\n## ", start + 1)]
    missing = [t for t in tools if t not in section]
    assert not missing, f"scripts/setup test installs {missing}, which README's getting started does not name"


def test_the_readme_openai_example_is_installable():
    """The README's `from openai import OpenAI` needed a `pip install openai` that nothing ran or said."""
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert any(r.startswith("openai") for r in extras["openai"])
    assert re.search(r'extras="[^"]*\bopenai\b', (ROOT / "scripts" / "setup").read_text())
    readme = (ROOT / "README.md").read_text()
    assert "from openai import OpenAI" in readme and "larql-edge[openai]" in readme
