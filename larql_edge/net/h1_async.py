"""A small asyncio HTTP/1.1 client with keep-alive pools, for the router's hot path.

Why not a maintained client: benchmarks/h1_clients.py (one run, loopback, uvloop as in the router,
a Sanic server answering like an FFN shard, 2.5 KB POST -> 2.5 KB reply) measured, sequentially,
p50 319 us for this client against 776 us for ``aiohttp`` (2.4x), 1,373 us for an ``httpcore``
pool (4.3x) and 1,978 us for ``httpx.AsyncClient`` (6.2x); with 32 requests in flight 6,070
requests/s against 3,784, 319 and 311. Decode makes ~20 router hops per token, so the client's
cost decides how close the grid gets to local decode speed. (httpx remains for the membership
traffic, which is not on the hot path.)

The members are our own servers speaking HTTP/1.1 with Content-Length, but every framing a server
may use is read: Content-Length, chunked (extensions and trailers), close-delimited bodies,
HEAD/204/304 without a body, interim 1xx replies. Anything else is a ``MalformedReply``; the head is
bounded (``MAX_HEAD`` bytes, ``MAX_HEADERS`` lines) and the body by ``max_body``.
"""

from __future__ import annotations

import asyncio
from functools import lru_cache
from urllib.parse import urlsplit

from larql_edge.net.h1 import (
    DEFAULT_MAX_BODY,
    MAX_HEAD,
    MAX_HEADERS,
    PIECE,
    ConnectFailed,
    ConnectionLost,
    MalformedReply,
    Reply,
    ReplyTooLarge,
    TimedOut,
    body_framing,
    chunk_size,
    parse_head,
    request_head,
)
from larql_edge.net.tls import client_context, verify_name


@lru_cache(maxsize=1024)
def _split(url: str) -> tuple[str, str, int, str, str]:
    u = urlsplit(url)
    tls = u.scheme == "https"
    port = u.port or (443 if tls else 80)
    target = (u.path or "/") + (f"?{u.query}" if u.query else "")
    host_header = u.netloc
    return u.hostname or "", host_header, port, target, "https" if tls else "http"


class _NothingReceived(Exception):
    """The server closed the connection before any byte of a reply (see ``H1Pool.request``)."""


class _Conn:
    __slots__ = ("reader", "writer")

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.reader, self.writer = reader, writer

    def usable(self) -> bool:
        return not self.reader.at_eof() and not self.writer.is_closing()

    def close(self) -> None:
        try:
            self.writer.close()
        except Exception:  # noqa: BLE001, S110 - closing a broken transport must never raise
            pass


