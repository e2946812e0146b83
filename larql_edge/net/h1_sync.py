"""A small synchronous HTTP/1.1 client with one keep-alive connection per server, for the client's
hot path (decode makes ~20 small requests per token).

It is the standard library's ``http.client`` (which parses the replies: status line, headers,
Content-Length, chunked with extensions and trailers, close-delimited bodies, HEAD/204/304) plus
what the hot path needs around it: one kept-alive connection per server, a whole-reply deadline, a
bound on the reply's size, one retry of a request that met a connection the server had closed
while idle, and failures mapped onto the shared ``TransportError`` tree.

Why not a maintained client: benchmarks/h1_clients.py (one run, loopback, a Sanic server answering
like an FFN shard, 2.5 KB POST -> 2.5 KB reply) measured p50 498 us for this client against
469 us for bare ``http.client`` (the wrapper costs ~5%), 707 us for a ``urllib3`` pool (1.4x) and
1,065 us for ``httpx.Client`` (2.1x); client CPU per request 315 us, 573 us and 922 us. Over ~20
round trips a decoded token, httpx would add ~11 ms a token.
"""

from __future__ import annotations

import http.client
import socket
import ssl
import time
from typing import Protocol
from urllib.parse import urlsplit

from larql_edge.net.h1 import (
    DEFAULT_MAX_BODY,
    ConnectFailed,
    ConnectionLost,
    MalformedReply,
    Reply,
    ReplyTooLarge,
    TimedOut,
    TransportError,
)
from larql_edge.net.tls import client_context, verify_name

PIECE = 64 << 10  # chunked and close-delimited bodies are read in pieces, so the size bound stops early

# Nothing of a reply arrived: the server closed (or reset) the connection before answering. On a
# kept-alive connection that is the server's idle close crossing our request, and worth one retry.
_NOTHING_RECEIVED = (http.client.RemoteDisconnected, ConnectionResetError, ConnectionAbortedError, BrokenPipeError)


class Waiter(Protocol):
    """Watches a request's reply arrive (``HttpClient.request(..., waiter=)``): called before every
    receive, on the requesting thread. Returns when ``sock`` is readable; raises a `TransportError`
    (e.g. ``Stalled``, ``Superseded``) to give the request up: the connection is then closed and the
    error is the caller's as it is. The hedged hops of ``larql_edge.net.hops`` race two requests this way
    without handing the first one to another thread."""

    def wait(self, sock: socket.socket, deadline: float) -> None: ...


class _Deadline:
    """Every receive bounded by what is left of the request's deadline, and watched by its waiter.

    ``http.client`` reads a reply with many receives, each under the socket's timeout; a server
    that trickles bytes would never trip a per-receive timeout. Setting the timeout to the time
    left before each receive makes ``timeout`` a bound on the whole reply."""

    deadline: float | None = None
    waiter: Waiter | None = None

    def _before_recv(self) -> None:
        if self.deadline is not None:
            left = self.deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("timed out")
            if self.waiter is not None and not self._buffered():
                self.waiter.wait(self, self.deadline)  # type: ignore[arg-type]
                left = max(1e-3, self.deadline - time.monotonic())
            self.settimeout(left)  # type: ignore[attr-defined]

    def _buffered(self) -> bool:
        return False


class _DeadlineSocket(_Deadline, socket.socket):
    def recv_into(self, buffer, nbytes=0, flags=0):
        self._before_recv()
        return super().recv_into(buffer, nbytes, flags)


class _DeadlineSslSocket(_Deadline, ssl.SSLSocket):
    def _buffered(self) -> bool:
        return self.pending() > 0  # decrypted bytes waiting: the socket need not become readable

    def recv_into(self, buffer, nbytes=None, flags=0):
        self._before_recv()
        return super().recv_into(buffer, nbytes, flags)


class _Connection(http.client.HTTPConnection):
    """Connect with the connect timeout; reads are bounded by the request's deadline; no Nagle delay
    (``http.client`` sets TCP_NODELAY itself)."""

    def __init__(self, host: str, port: int, connect_timeout: float):
        super().__init__(host, port, timeout=connect_timeout)

    def connect(self) -> None:
        super().connect()
        s = self.sock
        self.sock = _DeadlineSocket(s.family, s.type, s.proto, fileno=s.detach())

    def start(self, timeout: float, deadline: float, waiter: Waiter | None) -> None:
        sock = self.sock
        assert isinstance(sock, _Deadline)  # connect() made it one
        sock.settimeout(timeout)  # type: ignore[attr-defined]  # sending (a socket: _Deadline is its mixin)
        sock.deadline = deadline  # receiving
        sock.waiter = waiter


class _TlsConnection(_Connection, http.client.HTTPSConnection):
    """The same deadline and waiter over TLS: the context wraps sockets in `_DeadlineSslSocket`."""

    def __init__(self, host: str, port: int, connect_timeout: float):
        ctx = client_context()
        if ctx.sslsocket_class is not _DeadlineSslSocket:
            ctx.sslsocket_class = _DeadlineSslSocket  # the documented hook (this process's client context)
        http.client.HTTPSConnection.__init__(self, host, port, timeout=connect_timeout, context=ctx)

    def connect(self) -> None:
        # http.client's, with the name the server is verified under (--tls-server-name); the context's
        # sslsocket_class makes the wrapped socket a `_DeadlineSslSocket`
        http.client.HTTPConnection.connect(self)
        self.sock = self._context.wrap_socket(self.sock, server_hostname=verify_name(self.host))  # type: ignore[attr-defined]


