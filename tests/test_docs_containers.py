"""docs/containers.md names what ships: every compose service, every image docker/build-images.sh
builds (base images included), and every setting compose.yaml reads from the environment.

It lagged: the `serve` service, the `larql-serve` and `larql-varnish` images and `LARQL_EDGE=varnish`
were missing. The lists come from the files that define them, so a new service or image fails here
until the docs name it."""

from __future__ import annotations

import re
from pathlib import Path

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