class H1Pool:
    """``timeout`` bounds receiving a whole reply; ``connect_timeout`` bounds opening a connection; a
    reply body larger than ``max_body`` bytes is a ``ReplyTooLarge``; at most ``max_idle`` idle
    connections are kept per server."""

    def __init__(self, timeout: float = 60.0, connect_timeout: float = 2.0, max_idle: int = 64,
                 max_body: int = DEFAULT_MAX_BODY):
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self.max_idle = max_idle
        self.max_body = max_body
        self._idle: dict[tuple[str, int, str], list[_Conn]] = {}

    async def _open(self, host: str, port: int, scheme: str) -> _Conn:
        tls = client_context() if scheme == "https" else None
        writer = None
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port, limit=MAX_HEAD),
                                                    self.connect_timeout)
            if tls is not None:
                # The handshake on the open connection, not open_connection(ssl=): a refused
                # handshake there leaves its transport for the garbage collector.
                await asyncio.wait_for(writer.start_tls(tls, server_hostname=verify_name(host)), self.connect_timeout)
        except BaseException as e:
            if writer is not None:
                writer.close()
            if isinstance(e, TimeoutError):
                raise TimedOut(f"connect to {host}:{port} timed out") from None
            if isinstance(e, OSError):
                raise ConnectFailed(f"connect to {host}:{port}: {e.strerror or e}") from None
            raise
        return _Conn(reader, writer)

    def _pooled(self, key: tuple[str, int, str]) -> _Conn | None:
        idle = self._idle.get(key)
        while idle:
            conn = idle.pop()
            if conn.usable():
                return conn
            conn.close()  # the server closed it while idle, and we have seen that already
        return None

    async def request(self, method: str, url: str, *, content: bytes | None = None,
                      headers: dict[str, str] | None = None, timeout: float | None = None,
                      max_body: int | None = None) -> Reply:
        host, host_header, port, target, scheme = _split(url)
        key = (host, port, scheme)
        body = content or b""
        raw = request_head(method, target, host_header, headers, body) + body
        limit = self.max_body if max_body is None else max_body
        wait = timeout or self.timeout
        for attempt in (0, 1):
            conn = self._pooled(key) if attempt == 0 else None  # the retry always goes on a fresh connection
            reused = conn is not None
            if conn is None:
                conn = await self._open(host, port, scheme)
            try:
                conn.writer.write(raw)
                async with asyncio.timeout(wait):  # no extra task per request, unlike wait_for
                    reply, keep = await self._read(conn.reader, method, limit)
            except _NothingReceived:
                conn.close()
                # A kept-alive connection the server closed while idle, crossing our request:
                # re-send once on a fresh connection (every request the router sends is
                # idempotent). On a fresh connection the close is the server's answer: no retry.
                if reused:
                    continue
                raise ConnectionLost(f"{url}: connection closed before a reply") from None
            except TimeoutError:  # before OSError, of which it is a subclass
                conn.close()
                raise TimedOut(f"{url}: no reply within {wait:g}s") from None
            except MalformedReply as e:
                conn.close()
                raise type(e)(f"{url}: {e}") from None
            except (OSError, asyncio.IncompleteReadError) as e:
                conn.close()
                raise ConnectionLost(f"{url}: connection lost mid-reply ({type(e).__name__})") from None
            except BaseException:
                conn.close()  # cancelled mid-request: the stream state is unknown
                raise
            if keep:
                pool = self._idle.setdefault(key, [])
                if len(pool) < self.max_idle:
                    pool.append(conn)
                else:
                    conn.close()
            else:
                conn.close()
            return reply
        raise AssertionError("unreachable")

    async def _read(self, reader: asyncio.StreamReader, method: str, limit: int) -> tuple[Reply, bool]:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError as e:
            if not e.partial:
                raise _NothingReceived from None
            raise
        except (ConnectionResetError, ConnectionAbortedError, BrokenPipeError):
            raise _NothingReceived from None
        except asyncio.LimitOverrunError:
            raise MalformedReply(f"reply head larger than {MAX_HEAD} bytes") from None
        status, version, headers = parse_head(head)
        while 100 <= status < 200 and status != 101:  # an interim reply: the real one follows
            status, version, headers = parse_head(await self._until(reader, b"\r\n\r\n", "reply head"))
        kind, n, keep = body_framing(method, status, version, headers, limit)
        if kind == "none":
            body = b""
        elif kind == "chunked":
            body = await self._chunked(reader, limit)
        elif kind == "length":
            body = await reader.readexactly(n)
        else:
            body = await self._until_close(reader, limit)
        return Reply(status, headers, body), keep

    @staticmethod
    async def _until(reader: asyncio.StreamReader, separator: bytes, what: str) -> bytes:
        try:
            return await reader.readuntil(separator)
        except asyncio.LimitOverrunError:
            raise MalformedReply(f"{what} larger than {MAX_HEAD} bytes") from None

    async def _chunked(self, reader: asyncio.StreamReader, limit: int) -> bytes:
        parts: list[bytes] = []
        total = 0
        while True:
            size = chunk_size(await self._until(reader, b"\r\n", "chunk size line"))
            if size == 0:
                break
            total += size
            if total > limit:
                raise ReplyTooLarge(f"chunked reply larger than the {limit} bytes accepted")
            parts.append(await reader.readexactly(size))
            if await reader.readexactly(2) != b"\r\n":
                raise MalformedReply("chunk data not followed by CRLF")
        for _ in range(MAX_HEADERS + 1):  # trailer fields, read and dropped, up to the blank line
            if await self._until(reader, b"\r\n", "trailer line") == b"\r\n":
                return b"".join(parts)
        raise MalformedReply(f"more than {MAX_HEADERS} trailer lines")

    @staticmethod
    async def _until_close(reader: asyncio.StreamReader, limit: int) -> bytes:
        parts: list[bytes] = []
        total = 0
        while piece := await reader.read(PIECE):
            total += len(piece)
            if total > limit:
                raise ReplyTooLarge(f"reply larger than the {limit} bytes accepted")
            parts.append(piece)
        return b"".join(parts)

    async def aclose(self) -> None:
        for pool in self._idle.values():
            for conn in pool:
                conn.close()
        self._idle.clear()

