"""A small synchronous HTTP/1.1 client with one keep-alive connection per server, for the client's
hot path (decode makes ~20 small requests per token).

A blocking socket (TLS from the process's one client context) and a buffer; the protocol rules
(the request head, the reply head, how the body is framed, whether the connection is kept) are
`larql_edge.net.h1`'s, the ones the router's asyncio client reads by. Around them: one kept-alive
connection per server, a whole-reply deadline (every receive waits only for what is left of it), a
`Waiter` that watches each receive (hedged hops race two requests this way), a bound on the reply's
size, one retry of a request that met a connection the server had closed while idle, and failures
mapped onto the shared ``TransportError`` tree.

Why hand-written: ``benchmarks/h1_clients.py`` (loopback, a Sanic server answering like an FFN
shard, 2.5 KB POST -> 2.5 KB reply, one run; ``benchmarks/results/h1_clients.txt``) measured this
client's CPU per request and p50 against the standard library's ``http.client`` (which it was built
on until 2026-12-06: its header parser is the ``email`` package's, and it writes the head and the
body in two sends), a ``urllib3`` pool and ``httpx.Client``: 36 us CPU per request against
http.client's 93 (figures in that file and docs/DESIGN.md §4.2).
"""

from __future__ import annotations

import socket
import ssl
import time
from typing import Protocol
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
    TransportError,
    body_framing,
    chunk_size,
    parse_head,
    request_head,
)
from larql_edge.net.tls import client_context, verify_name

_ONE_SEND = 64 << 10  # a request up to this size goes out in one send (head and body together)


class Waiter(Protocol):
    """Watches a request's reply arrive (``HttpClient.request(..., waiter=)``): called before every
    receive, on the requesting thread. Returns when ``sock`` is readable; raises a `TransportError`
    (e.g. ``Stalled``, ``Superseded``) to give the request up: the connection is then closed and the
    error is the caller's as it is. The hedged hops of ``larql_edge.net.hops`` race two requests this way
    without handing the first one to another thread."""

    def wait(self, sock: socket.socket, deadline: float) -> None: ...


class _NothingReceived(Exception):
    """The server closed (or reset) the connection before any byte of a reply. On a kept-alive
    connection that is the server's idle close crossing our request, and worth one retry."""


class _Closed(Exception):
    """The server closed the connection in the middle of a reply."""


class _Conn:
    """One connection and what has been received on it but not read yet."""

    __slots__ = ("sock", "buf", "deadline", "waiter")

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.buf = bytearray()
        self.deadline = 0.0
        self.waiter: Waiter | None = None

    def _wait(self) -> None:
        """Before each receive: bounded by what is left of the reply's deadline (a server that
        trickles bytes cannot outlast it one receive at a time) and watched by the waiter."""
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("timed out")
        sock = self.sock
        if self.waiter is not None and not (isinstance(sock, ssl.SSLSocket) and sock.pending()):
            self.waiter.wait(sock, self.deadline)  # decrypted bytes waiting need no readable socket
            left = max(1e-3, self.deadline - time.monotonic())
        sock.settimeout(left)

    def _fill(self) -> None:
        self._wait()
        data = self.sock.recv(PIECE)
        if not data:
            raise _Closed
        self.buf += data

    def until(self, sep: bytes, what: str) -> bytes:
        """The bytes up to and with ``sep``, at most `MAX_HEAD` of them before it."""
        buf, start = self.buf, 0
        while (i := buf.find(sep, start)) < 0:
            if len(buf) > MAX_HEAD:
                raise MalformedReply(f"{what} larger than {MAX_HEAD} bytes")
            start = max(0, len(buf) - len(sep) + 1)
            self._fill()
        if i > MAX_HEAD:
            raise MalformedReply(f"{what} larger than {MAX_HEAD} bytes")
        end = i + len(sep)
        out = bytes(buf[:end])
        del buf[:end]
        return out

    def exactly(self, n: int) -> bytes:
        buf = self.buf
        if len(buf) < n:  # the rest is received into place, not appended piece by piece
            whole = bytearray(n)
            got = len(buf)
            whole[:got] = buf
            buf.clear()
            view = memoryview(whole)
            while got < n:
                self._wait()
                k = self.sock.recv_into(view[got:], n - got)
                if not k:
                    raise _Closed
                got += k
            return bytes(whole)
        out = bytes(buf[:n])
        del buf[:n]
        return out

    def until_close(self, limit: int) -> bytes:
        while True:
            if len(self.buf) > limit:
                raise ReplyTooLarge(f"reply larger than the {limit} bytes accepted")
            try:
                self._fill()
            except _Closed:
                out = bytes(self.buf)
                self.buf.clear()
                return out

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


