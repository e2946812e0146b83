"""Protocol tests of the two hot-path HTTP/1.1 clients (``h1_sync.HttpClient`` and
``h1_async.H1Pool``, the latter on asyncio's loop and on uvloop, which the router runs on), against
a raw-socket server that sends exactly the bytes each test scripts (tests/_rawhttp.py).

Every case runs against every client: framing (Content-Length, chunked with extensions and
trailers, close-delimited, HEAD/204/304, interim 1xx), connection reuse and ``Connection: close``,
the one retry of a request that met a connection the server had closed while idle, timeouts,
refused connections, malformed or oversize replies, and the ``max_body`` bound.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from larql_edge.net.h1 import (
    ConnectFailed,
    ConnectionLost,
    MalformedReply,
    ReplyTooLarge,
    TimedOut,
    TransportError,
    describe,
)
from larql_edge.net.h1_async import H1Pool
from larql_edge.net.h1_sync import HttpClient
from tests._rawhttp import RawConn, RawServer, closed_port, reply

try:
    import uvloop
except ImportError:  # a Sanic dependency, so normally present
    uvloop = None

CLIENTS = ["sync", "async", pytest.param("async-uvloop", marks=pytest.mark.skipif(uvloop is None, reason="no uvloop"))]
BODY = bytes(range(256)) * 10  # 2,560 bytes, about one hidden-640 position


class SyncClient:
    def __init__(self, **kw):
        self.c = HttpClient(**kw)

    def request(self, method: str, url: str, content: bytes | None = None, **kw):
        return self.c.request(method, url, content=content, **kw)

    def pause(self, seconds: float) -> None:
        time.sleep(seconds)

    def close(self) -> None:
        self.c.close()


class AsyncClient:
    """H1Pool driven from a test: its own event loop, every call bounded (a hang fails the test)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, **kw):
        self.loop = loop
        self.c = H1Pool(**kw)

    def request(self, method: str, url: str, content: bytes | None = None, **kw):
        return self.loop.run_until_complete(asyncio.wait_for(self.c.request(method, url, content=content, **kw), 20))

    def pause(self, seconds: float) -> None:
        self.loop.run_until_complete(asyncio.sleep(seconds))  # the loop runs: it sees an idle close

    def close(self) -> None:
        self.loop.run_until_complete(self.c.aclose())
        self.loop.close()


@pytest.fixture(params=CLIENTS)
def client(request):
    """A factory: client(timeout=..., max_body=...) -> a client of the parametrized kind."""
    made = []

    def make(**kw):
        kw.setdefault("timeout", 5.0)
        if request.param == "sync":
            c = SyncClient(**kw)
        else:
            c = AsyncClient(uvloop.new_event_loop() if request.param == "async-uvloop" else asyncio.new_event_loop(), **kw)
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()


def each_request(answer):
    """A script that answers every request on every connection with ``answer(req, conn)``."""

    def script(conn: RawConn) -> None:
        while (req := conn.read_request()) is not None:
            conn.send(answer(req, conn))

    return script


def echo(req, conn):
    return reply(200, req.body or req.target.encode(), [("content-type", "application/x-test")])


# ---------------------------------------------------------------- framing


def test_content_length_reply_on_one_kept_alive_connection(client):
    c = client()
    with RawServer(each_request(echo)) as srv:
        r1 = c.request("POST", srv.url + "/v1/walk-ffn?x=1", BODY, headers={"content-type": "application/x-larql-ffn"})
        r2 = c.request("GET", srv.url + "/second")
        assert (r1.status_code, r1.content, r1.headers["content-type"]) == (200, BODY, "application/x-test")
        assert r2.content == b"/second"
        assert srv.connections == 1  # kept alive
        first, second = srv.requests
        assert (first.method, first.target, first.body) == ("POST", "/v1/walk-ffn?x=1", BODY)
        assert first.headers["content-length"] == str(len(BODY))
        assert first.headers["host"] == f"127.0.0.1:{srv.port}"
        assert first.headers["content-type"] == "application/x-larql-ffn"
        assert second.method == "GET" and second.body == b""


def test_post_without_body_sends_content_length_zero(client):
    c = client()
    with RawServer(each_request(echo)) as srv:
        assert c.request("POST", srv.url + "/empty").status_code == 200
        assert srv.requests[0].headers.get("content-length") == "0"


