"""Pulls through the edge (issue 19): `larql-slicer pull --mirror URL` fetches file contents through the
shipped nginx Hub mirror (deploy/nginx/hub-mirror.conf, real nginx), in front of the Hub-protocol test
server with the unmodified huggingface_hub client. Two nodes (separate output folders and Hub caches)
pull the same vindex: the first costs the Hub one download per file, the second none; both get every
file, verified."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from larql_edge.testing.edge import NginxEdge, running_edge
from larql_edge.tools.slicer.pull import pull

pytestmark = pytest.mark.multiprocess

REPO = "test-user/mirror-vindex"
CONF = Path(__file__).resolve().parents[1] / "deploy" / "nginx" / "hub-mirror.conf"


def render(port: int, hub_url: str) -> str:
    """The shipped config with only the documented deployment lines changed (listen, the Hub)."""
    hostport = hub_url.split("://", 1)[1]
    text = CONF.read_text()
    for old, new in (("listen 8090;", f"listen 127.0.0.1:{port};"),
                     ("server huggingface.co:443;", f"server {hostport};"),
                     ("set $larql_hub_scheme https;", "set $larql_hub_scheme http;"),
                     ("set $larql_hub_host huggingface.co;", f"set $larql_hub_host {hostport};")):
        line = re.compile(rf"^(\s+){re.escape(old)}$", re.M)  # the directive, not the header's mention of it
        assert len(line.findall(text)) == 1, old
        text = line.sub(rf"\g<1>{new}", text)
    return text


def test_a_second_node_pulls_every_file_without_reaching_the_hub_for_contents(hub, tiny_models, tmp_path):
    files = {f.name: f.read_bytes() for f in sorted(tiny_models["gemma3"].iterdir()) if f.is_file()}
    hub.commit_files(REPO, files)
    contents = re.compile(r"/resolve/[0-9a-f]{40}/")
    with running_edge("nginx", [hub.url], wait_origin=False, conf_text=lambda port: render(port, hub.url)) as mirror:
        assert isinstance(mirror, NginxEdge)
        for node in ("node-a", "node-b"):
            before = len(hub.requests_matching("GET", contents.pattern))
            out = tmp_path / node / "vindex"
            rep = pull(REPO, output=out, endpoint=hub.url, token=hub.token, mirror=mirror.url, hints=False,
                       cache_dir=tmp_path / node / "hub-cache", log=lambda m: None)  # nothing shared but the mirror
            assert not rep.results[0].error
            for name, data in files.items():
                assert (out / name).read_bytes() == data, (node, name)
            got = len(hub.requests_matching("GET", contents.pattern)) - before
            if node == "node-a":
                assert got >= len(files), "the first node's files come from the Hub, once each"
                assert got <= len(files) + 2, hub.requests_matching("GET", contents.pattern)
            else:
                assert got == 0, [str(r) for r in hub.requests_matching("GET", contents.pattern)][-5:]
        # the listing still came from the Hub itself, every time (a branch moving is seen)
        assert len(hub.requests_matching("GET", r"/api/datasets/" + REPO)) >= 2


def test_a_mirror_that_is_not_a_url_is_one_line(hub, tmp_path):
    from larql_edge.errors import LarqlError

    with pytest.raises(LarqlError, match="--mirror must be an http"):
        pull(REPO, output=tmp_path / "x", endpoint=hub.url, token=hub.token, mirror="ftp://nowhere", hints=False,
             log=lambda m: None)