class HttpClient:
    """``timeout`` bounds sending a request and receiving its whole reply; ``connect_timeout`` bounds
    opening a connection; a reply body larger than ``max_body`` bytes is a ``ReplyTooLarge``."""

    def __init__(self, timeout: float = 30.0, connect_timeout: float = 3.0, max_body: int = DEFAULT_MAX_BODY):
        self.timeout = timeout
        self.connect_timeout = min(connect_timeout, timeout)
        self.max_body = max_body
        self._conns: dict[tuple[str, str, int], _Conn] = {}

    def request(self, method: str, url: str, content: bytes | None = None,
                headers: dict[str, str] | None = None, *, max_body: int | None = None,
                waiter: Waiter | None = None) -> Reply:
        u = urlsplit(url)
        scheme = u.scheme or "http"
        host = u.hostname or ""
        port = u.port or (443 if scheme == "https" else 80)
        target = (u.path or "/") + (f"?{u.query}" if u.query else "")
        body = content or b""
        head = request_head(method, target, u.netloc, headers, body)
        limit = self.max_body if max_body is None else max_body
        key = (scheme, host, port)
        for attempt in (0, 1):
            c = self._conns.get(key) if attempt == 0 else None  # the retry always goes on a fresh connection
            if c is not None and c.buf:  # bytes nobody asked for: the connection's state is unknown
                self._drop(key)
                c = None
            reused = c is not None
            if c is None:
                c = self._conns[key] = self._connect(scheme, host, port, url)
            c.deadline, c.waiter = time.monotonic() + self.timeout, waiter
            try:
                c.sock.settimeout(self.timeout)  # sending
                if len(body) <= _ONE_SEND:
                    c.sock.sendall(head + body)
                else:
                    c.sock.sendall(head)
                    c.sock.sendall(body)
                reply, keep = self._read(c, method, limit)
            except _NothingReceived:
                self._drop(key)
                # A kept-alive connection the server closed while idle: re-send once on a fresh
                # one (every request the clients send is idempotent). A fresh connection that
                # closes without a reply is the server's answer, not a race: no retry.
                if reused and attempt == 0:
                    continue
                raise ConnectionLost(f"{url}: connection closed before a reply") from None
            except BaseException as e:  # noqa: BLE001 - whatever it was, the connection's state is unknown
                self._drop(key)
                raise self._mapped(e, url) from None
            if not keep:
                self._drop(key)
            return reply
        raise AssertionError("unreachable")

    def _connect(self, scheme: str, host: str, port: int, url: str) -> _Conn:
        sock: socket.socket | None = None
        try:
            sock = socket.create_connection((host, port), timeout=self.connect_timeout)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # small requests go out at once
            if scheme == "https":
                sock = client_context().wrap_socket(sock, server_hostname=verify_name(host))
        except TimeoutError:
            if sock is not None:
                sock.close()
            raise TimedOut(f"{url}: connect timed out") from None
        except OSError as e:
            if sock is not None:
                sock.close()
            raise ConnectFailed(f"{url}: {e.strerror or e}") from None
        return _Conn(sock)

    @staticmethod
    def _read(c: _Conn, method: str, limit: int) -> tuple[Reply, bool]:
        try:
            head = c.until(b"\r\n\r\n", "reply head")
        except (_Closed, ConnectionResetError, ConnectionAbortedError, BrokenPipeError):
            if not c.buf:
                raise _NothingReceived from None
            raise
        status, version, headers = parse_head(head)
        while 100 <= status < 200 and status != 101:  # an interim reply: the real one follows
            status, version, headers = parse_head(c.until(b"\r\n\r\n", "reply head"))
        kind, n, keep = body_framing(method, status, version, headers, limit)
        if kind == "none":
            body = b""
        elif kind == "length":
            body = c.exactly(n)
        elif kind == "chunked":
            body = HttpClient._chunked(c, limit)
        else:
            body = c.until_close(limit)
        return Reply(status, headers, body), keep

    @staticmethod
    def _chunked(c: _Conn, limit: int) -> bytes:
        parts: list[bytes] = []
        total = 0
        while size := chunk_size(c.until(b"\r\n", "chunk size line")):
            total += size
            if total > limit:
                raise ReplyTooLarge(f"chunked reply larger than the {limit} bytes accepted")
            parts.append(c.exactly(size))
            if c.exactly(2) != b"\r\n":
                raise MalformedReply("chunk data not followed by CRLF")
        for _ in range(MAX_HEADERS + 1):  # trailer fields, read and dropped, up to the blank line
            if c.until(b"\r\n", "trailer line") == b"\r\n":
                return b"".join(parts)
        raise MalformedReply(f"more than {MAX_HEADERS} trailer lines")

    @staticmethod
    def _mapped(e: BaseException, url: str) -> BaseException:
        if isinstance(e, MalformedReply):
            return type(e)(f"{url}: {e}")
        if isinstance(e, TransportError):  # ReplyTooLarge, a waiter's Stalled or Superseded
            return e
        if isinstance(e, (socket.timeout, TimeoutError)):
            return TimedOut(f"{url}: no reply within the timeout")
        if isinstance(e, _Closed):
            return ConnectionLost(f"{url}: connection closed mid-reply")
        if isinstance(e, OSError):
            return ConnectionLost(f"{url}: connection lost ({type(e).__name__})")
        return e  # KeyboardInterrupt and the like: the connection was dropped, the error is the caller's

    def _drop(self, key: tuple[str, str, int]) -> None:
        c = self._conns.pop(key, None)
        if c is not None:
            c.close()

    def close(self) -> None:
        for c in self._conns.values():
            c.close()
        self._conns.clear()

    # A client dropped without close() (a model built and discarded) must not leak its sockets.
    __del__ = close