CHUNKED = (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\ncontent-type: text/plain\r\n\r\n"
           b"5;name=value\r\nhello\r\n"
           b"6;a;b=\"c d\"\r\n world\r\n"
           b"1A\r\n" + b"z" * 26 + b"\r\n"
           b"0;last\r\nx-trailer: one\r\nx-other: two\r\n\r\n")


@pytest.mark.parametrize("piece", [None, 7], ids=["one-write", "7-byte-writes"])
def test_chunked_reply_with_extensions_and_trailers(client, piece):
    def script(conn):
        while (req := conn.read_request()) is not None:
            if req.target == "/chunked":
                conn.send(CHUNKED) if piece is None else conn.send_in_pieces(CHUNKED, piece, pause=0.001)
            else:
                conn.send(echo(req, conn))

    c = client()
    with RawServer(script) as srv:
        r = c.request("GET", srv.url + "/chunked")
        assert r.content == b"hello world" + b"z" * 26
        # The trailers were read to the end: the next reply on the same connection is intact.
        assert c.request("GET", srv.url + "/after").content == b"/after"
        assert srv.connections == 1


def test_transfer_encoding_chunked_wins_over_content_length(client):
    raw = (b"HTTP/1.1 200 OK\r\ncontent-length: 3\r\ntransfer-encoding: chunked\r\n\r\n"
           b"5\r\nhello\r\n0\r\n\r\n")
    c = client()
    with RawServer(each_request(lambda req, conn: raw if req.target == "/c" else echo(req, conn))) as srv:
        assert c.request("GET", srv.url + "/c").content == b"hello"
        assert c.request("GET", srv.url + "/after").content == b"/after"


@pytest.mark.parametrize("head", [
    b"HTTP/1.0 200 OK\r\ncontent-type: text/plain\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-type: text/plain\r\n\r\n",
], ids=["http1.0", "http1.1-connection-close"])
def test_close_delimited_body(client, head):
    body = b"until the server closes " * 200

    def script(conn):
        req = conn.read_request()
        if req is not None and req.target == "/close":
            conn.send_in_pieces(head + body, 1000, pause=0.001)
            return  # closing ends the body
        while req is not None:
            conn.send(echo(req, conn))
            req = conn.read_request()

    c = client()
    with RawServer(script) as srv:
        r = c.request("GET", srv.url + "/close")
        assert (r.status_code, r.content) == (200, body)
        assert c.request("GET", srv.url + "/next").content == b"/next"
        assert srv.connections == 2  # the closed connection was not reused


def test_connection_close_after_a_content_length_reply(client):
    def script(conn):
        req = conn.read_request()
        if req is None:
            return
        if conn.index == 1:
            conn.send(reply(200, b"bye", [("connection", "close")]))
            return  # and close, as announced
        while req is not None:
            conn.send(echo(req, conn))
            req = conn.read_request()

    c = client()
    with RawServer(script) as srv:
        assert c.request("GET", srv.url + "/a").content == b"bye"
        assert c.request("GET", srv.url + "/b").content == b"/b"
        assert [(r.conn, r.target) for r in srv.requests] == [(1, "/a"), (2, "/b")]  # each sent once


def test_head_204_304_have_no_body_and_keep_the_connection(client):
    def answer(req, conn):
        if req.method == "HEAD":  # a Content-Length announcing the body a GET would get; no body
            return b"HTTP/1.1 200 OK\r\ncontent-length: 1234\r\ncontent-type: text/plain\r\n\r\n"
        if req.target == "/304":
            return b'HTTP/1.1 304 Not Modified\r\netag: "v1"\r\ncontent-length: 99\r\n\r\n'
        if req.target == "/204":
            return b"HTTP/1.1 204 No Content\r\n\r\n"
        return echo(req, conn)

    c = client()
    with RawServer(each_request(answer)) as srv:
        head = c.request("HEAD", srv.url + "/x")
        assert (head.status_code, head.content, head.headers["content-length"]) == (200, b"", "1234")
        nm = c.request("GET", srv.url + "/304", headers={"if-none-match": '"v1"'})
        assert (nm.status_code, nm.content, nm.headers["etag"]) == (304, b"", '"v1"')
        nc = c.request("GET", srv.url + "/204")
        assert (nc.status_code, nc.content) == (204, b"")
        assert c.request("GET", srv.url + "/after").content == b"/after"
        assert srv.connections == 1


