"""The router against members that misbehave and callers that push (issue #14): each test is one
defect found on the code before the hardening, in-process on loopback (tiny model)."""

from __future__ import annotations

import socket
import struct
import threading
import time

import httpx
import numpy as np
import pytest
from sanic import Sanic
from sanic.response import json, raw

from larql_edge.format.vindex import Vindex
from larql_edge.model.forward import LocalFfn
from larql_edge.model.spec import ModelSpec
from larql_edge.testing.servers import ServerThread
from larql_edge.wire import ffn as w
from tests import _inproc as inproc
from tests._grid import GRID_KEY, StubEmbed, wait_grid

H = 32
X = np.random.default_rng(7).standard_normal((2, H)).astype(np.float32)
BIN = {"content-type": w.CONTENT_TYPE}
AUTH = {"authorization": f"Bearer {GRID_KEY}"}


@pytest.fixture(scope="module")
def reference(tiny_models):
    vx = Vindex.open(tiny_models["gemma3"])
    return LocalFfn(vx, ModelSpec.from_index(vx.index))


def _bad_member(mode: str) -> ServerThread:
    """A server at a member's URL that answers /v1/walk-ffn wrongly: 404, 200 garbage, or never."""
    app = Sanic(f"bad_{mode}")
    gate = threading.Event()

    @app.get("/v1/stats")
    async def stats(request):
        return json({"model": "gemma3-hf", "hidden_size": H, "num_layers": 2, "layer_start": 0, "layer_end": 1})

    @app.post("/v1/walk-ffn")
    async def walk(request):
        if mode == "404":
            return json({"error": "no route"}, status=404)
        if mode == "garbage":
            return raw(b"\x00\x01\x02", content_type=w.CONTENT_TYPE)
        import asyncio

        for _ in range(200):  # "frozen": answers only after the router gave up on it
            if gate.is_set():
                break
            await asyncio.sleep(0.05)
        return json({"error": "late"}, status=503)

    s = ServerThread(app)
    s.gate = gate
    return s


@pytest.mark.parametrize("mode", ["404", "garbage", "frozen"])
def test_a_member_that_answers_wrongly_is_failed_over(tiny_models, reference, mode):
    """Defect 1 and 5: a 4xx or a 200 with garbage was forwarded as the answer; a frozen replica held
    a request longer than the client waits. Now each is that member's failure, and a replica answers."""
    bad = _bad_member(mode).start()
    try:
        with inproc.shard(tiny_models["gemma3"], None) as good, \
                inproc.router(static_ffn=[(None, bad.url), (None, good.url)], upstream_timeout=0.5) as router:
            wait_grid(router.url, members=2)
            for _ in range(4):  # whichever replica the router picks first, every answer is right
                t0 = time.monotonic()
                r = httpx.post(router.url + "/v1/walk-ffn", content=w.encode_request(1, X), headers=BIN, timeout=5)
                assert r.status_code == 200, r.text
                layer, out, _ = w.decode_response(r.content, H)
                np.testing.assert_array_equal(out, reference.ffn(1, X))
                assert time.monotonic() - t0 < 5  # the router's hop timeout, not the client's, decided
            members = {m["url"]: m for m in httpx.get(router.url + "/v1/grid").json()["members"]}
            assert members[bad.url]["failures"] >= 1 and members[good.url]["failures"] == 0
            assert 'larql_router_upstream_failures_total{capability="ffn"' in httpx.get(router.url + "/metrics").text
    finally:
        bad.gate.set()
        bad.stop()


def test_a_member_whose_public_url_is_wrong_cannot_join(tiny_models):
    """Defect 1's cause: a shard announcing another server's URL (the wrong port) was registered."""
    with inproc.router() as router, StubEmbed(tiny_models["gemma3"]) as elsewhere:
        a = {"capability": "ffn", "public_url": elsewhere.url, "model": "gemma3-hf", "num_layers": 2, "hidden_size": H,
             "layer_start": 0, "layer_end": 1}
        r = httpx.post(router.url + "/v1/grid/join", json=a, headers=AUTH)
        assert r.status_code == 409 and "is not the member announced" in r.json()["error"]
        r = httpx.post(router.url + "/v1/grid/join", json=a | {"public_url": "http://127.0.0.1:9"}, headers=AUTH)
        assert r.status_code == 400 and "cannot reach" in r.json()["error"]
        assert httpx.get(router.url + "/v1/grid").json()["members"] == []


