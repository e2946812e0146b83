"""The membership client: flags and settings, and its behaviour against a real router (join,
heartbeat, rejoin after the router forgets it, leave on a clean stop)."""

from __future__ import annotations

import argparse
import asyncio
import time

import httpx
import pytest

from larql_edge.config import Flags
from larql_edge.errors import ProtocolError
from larql_edge.service.membership import GridSettings, RouterLink, add_membership_flags, default_public_url, membership_settings
from tests import _inproc as inproc
from tests._grid import GRID_KEY, capture_logs, wait_grid


def parse(argv, env=None, monkeypatch=None):
    p = argparse.ArgumentParser()
    add_membership_flags(Flags(p))
    return p, p.parse_args(argv)


def test_flags_and_settings(monkeypatch):
    monkeypatch.delenv("LARQL_GRID_KEY", raising=False)
    p, args = parse([])
    assert membership_settings(args, "0.0.0.0", 8080) is None
    _, args = parse(["--join", "http://r:9090/", "--grid-key", "k"])
    s = membership_settings(args, "0.0.0.0", 8080)
    assert s == GridSettings(routers=("http://r:9090",), grid_key="k", public_url="http://127.0.0.1:8080")
    assert "k" not in repr(s).replace("key", "")
    _, args = parse(["--join", "http://r:9090"])
    with pytest.raises(ProtocolError, match="--grid-key"):
        membership_settings(args, "h", 1)
    _, args = parse(["--join", "nope", "--grid-key", "k"])
    with pytest.raises(ProtocolError):
        membership_settings(args, "h", 1)
    _, args = parse(["--join", "http://a:1, http://b:2/", "--grid-key", "k"])
    assert membership_settings(args, "h", 1).routers == ("http://a:1", "http://b:2")
    monkeypatch.setenv("LARQL_GRID_KEY", "from-env-secret")
    p, args = parse(["--join", "http://r:1", "--public-url", "http://me:2"])
    assert membership_settings(args, "h", 1).grid_key == "from-env-secret"
    assert "from-env-secret" not in p.format_help() and "LARQL_GRID_KEY" in p.format_help()


def test_grid_key_from_a_file(tmp_path, monkeypatch):
    """Secrets as files (Swarm and Kubernetes mount them): the flag and the env twin both work."""
    key = tmp_path / "grid_key"
    key.write_text("file-secret\n")
    _, args = parse(["--join", "http://r:1", "--grid-key-file", str(key)])
    assert membership_settings(args, "h", 1).grid_key == "file-secret"
    monkeypatch.setenv("LARQL_GRID_KEY_FILE", str(key))
    p, args = parse(["--join", "http://r:1"])
    assert membership_settings(args, "h", 1).grid_key == "file-secret"
    assert "file-secret" not in p.format_help()
    monkeypatch.setenv("LARQL_GRID_KEY_FILE", str(tmp_path / "missing"))
    with pytest.raises(SystemExit):
        parse(["--join", "http://r:1"])


def test_router_names_expand_to_every_address():
    """A name resolving to several addresses (a headless Service, a Swarm dnsrr service) is each of them."""
    import socket

    from larql_edge.service import membership as mb

    real = socket.getaddrinfo

    def fake(host, port, *a, **k):
        if host == "routers.example":
            return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (ip, port)) for ip in ("10.0.0.2", "10.0.0.1")]
        return real(host, port, *a, **k)

    socket.getaddrinfo = fake
    try:
        assert mb.expand_router_urls(("http://routers.example:9090", "http://127.0.0.1:1")) == [
            "http://10.0.0.1:9090", "http://10.0.0.2:9090", "http://127.0.0.1:1"]
        assert mb.expand_router_urls(("http://no-such-host.invalid:1",)) == ["http://no-such-host.invalid:1"]
    finally:
        socket.getaddrinfo = real


def test_default_public_url():
    assert default_public_url("0.0.0.0", 8080) == "http://127.0.0.1:8080"
    assert default_public_url("10.0.0.5", 81) == "http://10.0.0.5:81"
    assert default_public_url("::1", 81) == "http://[::1]:81"


def test_member_joins_heartbeats_rejoins_and_leaves(tiny_models):
    """A router link against a real router: the router forgetting it (as after a restart) makes it
    join again; stopping it makes it leave. The member is a real shard (the router probes it)."""

    async def scenario(router, shard):
        m = RouterLink(router.url, GRID_KEY, shard.url, "ffn", lambda: shard.app.ctx.shard.describe(0))
        task = asyncio.create_task(m.run())
        async with httpx.AsyncClient() as c:
            async def members():
                return (await c.get(router.url + "/v1/grid")).json()["members"]

            deadline = time.monotonic() + 10
            while m.joins < 1 and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert m.joins == 1 and m.member_token
            first = m.member_id
            while time.monotonic() < deadline and not (ms := await members())[0]["rss_mb"]:
                await asyncio.sleep(0.05)  # load arrives with the first heartbeat
            assert ms[0]["rss_mb"] > 0 and ms[0]["layers"] == "0-1" and "token" not in str(ms)
            router.app.ctx.registry.members.clear()  # the router forgets it: its next heartbeat is a 404
            while m.joins < 2 and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert m.joins == 2 and m.member_id != first
            m.stop()
            await asyncio.wait_for(task, 5)
            assert await members() == []  # it left on stop (with its token)

    with inproc.router() as router, inproc.shard(tiny_models["gemma3"], "0-1") as shard:
        asyncio.run(scenario(router, shard))