def test_interim_100_continue_is_skipped(client):
    raw = b"HTTP/1.1 100 Continue\r\n\r\n" + reply(201, b"made")
    c = client()
    with RawServer(each_request(lambda req, conn: raw)) as srv:
        r = c.request("POST", srv.url + "/x", b"data")
        assert (r.status_code, r.content) == (201, b"made")
        assert c.request("POST", srv.url + "/y", b"data").status_code == 201
        assert srv.connections == 1


def test_error_status_is_a_reply_not_an_exception(client):
    raw = reply(503, b'{"error": "overloaded"}', [("content-type", "application/json")])
    c = client()
    with RawServer(each_request(lambda req, conn: raw)) as srv:
        r = c.request("GET", srv.url + "/x")
        assert r.status_code == 503 and r.json() == {"error": "overloaded"}


# ---------------------------------------------------------------- stale keep-alive retry


@pytest.mark.parametrize("noticed", [False, True], ids=["close-races-request", "close-seen-while-idle"])
def test_idle_close_by_the_server_resends_once_on_a_fresh_connection(client, noticed):
    def script(conn):
        req = conn.read_request()
        if req is None:
            return
        conn.send(echo(req, conn))
        if conn.index == 1:
            return  # the server's keep-alive timeout: close the idle connection
        while (req := conn.read_request()) is not None:
            conn.send(echo(req, conn))

    c = client()
    with RawServer(script) as srv:
        assert c.request("GET", srv.url + "/a").content == b"/a"
        c.pause(0.2 if noticed else 0.05)  # the server's FIN has arrived
        assert c.request("POST", srv.url + "/b", BODY).content == BODY
        assert [(r.conn, r.target) for r in srv.requests] == [(1, "/a"), (2, "/b")]
        assert c.request("GET", srv.url + "/c").content == b"/c"  # the fresh connection is kept
        assert srv.connections == 2


def test_request_crossing_the_idle_close_is_resent_exactly_once(client):
    """The server reads the request on the kept-alive connection and closes without answering
    (its idle close raced the request): one re-send on a fresh connection."""

    def script(conn):
        if conn.index == 1:
            req = conn.read_request()
            conn.send(echo(req, conn))
            conn.read_request()
            return  # closed without a reply
        while (req := conn.read_request()) is not None:
            conn.send(echo(req, conn))

    c = client()
    with RawServer(script) as srv:
        c.request("GET", srv.url + "/a")
        assert c.request("GET", srv.url + "/b").content == b"/b"
        assert [(r.conn, r.target) for r in srv.requests] == [(1, "/a"), (1, "/b"), (2, "/b")]


def test_the_resend_happens_only_once(client):
    def script(conn):
        req = conn.read_request()
        if conn.index == 1 and req is not None:
            conn.send(echo(req, conn))
            conn.read_request()
        # every later request: read and closed without a reply

    c = client()
    with RawServer(script) as srv:
        c.request("GET", srv.url + "/a")
        with pytest.raises(ConnectionLost):
            c.request("GET", srv.url + "/b")
        assert [(r.conn, r.target) for r in srv.requests] == [(1, "/a"), (1, "/b"), (2, "/b")]
        assert srv.connections == 2


def test_no_resend_when_the_request_went_on_a_fresh_connection(client):
    def script(conn):
        conn.read_request()  # and close without a reply

    c = client()
    with RawServer(script) as srv:
        with pytest.raises(ConnectionLost):
            c.request("POST", srv.url + "/once", BODY)
        assert [(r.conn, r.target) for r in srv.requests] == [(1, "/once")]
        assert srv.connections == 1


