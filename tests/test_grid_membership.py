"""The membership client: flags and settings, and its behaviour against a real router (join,
heartbeat, rejoin after the router forgets it, leave on a clean stop)."""

from __future__ import annotations

import argparse
import asyncio
import time

import httpx
import pytest

from larql_edge.config import Flags
from larql_edge.service.membership import Membership, add_membership_flags, default_public_url, membership_settings
from tests._grid import GRID_KEY, Procs, wait_grid


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
    assert s == {"router_url": "http://r:9090", "grid_key": "k", "public_url": "http://127.0.0.1:8080"}
    _, args = parse(["--join", "http://r:9090"])
    with pytest.raises(ValueError, match="--grid-key"):
        membership_settings(args, "h", 1)
    _, args = parse(["--join", "nope", "--grid-key", "k"])
    with pytest.raises(ValueError):
        membership_settings(args, "h", 1)
    monkeypatch.setenv("LARQL_GRID_KEY", "from-env-secret")
    p, args = parse(["--join", "http://r:1", "--public-url", "http://me:2"])
    assert membership_settings(args, "h", 1)["grid_key"] == "from-env-secret"
    assert "from-env-secret" not in p.format_help() and "LARQL_GRID_KEY" in p.format_help()


def test_default_public_url():
    assert default_public_url("0.0.0.0", 8080) == "http://127.0.0.1:8080"
    assert default_public_url("10.0.0.5", 81) == "http://10.0.0.5:81"
    assert default_public_url("::1", 81) == "http://[::1]:81"


def test_member_joins_heartbeats_rejoins_and_leaves():
    """A Membership task against a real router: the router forgetting it (leave by someone else,
    as after a restart) makes it join again; stopping it makes it leave."""
    describe = lambda: {"model": "m", "num_layers": 4, "hidden_size": 8, "layer_start": 0, "layer_end": 3,  # noqa: E731
                        "vindex_hash": "abc", "inflight": 0, "layer_latency_ms": {"0": 1.25}}

    async def scenario(router_url):
        m = Membership(router_url, GRID_KEY, "http://127.0.0.1:9", "ffn", describe)
        task = asyncio.create_task(m.run())
        auth = {"authorization": f"Bearer {GRID_KEY}"}
        async with httpx.AsyncClient() as c:
            async def members():
                return (await c.get(router_url + "/v1/grid")).json()["members"]

            deadline = time.monotonic() + 10
            while m.joins < 1 and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert m.joins == 1
            first = m.member_id
            while time.monotonic() < deadline:
                ms = await members()
                if ms and ms[0]["layer_latency_ms"] == {"0": 1.25}:
                    break
                await asyncio.sleep(0.05)
            assert ms[0]["rss_mb"] > 0 and ms[0]["layers"] == "0-3"
            # The router forgets the member: its next heartbeat gets 404 and it joins again.
            r = await c.post(router_url + "/v1/grid/leave", json={"member_id": first}, headers=auth)
            assert r.status_code == 200
            while m.joins < 2 and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert m.joins == 2 and m.member_id != first
            m.stop()
            await asyncio.wait_for(task, 5)
            assert await members() == []  # it left on stop

    with Procs() as procs:
        router = procs.router()
        router.wait_ready(30)
        asyncio.run(scenario(router.url))


def test_wrong_key_keeps_trying_quietly():
    async def scenario(router_url):
        m = Membership(router_url, "wrong-key", "http://127.0.0.1:9", "embed", lambda: {"model": "m"})
        task = asyncio.create_task(m.run())
        await asyncio.sleep(1.0)
        assert m.member_id is None and m.joins == 0 and not task.done()
        m.stop()
        await asyncio.wait_for(task, 5)

    with Procs() as procs:
        router = procs.router()
        router.wait_ready(30)
        asyncio.run(scenario(router.url))
        wait_grid(router.url, complete=False, members=0, timeout=5)
        assert "wrong-key" not in router.log() and GRID_KEY not in router.log()


def test_join_waits_until_ready():
    state = {"ready": False}

    async def scenario(router_url):
        m = Membership(router_url, GRID_KEY, "http://127.0.0.1:9", "embed", lambda: {"model": "m"},
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

    with Procs() as procs:
        router = procs.router()
        router.wait_ready(30)
        asyncio.run(scenario(router.url))