def test_wrong_key_keeps_trying_quietly():
    async def scenario(router_url, logs):
        m = RouterLink(router_url, "wrong-key", "http://127.0.0.1:9", "embed", lambda: {"model": "m", "num_layers": 2})
        task = asyncio.create_task(m.run())
        deadline = time.monotonic() + 30
        while "refused" not in logs.text and time.monotonic() < deadline:  # its first try was refused
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.1)  # and the loop goes on after it
        assert m.member_id is None and m.joins == 0 and not task.done()
        m.stop()
        await asyncio.wait_for(task, 5)

    with inproc.router() as router, capture_logs() as logs:
        asyncio.run(scenario(router.url, logs))
        wait_grid(router.url, complete=False, members=0, timeout=5)
        assert "refused" in logs.text and "wrong-key" not in logs.text and GRID_KEY not in logs.text


def test_join_waits_until_ready(tiny_models):
    state = {"ready": False}

    async def scenario(router_url, shard):
        m = RouterLink(router_url, GRID_KEY, shard.url, "ffn", lambda: shard.app.ctx.shard.describe(0),
                       ready_fn=lambda: state["ready"])
        task = asyncio.create_task(m.run())
        await asyncio.sleep(0.8)
        assert m.joins == 0  # still loading: the router must not send it requests yet
        state["ready"] = True
        deadline = time.monotonic() + 10
        while m.joins == 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert m.joins == 1
        m.stop()
        await asyncio.wait_for(task, 5)

    with inproc.router() as router, inproc.shard(tiny_models["gemma3"], "0-1") as shard:
        asyncio.run(scenario(router.url, shard))


def test_a_member_joins_every_router_and_rejoins_one_that_restarts(tiny_models):
    """No single point of failure: members join all routers, so their views agree, and a router that
    restarts (same address, empty registry) relearns the members within a heartbeat."""
    from larql_edge.testing.servers import ServerThread

    with inproc.router() as r1, inproc.router() as r2:
        with inproc.shard(tiny_models["gemma3"], "0-1", join=[r1.url, r2.url]):
            v1 = wait_grid(r1.url, members=1)
            v2 = wait_grid(r2.url, members=1)
            assert [m["url"] for m in v1["members"]] == [m["url"] for m in v2["members"]]
            assert v1["coverage"] == v2["coverage"] and v1["complete"] and v2["complete"]
            port = r2.port
            r2.stop()
            assert httpx.get(r1.url + "/v1/grid").json()["complete"]  # the other router serves on
            again = inproc.router()
            restarted = ServerThread(again.app, port=port).start()
            try:
                assert wait_grid(restarted.url, members=1, timeout=10)["complete"]
            finally:
                restarted.stop()


def test_handover_waits_for_a_successor_before_leaving(tiny_models):
    """``--handover-seconds``: on SIGTERM a member stays in the routers until a successor serving its
    layers has joined (a start-first rolling update: the old task must not leave its range a replica
    short), bounded; without a successor it leaves when the bound is up."""
    from larql_edge.service.membership import Membership

    with inproc.router() as r, inproc.shard(tiny_models["gemma3"], "0-1", join=[r.url]) as old:
        wait_grid(r.url, members=1)
        describe = old.app.ctx.shard.describe

        async def scenario():
            m = Membership(GridSettings((r.url,), GRID_KEY, old.url, handover=20.0), "ffn", describe)
            m.links = {r.url: None}  # the router it joined (handover reads only the URLs)
            t0 = time.monotonic()
            task = asyncio.create_task(m.handover())
            await asyncio.sleep(0.5)
            assert not task.done()  # no successor yet: it stays
            with inproc.shard(tiny_models["gemma3"], "0-1", join=[r.url]):
                await asyncio.wait_for(task, 15)
                waited = time.monotonic() - t0
                assert waited < 15 and len(httpx.get(r.url + "/v1/grid").json()["members"]) == 2
            m.settings = GridSettings((r.url,), GRID_KEY, old.url, handover=0.5)
            t0 = time.monotonic()
            await m.handover()  # the successor is gone again: the bound
            return waited, time.monotonic() - t0

        waited, bounded = asyncio.run(scenario())
        assert 0.5 <= waited and 0.5 <= bounded < 5.0, (waited, bounded)


def test_leave_on_request_drains_the_member(tiny_models):
    """What a preStop hook (docker/roles/larql-leave) calls: the member leaves every router, then drains."""
    with inproc.router() as r1, inproc.router() as r2, inproc.shard(tiny_models["gemma3"], "0-1", join=[r1.url, r2.url]) as s:
        wait_grid(r1.url, members=1)
        wait_grid(r2.url, members=1)
        assert httpx.post(s.url + "/v1/membership/leave").status_code == 401
        assert httpx.post(s.url + "/v1/membership/leave", headers={"authorization": "Bearer wrong"}).status_code == 401
        r = httpx.post(s.url + "/v1/membership/leave", headers={"authorization": f"Bearer {GRID_KEY}"}, timeout=10)
        assert r.status_code == 200 and r.json() == {"left": 2, "draining": True}
        assert wait_grid(r1.url, complete=False, members=0)["members"] == []
        assert wait_grid(r2.url, complete=False, members=0)["members"] == []
        ready = httpx.get(s.url + "/v1/ready")
        assert ready.status_code == 503 and "draining" in ready.json()["error"]
        assert httpx.get(s.url + "/v1/health").status_code == 200  # alive: in-flight requests still finish