def test_no_resend_after_part_of_the_reply_arrived_on_a_reused_connection(client):
    def script(conn):
        req = conn.read_request()
        conn.send(echo(req, conn))
        conn.read_request()
        conn.send(b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nabc")  # and close mid-body

    c = client()
    with RawServer(script) as srv:
        c.request("GET", srv.url + "/a")
        with pytest.raises(ConnectionLost):
            c.request("GET", srv.url + "/b")
        assert [(r.conn, r.target) for r in srv.requests] == [(1, "/a"), (1, "/b")]


def test_no_resend_after_a_timeout_on_a_reused_connection(client):
    def script(conn):
        req = conn.read_request()
        conn.send(echo(req, conn))
        conn.read_request()
        conn.hang()

    c = client(timeout=0.3)
    with RawServer(script) as srv:
        c.request("GET", srv.url + "/a")
        with pytest.raises(TimedOut):
            c.request("GET", srv.url + "/b")
        assert len(srv.requests_for("/b")) == 1


# ---------------------------------------------------------------- failures without a usable reply


def test_a_server_that_never_answers_times_out_within_the_bound(client):
    def script(conn):
        if conn.index == 1:
            conn.read_request()
            conn.hang()
            return
        each_request(echo)(conn)

    c = client(timeout=0.3)
    with RawServer(script) as srv:
        t0 = time.monotonic()
        with pytest.raises(TimedOut) as e:
            c.request("GET", srv.url + "/hang")
        assert time.monotonic() - t0 < 5.0, "the timeout did not bound the wait"
        assert describe(e.value) == "timed out"
        assert c.request("GET", srv.url + "/next").content == b"/next"  # on a fresh connection
        assert srv.connections == 2


def test_a_trickling_reply_times_out_within_the_bound(client):
    """The timeout bounds the whole reply, not each read: a byte every 50 ms never trips a per-read
    timeout of 0.3 s."""

    def script(conn):
        conn.read_request()
        conn.send(b"HTTP/1.1 200 OK\r\ncontent-length: 1000\r\n\r\n")
        for _ in range(400):  # at most 20 s, cut short when the client gives up
            if conn.server.stopping.wait(0.05):
                return
            conn.send(b"x")

    c = client(timeout=0.3)
    with RawServer(script) as srv:
        t0 = time.monotonic()
        with pytest.raises(TimedOut):
            c.request("GET", srv.url + "/trickle")
        assert time.monotonic() - t0 < 5.0, "the timeout did not bound the whole reply"


def test_refused_connection_is_connect_failed(client):
    c = client()
    with pytest.raises(ConnectFailed) as e:
        c.request("GET", f"http://127.0.0.1:{closed_port()}/x")
    assert describe(e.value) == "connection refused or unreachable"


@pytest.mark.parametrize("raw", [
    b"garbage\r\n\r\n",
    b"HTPT/1.1 200 OK\r\ncontent-length: 0\r\n\r\n",
    b"HTTP/1.1 2x0 OK\r\ncontent-length: 0\r\n\r\n",
    b"HTTP/1.1 20\r\ncontent-length: 0\r\n\r\n",
    b"SSH-2.0-OpenSSH_9.2\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nx-a: 1\r\nno colon here\r\ncontent-length: 2\r\n\r\nok",
    b"HTTP/1.1 200 OK\r\n x-folded: 1\r\ncontent-length: 2\r\n\r\nok",
], ids=["garbage", "bad-version", "bad-code", "short-code", "not-http", "header-without-colon", "folded-header"])
def test_malformed_head_is_a_protocol_error(client, raw):
    c = client()
    with RawServer(each_request(lambda req, conn: raw)) as srv:
        with pytest.raises(MalformedReply) as e:
            c.request("GET", srv.url + "/x")
        assert describe(e.value) == "malformed reply"
        assert len(srv.requests) == 1  # a malformed reply is not retried


@pytest.mark.parametrize("head", [
    b"HTTP/1.1 200 OK\r\nx-big: " + b"a" * (100 << 10) + b"\r\ncontent-length: 0\r\n\r\n",
    b"HTTP/1.1 200 OK\r\n" + b"".join(b"x-h%d: v\r\n" % i for i in range(150)) + b"content-length: 0\r\n\r\n",
    b"HTTP/1.1 200 " + b"R" * (100 << 10) + b"\r\ncontent-length: 0\r\n\r\n",
], ids=["header-line-100KB", "150-headers", "status-line-100KB"])
def test_oversize_head_is_a_protocol_error(client, head):
    c = client()
    with RawServer(each_request(lambda req, conn: head)) as srv, pytest.raises(MalformedReply):
        c.request("GET", srv.url + "/x")


@pytest.mark.parametrize("raw", [
    b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\nhello\r\n0\r\n\r\n",
    b"HTTP/1.1 200 OK\r\ncontent-length: abc\r\n\r\nhello",
    b"HTTP/1.1 200 OK\r\ncontent-length: -5\r\n\r\nhello",
], ids=["chunk-size-not-hex", "content-length-not-a-number", "content-length-negative"])
def test_malformed_framing_is_a_protocol_error_without_waiting(client, raw):
    """The server keeps the connection open after the bad bytes: reading "until close" would hang."""

    def script(conn):
        conn.read_request()
        conn.send(raw)
        conn.hang()

    c = client(timeout=3.0)
    with RawServer(script) as srv, pytest.raises(MalformedReply):  # not TimedOut, not ConnectionLost
        c.request("GET", srv.url + "/x")


@pytest.mark.parametrize("raw", [
    b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nonly part of it",
    b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n10\r\nonly part",
    b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n",
    b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n",
], ids=["content-length", "mid-chunk", "before-last-chunk", "mid-head"])
def test_truncated_reply_is_connection_lost(client, raw):
    def script(conn):
        conn.read_request()
        conn.send(raw)  # and close

    c = client()
    with RawServer(script) as srv:
        with pytest.raises(ConnectionLost) as e:
            c.request("GET", srv.url + "/x")
        assert describe(e.value) == "connection lost"
        assert len(srv.requests) == 1


def test_every_failure_is_a_transport_error():
    for cls in (ConnectFailed, TimedOut, ConnectionLost, MalformedReply, ReplyTooLarge):
        assert issubclass(cls, TransportError)


# ---------------------------------------------------------------- the reply size bound


def big_chunked(chunk: int, count: int) -> bytes:
    return (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
            + (b"%x\r\n" % chunk + b"c" * chunk + b"\r\n") * count)


@pytest.mark.parametrize("raw", [
    b"HTTP/1.1 200 OK\r\ncontent-length: 10485760\r\n\r\n" + b"a" * 100,
    big_chunked(2048, 3),
    b"HTTP/1.0 200 OK\r\n\r\n" + b"b" * 6000,
], ids=["content-length", "chunked", "close-delimited"])
def test_a_reply_larger_than_max_body_stops_at_the_bound(client, raw):
    """The server sends a little past the bound and then says nothing more: the client must fail
    from what it has (a wait for the rest would be a timeout, not ReplyTooLarge)."""

    def script(conn):
        if conn.index == 1:
            conn.read_request()
            conn.send(raw)
            conn.hang()
            return
        each_request(echo)(conn)

    c = client(timeout=3.0, max_body=4096)
    with RawServer(script) as srv:
        with pytest.raises(ReplyTooLarge) as e:
            c.request("GET", srv.url + "/big")
        assert describe(e.value) == "reply too large"
        assert isinstance(e.value, MalformedReply)
        assert c.request("GET", srv.url + "/next").content == b"/next"  # a fresh connection
        assert srv.connections == 2


@pytest.mark.parametrize("framing", ["content-length", "chunked", "close-delimited"])
def test_a_reply_of_exactly_max_body_is_accepted(client, framing):
    body = b"q" * 4096
    raw = {"content-length": reply(200, body),
           "chunked": big_chunked(1024, 4) + b"0\r\n\r\n",
           "close-delimited": b"HTTP/1.0 200 OK\r\n\r\n" + body}[framing]

    def script(conn):
        conn.read_request()
        conn.send(raw)
        if framing != "close-delimited":
            each_request(echo)(conn)

    c = client(max_body=4096)
    with RawServer(script) as srv:
        assert c.request("GET", srv.url + "/x").content == (body if framing != "chunked" else b"c" * 4096)


def test_max_body_per_request_overrides_the_clients(client):
    c = client(max_body=1 << 20)
    with RawServer(each_request(lambda req, conn: reply(200, b"m" * 5000))) as srv:
        assert len(c.request("GET", srv.url + "/x").content) == 5000
        with pytest.raises(ReplyTooLarge):
            c.request("GET", srv.url + "/x", max_body=4999)
        assert len(c.request("GET", srv.url + "/x", max_body=5000).content) == 5000