def test_repeated_layers_and_huge_replies_are_refused_before_any_work(tiny_models):
    """Defect 2: a 56 KB batch naming layer 0 4,096 times returned 160 MB and blocked the shard 18.7 s."""
    with inproc.router(max_reply_bytes=8 * H * 4) as router, inproc.shard(tiny_models["gemma3"], None, join=router.url):
        wait_grid(router.url, members=1)
        body = struct.pack("<II", 0xFFFFFFFF, 4096) + struct.pack("<I", 0) * 4096 + struct.pack("<III", 1, 0, 0)
        r = httpx.post(router.url + "/v1/walk-ffn", content=body + X[:1].tobytes(), headers=BIN)
        assert r.status_code == 400 and "more than once" in r.json()["error"]
        r = httpx.post(router.url + "/v1/walk-ffn", content=w.encode_request([0, 1], np.zeros((5, H), np.float32)), headers=BIN)
        assert r.status_code == 413 and "limit" in r.json()["error"]
        assert httpx.get(router.url + "/v1/stats").json()["limits"]["max_reply_bytes"] == 8 * H * 4


def test_membership_routes_read_no_body_before_the_key_and_only_a_small_one_after():
    """Defect 4: the router read a 255 MiB body before checking the key (four such joins: 2.1 GB)."""
    with inproc.router() as router:
        host, port = "127.0.0.1", router.port
        with socket.create_connection((host, port), timeout=5) as s:  # announces 200 MB, sends none of it
            s.sendall(b"POST /v1/grid/join HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                      b"content-length: 209715200\r\n\r\n")
            head = s.recv(4096)
        assert head.startswith(b"HTTP/1.1 401"), head[:80]
        r = httpx.post(router.url + "/v1/grid/join", content=b"{" + b" " * (100 << 10) + b"}",
                       headers={**AUTH, "content-type": "application/json"})
        assert r.status_code == 413
        assert httpx.get(router.url + "/v1/health").status_code == 200


def test_a_key_holder_cannot_speak_for_another_member(tiny_models):
    """Defect 8: any key holder could heartbeat or remove any member (ids are public in /v1/grid),
    or replace one by joining with its URL."""
    with inproc.router() as router, inproc.shard(tiny_models["gemma3"], None, join=router.url) as s:
        view = wait_grid(router.url, members=1)
        mid = view["members"][0]["id"]
        r = httpx.post(router.url + "/v1/grid/leave", json={"member_id": mid}, headers=AUTH)
        assert r.status_code == 403
        r = httpx.post(router.url + "/v1/grid/heartbeat", json={"member_id": mid, "member_token": "guess"}, headers=AUTH)
        assert r.status_code == 403
        a = {"capability": "ffn", "public_url": s.url, "model": "gemma3-hf", "num_layers": 2, "hidden_size": H,
             "layer_start": 0, "layer_end": 1}
        r = httpx.post(router.url + "/v1/grid/join", json=a, headers=AUTH)
        assert r.status_code == 409 and "already has the URL" in r.json()["error"]
        assert [m["id"] for m in httpx.get(router.url + "/v1/grid").json()["members"]] == [mid]


def test_the_embed_proxy_forwards_only_documented_routes(tiny_models):
    """Defect 8: the proxy forwarded `..` segments raw, so a key holder's registered URL could be
    read at any GET path through the router. Also defect 10: POST token routes (405) and the
    /v1/{model_id}/... routes (404) were missing."""
    with StubEmbed(tiny_models["gemma3"]) as stub, inproc.router(static_embed=[stub.url]) as router:
        wait_grid(router.url, complete=False, embed=1)
        for path in ("/v1/embed/../../secret", "/v1/embed/..%2F..%2Fsecret", "/v1/models/../../../etc/passwd",
                     "/v1/token/../../admin"):
            with socket.create_connection(("127.0.0.1", router.port), timeout=5) as s:
                s.sendall(f"GET {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n".encode())
                status = s.recv(4096).split(b" ", 2)[1]
            assert status in (b"400", b"404"), (path, status)
        assert all(p.split("?")[0].rsplit(" ", 1)[1].startswith(("/v1/embed", "/v1/stats", "/v1/token/encode"))
                   for p in stub.requests), stub.requests
        assert httpx.get(router.url + "/v1/embed/3").status_code == 200
        r = httpx.post(router.url + "/v1/token/encode", json={"text": "paris"})
        assert r.status_code != 405
        httpx.get(router.url + "/v1/m/embed/3")  # the model-prefixed spelling reaches the embed server
        assert "GET /v1/m/embed/3" in stub.requests


@pytest.mark.parametrize("role", ["embed", "ffn", "router"])
def test_deeply_nested_json_is_a_400_on_every_service(tiny_models, role):
    """Defect 7: 100,000 levels of nesting gave a 500 and a traceback on every JSON endpoint."""
    body = b"[" * 100_000 + b"]" * 100_000
    if role == "embed":
        server, path = inproc.embed({"m": tiny_models["gemma3"]}, max_body=1 << 20), "/v1/embed"
    elif role == "ffn":
        server, path = inproc.shard(tiny_models["gemma3"], None), "/v1/walk-ffn"
    else:
        server, path = inproc.router(), "/v1/walk-ffn"
    with server:
        inproc.wait_ready(server)
        r = httpx.post(server.url + path, content=body, headers={"content-type": "application/json"})
        assert r.status_code == 400 and "nested" in r.json()["error"], r.text
        assert httpx.get(server.url + "/v1/health").status_code == 200


def _slow_member(seconds_per_row: float) -> ServerThread:
    """A correct-shaped member that takes ``seconds_per_row`` per row x layer (a big batch's compute)."""
    app = Sanic("slow_member")

    @app.get("/v1/stats")
    async def stats(request):
        return json({"model": "gemma3-hf", "hidden_size": H, "num_layers": 2, "layer_start": 0, "layer_end": 1})

    @app.post("/v1/walk-ffn")
    async def walk(request):
        import asyncio

        req = w.decode_request(request.body, H)
        await asyncio.sleep(seconds_per_row * req.seq_len * len(req.layers))
        return raw(w.encode_response(req.layers[0], np.array(req.x), 1.0), content_type=w.CONTENT_TYPE)

    return ServerThread(app)


def test_the_hop_timeout_grows_with_the_work_asked():
    """Found by benchmarks/largest_request.py: the largest legal batch took longer than the flat 10 s
    hop timeout, so a member computing it correctly was failed and the caller got a 503. The router's
    wait is now ``upstream_timeout + rows x layers x upstream_ms_per_row``; a decode-sized request
    still fails over after ``upstream_timeout``."""
    x = np.zeros((40, H), np.float32)  # 40 row-layers x 25 ms = 1 s of "compute"
    with _slow_member(0.025) as slow:
        for per_row, want in ((0.0, 503), (40.0, 200)):
            with inproc.router(static_ffn=[(None, slow.url)], upstream_timeout=0.3, upstream_ms_per_row=per_row) as router:
                wait_grid(router.url, members=1)
                r = httpx.post(router.url + "/v1/walk-ffn", content=w.encode_request(1, x), headers=BIN, timeout=30)
                assert r.status_code == want, (per_row, r.text)
                limits = httpx.get(router.url + "/v1/stats").json()["limits"]
                assert limits["upstream_ms_per_row_layer"] == per_row


def _serial_member(seconds_per_row: float) -> ServerThread:
    """As `_slow_member`, but one request at a time (a shard's single compute thread): a request waits
    for those ahead of it."""
    import asyncio

    app = Sanic("serial_member")
    lock: list[asyncio.Lock] = []

    @app.get("/v1/stats")
    async def stats(request):
        return json({"model": "gemma3-hf", "hidden_size": H, "num_layers": 2, "layer_start": 0, "layer_end": 1})

    @app.post("/v1/walk-ffn")
    async def walk(request):
        if not lock:
            lock.append(asyncio.Lock())
        req = w.decode_request(request.body, H)
        async with lock[0]:
            await asyncio.sleep(seconds_per_row * req.seq_len * len(req.layers))
        return raw(w.encode_response(req.layers[0], np.array(req.x), 1.0), content_type=w.CONTENT_TYPE)

    return ServerThread(app)


def test_the_routers_own_overload_is_not_blamed_on_a_member():
    """Issue #19 (High): eight concurrent largest-legal requests all got 503 and the healthy shard was
    marked failed: each request's hop timeout counted only its own work, not the work the router had
    queued at the member ahead of it. Six requests that each fit their own timeout, queued at a member
    that computes one at a time, now all answer 200 and the member is never failed."""
    from concurrent.futures import ThreadPoolExecutor

    x = np.zeros((40, H), np.float32)  # 40 row-layers x 10 ms = 0.4 s of "compute" each, 2.4 s in all
    with _serial_member(0.010) as member, \
            inproc.router(static_ffn=[(None, member.url)], upstream_timeout=0.2, upstream_ms_per_row=30.0) as router:
        # 3x the member's 10 ms a row (a loaded host's overheads fit); the old rule still fails: its 4th
        # request waits 1.6 s behind the others, past its own 0.2 + 40 x 0.03 = 1.4 s
        wait_grid(router.url, members=1)
        with ThreadPoolExecutor(6) as ex:
            codes = list(ex.map(lambda _: httpx.post(router.url + "/v1/walk-ffn", content=w.encode_request(1, x),
                                                     headers=BIN, timeout=60).status_code, range(6)))
        assert codes == [200] * 6, codes
        members = httpx.get(router.url + "/v1/grid").json()["members"]
        assert [m["failures"] for m in members] == [0], members


def _joined_slow_member(router_url: str, seconds_per_row: float, name: str) -> ServerThread:
    """A member that joins ``router_url`` and heartbeats (alive), correct but slow: ``seconds_per_row``
    per row x layer (a huge legal request on a busy host)."""
    import asyncio

    from larql_edge.service.membership import install_membership
    from larql_edge.tools.grid.supervisor import free_port

    app = Sanic(name)
    facts = {"model": "gemma3-hf", "hidden_size": H, "num_layers": 2, "layer_start": 0, "layer_end": 1}

    @app.get("/v1/health")
    async def health(request):
        return json({"status": "ok"})

    @app.get("/v1/stats")
    async def stats(request):
        return json(facts)

    @app.post("/v1/walk-ffn")
    async def walk(request):
        req = w.decode_request(request.body, H)
        await asyncio.sleep(seconds_per_row * req.seq_len * len(req.layers))
        return raw(w.encode_response(req.layers[0], np.array(req.x), 1.0), content_type=w.CONTENT_TYPE)

    port = free_port()
    install_membership(app, inproc.grid_settings(router_url, port), "ffn", lambda: dict(facts, inflight=0))
    return ServerThread(app, port=port)


def test_a_slow_member_that_heartbeats_is_waited_for_not_failed():
    """Issue #19 (High), found again by benchmarks/largest_request.py on a host at load 25: the
    largest legal request took longer than any fixed ms-per-row budget, so the router marked its
    healthy, heartbeating shard failed (a range uncovered, every caller a 503). Slow is not broken: a
    joined member that still heartbeats is waited for past its deadline (here 0.2 s against 1.2 s of
    compute), the caller gets its 200 and the member is never failed."""
    x = np.zeros((40, H), np.float32)  # 40 row-layers x 30 ms = 1.2 s
    with inproc.router(heartbeat=0.2, upstream_timeout=0.2, upstream_ms_per_row=0.0) as router, \
            _joined_slow_member(router.url, 0.030, "slow_joined") as member:
        wait_grid(router.url, members=1)
        r = httpx.post(router.url + "/v1/walk-ffn", content=w.encode_request(1, x), headers=BIN, timeout=30)
        assert r.status_code == 200, r.text
        grid = httpx.get(router.url + "/v1/grid").json()
        assert [(m["url"], m["failures"], m["live"]) for m in grid["members"]] == [(member.url, 0, True)], grid
        assert grid["complete"], grid
        assert httpx.get(router.url + "/v1/stats").json()["slow_replies"] == 1


def test_a_slow_member_with_a_faster_replica_is_left_for_it_unblamed():
    """The same late reply with another replica serving the layers: the router moves the request
    there at the deadline (the caller is answered in time) and neither member counts a failure."""
    x = np.zeros((40, H), np.float32)
    with inproc.router(heartbeat=0.2, upstream_timeout=0.3, upstream_ms_per_row=0.0) as router, \
            _joined_slow_member(router.url, 0.5, "slow_a") as slow, _joined_slow_member(router.url, 0.0, "fast_b") as fast:
        wait_grid(router.url, members=2)
        for _ in range(4):  # whichever the router tries first, each answer comes in time
            t0 = time.monotonic()
            r = httpx.post(router.url + "/v1/walk-ffn", content=w.encode_request(1, x), headers=BIN, timeout=30)
            assert r.status_code == 200 and time.monotonic() - t0 < 10, r.text
        members = httpx.get(router.url + "/v1/grid").json()["members"]
        assert {m["url"]: m["failures"] for m in members} == {slow.url: 0, fast.url: 0}, members


def test_heartbeats_keep_their_cadence_when_the_router_answers_slowly():
    """Heartbeats were sent an interval after the previous one's reply: a router answering each in
    0.6 s (busy) saw one every 1.6 s against a 1 s interval, so two slow answers and the member was past
    the 3-interval eviction age. They now go start to start (the test ends at the 4th beat). Here at half
    that scale: 0.5 s interval, 0.4 s answers (0.9 s apart the old way)."""
    import asyncio

    from larql_edge.service.membership import RouterLink
    from larql_edge.wire.grid import HEARTBEAT, JOIN

    app = Sanic("slow_router")
    beats: list[float] = []

    @app.post(JOIN)
    async def join(request):
        return json({"member_id": "m1", "member_token": "t", "heartbeat_interval_s": 0.5})

    @app.post(HEARTBEAT)
    async def heartbeat(request):
        beats.append(time.monotonic())
        await asyncio.sleep(0.4)
        return json({"ok": True})

    async def member(url: str) -> None:
        link = RouterLink(url, "key", "http://127.0.0.1:9", "ffn", lambda: {"model": "m"})
        task = asyncio.ensure_future(link.run())
        deadline = time.monotonic() + 60
        while len(beats) < 4 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        link.stop()
        await task

    with ServerThread(app) as router:
        asyncio.run(member(router.url))
    gaps = [b - a for a, b in zip(beats, beats[1:], strict=False)]
    assert len(beats) >= 4 and max(gaps) < 0.75, gaps
