"""A raw-socket HTTP/1.1 test server that answers exactly the bytes a test scripts, for protocol tests
of the hot-path clients (tests/test_h1_clients.py).

    def script(conn):                      # runs in its own thread for every accepted connection
        while (req := conn.read_request()) is not None:
            conn.send(reply(200, b"hello"))

    with RawServer(script) as srv:
        HttpClient().request("GET", srv.url + "/")
        assert srv.requests[0].conn == 1

Every request read is logged in ``srv.requests`` with the number of the connection it came on, so a
test can tell how many times a request was sent and on which connection. Every wait is bounded:
sockets time out after ``io_timeout`` seconds, ``conn.hang()`` returns when the server stops, and
stopping closes every connection and joins the threads.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Self


@dataclass
class Received:
    conn: int  # 1 for the first connection the server accepted
    method: str
    target: str
    headers: dict[str, str]
    body: bytes


def reply(status: int = 200, body: bytes = b"", headers: Iterable[tuple[str, str]] = (), *,
          version: str = "HTTP/1.1", reason: str = "OK", length: bool = True) -> bytes:
    """One reply's bytes; with ``length`` a Content-Length header is added."""
    lines = [f"{version} {status} {reason}", *(f"{k}: {v}" for k, v in headers)]
    if length:
        lines.append(f"content-length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


@dataclass
class RawConn:
    server: RawServer
    sock: socket.socket
    index: int
    buf: bytearray = field(default_factory=bytearray)

    def _fill(self) -> bool:
        try:
            data = self.sock.recv(65536)
        except (TimeoutError, OSError):
            return False
        if not data:
            return False
        self.buf += data
        return True

    def read_request(self) -> Received | None:
        """The next request on this connection, or None when the client closed it (or went quiet)."""
        while b"\r\n\r\n" not in self.buf:
            if not self._fill():
                return None
        head, _, rest = bytes(self.buf).partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        method, target, _ = lines[0].split(" ", 2)
        headers = {}
        for line in lines[1:]:
            k, _, v = line.partition(":")
            headers[k.strip().lower()] = v.strip()
        n = int(headers.get("content-length", "0"))
        self.buf = bytearray(rest)
        while len(self.buf) < n:
            if not self._fill():
                return None
        body, self.buf = bytes(self.buf[:n]), self.buf[n:]
        got = Received(self.index, method, target, headers, body)
        with self.server.lock:
            self.server.requests.append(got)
        return got

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def send_in_pieces(self, data: bytes, size: int, pause: float = 0.005) -> None:
        """Send in small writes with pauses, so the client sees the reply in several reads."""
        for i in range(0, len(data), size):
            self.sock.sendall(data[i:i + size])
            time.sleep(pause)

    def hang(self, limit: float = 30.0) -> None:
        """Say nothing more until the server stops (bounded)."""
        self.server.stopping.wait(limit)

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


class RawServer:
    def __init__(self, script: Callable[[RawConn], None], io_timeout: float = 10.0):
        self.script = script
        self.io_timeout = io_timeout
        self.requests: list[Received] = []
        self.connections = 0
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self._conns: list[RawConn] = []
        self._threads: list[threading.Thread] = []

    def __enter__(self) -> Self:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.05)
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        t = threading.Thread(target=self._accept, name="rawhttp-accept", daemon=True)
        t.start()
        self._threads.append(t)
        return self

    def _accept(self) -> None:
        while not self.stopping.is_set():
            try:
                s, _ = self.sock.accept()
            except (TimeoutError, OSError):
                continue
            s.settimeout(self.io_timeout)
            with self.lock:
                self.connections += 1
                conn = RawConn(self, s, self.connections)
                self._conns.append(conn)
            t = threading.Thread(target=self._serve, args=(conn,), name=f"rawhttp-{conn.index}", daemon=True)
            self._threads.append(t)
            t.start()

    def _serve(self, conn: RawConn) -> None:
        try:
            self.script(conn)
        except OSError:
            pass  # the client went away: that is what several tests do
        finally:
            conn.close()

    def requests_for(self, target: str) -> list[Received]:
        with self.lock:
            return [r for r in self.requests if r.target == target]

    def __exit__(self, *exc) -> None:
        self.stopping.set()
        self._threads[0].join(5)  # the accept loop: no connection is added after it ends
        self.sock.close()
        for c in self._conns:
            c.close()
        for t in self._threads[1:]:
            t.join(5)


def closed_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