class HttpClient:
    """``timeout`` bounds sending a request and receiving its whole reply; ``connect_timeout`` bounds
    opening a connection; a reply body larger than ``max_body`` bytes is a ``ReplyTooLarge``."""

    def __init__(self, timeout: float = 30.0, connect_timeout: float = 3.0, max_body: int = DEFAULT_MAX_BODY):
        self.timeout = timeout
        self.connect_timeout = min(connect_timeout, timeout)
        self.max_body = max_body
        self._conns: dict[tuple[str, str, int], _Connection | _TlsConnection] = {}

    def _conn(self, scheme: str, host: str, port: int) -> _Connection | _TlsConnection:
        key = (scheme, host, port)
        c = self._conns.get(key)
        if c is None:
            c = self._conns[key] = (_TlsConnection if scheme == "https" else _Connection)(host, port, self.connect_timeout)
        return c

    def request(self, method: str, url: str, content: bytes | None = None,
                headers: dict[str, str] | None = None, *, max_body: int | None = None,
                waiter: Waiter | None = None) -> Reply:
        u = urlsplit(url)
        scheme = u.scheme or "http"
        port = u.port or (443 if scheme == "https" else 80)
        target = (u.path or "/") + (f"?{u.query}" if u.query else "")
        limit = self.max_body if max_body is None else max_body
        for attempt in (0, 1):
            c = self._conn(scheme, u.hostname or "", port)
            reused = c.sock is not None
            if not reused:
                self._connect(c, url)
            c.start(self.timeout, time.monotonic() + self.timeout, waiter)
            try:
                c.request(method, target, body=content, headers=headers or {})
                r = c.getresponse()
            except _NOTHING_RECEIVED as e:
                self._drop(c)
                # A kept-alive connection the server closed while idle: re-send once on a fresh
                # one (every request the clients send is idempotent). A fresh connection that
                # closes without a reply is the server's answer, not a race: no retry.
                if reused and attempt == 0:
                    continue
                raise ConnectionLost(f"{url}: connection closed before a reply ({type(e).__name__})") from None
            except BaseException as e:  # noqa: BLE001 - whatever it was, the connection's state is unknown
                self._drop(c)
                raise self._mapped(e, url) from None
            try:
                body = self._body(r, limit, url)
            except BaseException as e:  # noqa: BLE001
                r.close()  # it holds a reference to the socket's file: close it, or the fd leaks
                self._drop(c)  # the rest of the reply is unread: the connection cannot be reused
                raise self._mapped(e, url) from None
            if r.will_close:
                self._drop(c)
            return Reply(r.status, {k.lower(): v for k, v in r.getheaders()}, body)
        raise AssertionError("unreachable")

    def _connect(self, c: http.client.HTTPConnection, url: str) -> None:
        try:
            c.connect()
        except TimeoutError:
            self._drop(c)
            raise TimedOut(f"{url}: connect timed out") from None
        except OSError as e:
            self._drop(c)
            raise ConnectFailed(f"{url}: {e.strerror or e}") from None

    @staticmethod
    def _body(r: http.client.HTTPResponse, limit: int, url: str) -> bytes:
        if r.msg.defects:
            # A header line without a colon (or a folded first line): the stdlib's header parser
            # drops every header after it, Content-Length included, and would read "until close".
            raise MalformedReply(f"{url}: malformed header ({type(r.msg.defects[0]).__name__})")
        if r.length is not None:  # Content-Length (or none at all: HEAD, 204, 304, 1xx)
            if r.length > limit:
                raise ReplyTooLarge(f"{url}: reply of {r.length} bytes, more than the {limit} accepted")
            return r.read()
        if not r.chunked and r.getheader("content-length") is not None:
            # http.client reads an unparsable Content-Length as "until the server closes".
            raise MalformedReply(f"{url}: invalid Content-Length {r.getheader('content-length')!r}")
        parts: list[bytes] = []
        total = 0
        while piece := r.read(min(PIECE, limit + 1 - total)):
            total += len(piece)
            if total > limit:
                raise ReplyTooLarge(f"{url}: reply larger than the {limit} bytes accepted")
            parts.append(piece)
        return b"".join(parts)

    @staticmethod
    def _mapped(e: BaseException, url: str) -> BaseException:
        if isinstance(e, TransportError):  # ReplyTooLarge, MalformedReply, a waiter's Stalled or Superseded
            return e
        if isinstance(e, (socket.timeout, TimeoutError)):
            return TimedOut(f"{url}: no reply within the timeout")
        if isinstance(e, http.client.IncompleteRead):
            # Also what http.client raises for a chunk size that is not hexadecimal: the stdlib
            # does not tell that apart from a connection closed mid-reply.
            return ConnectionLost(f"{url}: connection closed mid-reply ({len(e.partial)} bytes read)")
        if isinstance(e, http.client.HTTPException):
            # BadStatusLine, LineTooLong (status, header, chunk size or trailer line), more than
            # 100 headers, UnknownProtocol.
            return MalformedReply(f"{url}: malformed reply ({type(e).__name__}: {str(e)[:80]})")
        if isinstance(e, OSError):
            return ConnectionLost(f"{url}: connection lost ({type(e).__name__})")
        return e  # KeyboardInterrupt and the like: the connection was dropped, the error is the caller's

    def _drop(self, c: http.client.HTTPConnection) -> None:
        c.close()

    def close(self) -> None:
        for c in self._conns.values():
            c.close()
        self._conns.clear()

    # A client dropped without close() (a model built and discarded) must not leak its sockets.
    __del__ = close
