"""The delay proxy (larql_edge/tools/delay_proxy.py): latency per direction, intact ordered byte
streams, half-close, cut/heal, and its command line. Fast: loopback sockets only.

Timing is asserted with loose LOWER bounds only (a delay that was not applied cannot pass; a slow
machine can never fail them).
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from larql_edge.tools.delay_proxy import DelayProxy, parse_address

LOOPBACK = "127.0.0.1"


class EchoServer:
    """A threaded TCP server: echoes what it reads, records when each first byte arrived."""

    def __init__(self, reply_prefix: bytes = b""):
        self.sock = socket.create_server((LOOPBACK, 0))
        self.port = self.sock.getsockname()[1]
        self.arrivals: list[float] = []
        self.reply_prefix = reply_prefix
        self._stop = False
        self._thread = threading.Thread(target=self._serve, daemon=True)

    def __enter__(self) -> "EchoServer":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop = True
        self.sock.close()
        self._thread.join(5)

    def _serve(self) -> None:
        self.sock.settimeout(0.2)
        while not self._stop:
            try:
                conn, _ = self.sock.accept()
            except (TimeoutError, socket.timeout):
                continue
            except OSError:
                return
            threading.Thread(target=self._echo, args=(conn,), daemon=True).start()

    def _echo(self, conn: socket.socket) -> None:
        conn.settimeout(30)
        with conn:
            try:
                while True:
                    data = conn.recv(65536)
                    if not data:  # the client half-closed: say goodbye, then close
                        conn.sendall(b"bye")
                        return
                    self.arrivals.append(time.monotonic())
                    conn.sendall(self.reply_prefix + data)
            except OSError:
                return


def connect(port: int, timeout: float = 10.0) -> socket.socket:
    s = socket.create_connection((LOOPBACK, port), timeout=timeout)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def recv_exactly(s: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = s.recv(min(65536, n - len(buf)))
        if not chunk:
            raise AssertionError(f"connection closed after {len(buf)} of {n} bytes")
        buf += chunk
    return bytes(buf)


def test_parse_address():
    assert parse_address("127.0.0.1:9090") == ("127.0.0.1", 9090)
    assert parse_address("[::1]:80") == ("::1", 80)
    for bad in ("9090", "host:", ":80", "host:99999", "host:x"):
        with pytest.raises(ValueError, match="HOST:PORT"):
            parse_address(bad)
    with pytest.raises(ValueError):
        DelayProxy((LOOPBACK, 0), (LOOPBACK, 1), delay_ms=-1)


def test_delay_is_applied_in_each_direction():
    """A byte reaches the server >= delay after it was sent, and its echo comes back >= delay after
    the server sent it: each direction has its own delay (the round trip pays both)."""
    delay_ms = 60.0
    with EchoServer() as echo, DelayProxy((LOOPBACK, 0), (LOOPBACK, echo.port), delay_ms=delay_ms).running() as proxy:
        with connect(proxy.port) as s:
            ups, downs, rtts = [], [], []
            for i in range(3):
                t0 = time.monotonic()
                s.sendall(bytes([65 + i]))
                assert recv_exactly(s, 1) == bytes([65 + i])
                t1 = time.monotonic()
                arrived = echo.arrivals[-1]
                ups.append(arrived - t0)
                downs.append(t1 - arrived)
                rtts.append(t1 - t0)
    slack = 0.005  # clock and scheduling granularity
    assert min(ups) >= delay_ms / 1e3 - slack, ups
    assert min(downs) >= delay_ms / 1e3 - slack, downs
    assert min(rtts) >= 2 * delay_ms / 1e3 - slack, rtts


def test_jitter_never_reorders_and_streams_arrive_intact():
    """8 MB in many small writes through a jittery proxy, echoed back: same bytes, same order."""
    payload = os.urandom(8 * 1024 * 1024)
    with EchoServer() as echo, DelayProxy((LOOPBACK, 0), (LOOPBACK, echo.port), delay_ms=3, jitter_ms=3,
                                          seed=7).running() as proxy:
        with connect(proxy.port, timeout=60) as s:
            received = bytearray()

            def reader() -> None:
                while len(received) < len(payload):
                    chunk = s.recv(65536)
                    if not chunk:
                        return
                    received.extend(chunk)

            t = threading.Thread(target=reader, daemon=True)
            t.start()
            view = memoryview(payload)
            step = 1500  # MTU-sized writes: thousands of chunks, each with its own jitter
            for i in range(0, len(payload), step * 64):
                for j in range(i, min(i + step * 64, len(payload)), step):
                    s.sendall(view[j:j + step])
            t.join(60)
            # (before the socket closes: the echo server then says "bye")
            assert proxy.stats.bytes_up == len(payload) and proxy.stats.bytes_down == len(payload)
        assert len(received) == len(payload)
        assert hashlib.sha256(received).digest() == hashlib.sha256(payload).digest()


def test_half_close_is_passed_on():
    """The client's FIN reaches the server (which answers "bye" and closes); the client reads it all."""
    with EchoServer() as echo, DelayProxy((LOOPBACK, 0), (LOOPBACK, echo.port), delay_ms=5).running() as proxy:
        with connect(proxy.port) as s:
            s.sendall(b"hello")
            assert recv_exactly(s, 5) == b"hello"
            s.shutdown(socket.SHUT_WR)
            rest = b""
            while chunk := s.recv(100):
                rest += chunk
            assert rest == b"bye"


def test_cut_resets_connections_refuses_new_ones_and_heal_reopens():
    with EchoServer() as echo, DelayProxy((LOOPBACK, 0), (LOOPBACK, echo.port), delay_ms=1).running() as proxy:
        port = proxy.port
        s1, s2 = connect(port), connect(port)
        for s in (s1, s2):
            s.sendall(b"x")
            assert recv_exactly(s, 1) == b"x"
        assert proxy.open_connections == 2
        proxy.cut()
        for s in (s1, s2):
            with s:
                try:
                    got = s.recv(10)
                except ConnectionResetError:
                    got = b""
                assert got == b""  # closed (reset), no stray bytes
        assert proxy.open_connections == 0 and proxy.stats.cut_connections == 2
        with pytest.raises(ConnectionRefusedError):
            connect(port, timeout=5).close()
        proxy.heal()
        assert proxy.port == port
        with connect(port) as s:
            s.sendall(b"again")
            assert recv_exactly(s, 5) == b"again"


def test_drop_connections_keeps_accepting():
    with EchoServer() as echo, DelayProxy((LOOPBACK, 0), (LOOPBACK, echo.port)).running() as proxy:
        with connect(proxy.port) as s:
            s.sendall(b"a")
            assert recv_exactly(s, 1) == b"a"
            proxy.drop_connections()
            try:
                assert s.recv(1) == b""
            except ConnectionResetError:
                pass
        with connect(proxy.port) as s:
            s.sendall(b"b")
            assert recv_exactly(s, 1) == b"b"


def test_unreachable_target_closes_the_client():
    dead = socket.create_server((LOOPBACK, 0))
    port = dead.getsockname()[1]
    dead.close()  # nothing listens there now
    with DelayProxy((LOOPBACK, 0), (LOOPBACK, port)).running() as proxy:
        with connect(proxy.port) as s:
            try:
                assert s.recv(1) == b""
            except ConnectionResetError:
                pass
        assert proxy.stats.refused == 1 and proxy.stats.connections == 0


def test_asyncio_api():
    """start()/aclose() inside a caller's event loop; cut() from that loop is scheduled, not blocking."""

    async def main() -> None:
        async def handle(r, w):
            w.write(await r.read(4))
            await w.drain()
            w.close()

        server = await asyncio.start_server(handle, LOOPBACK, 0)
        target = server.sockets[0].getsockname()[1]
        proxy = await DelayProxy((LOOPBACK, 0), (LOOPBACK, target), delay_ms=20).start()
        try:
            t0 = time.monotonic()
            r, w = await asyncio.open_connection(LOOPBACK, proxy.port)
            w.write(b"ping")
            assert await r.readexactly(4) == b"ping"
            assert time.monotonic() - t0 >= 0.04 - 0.005
            w.close()
            proxy.cut()
            await asyncio.sleep(0.1)
            with pytest.raises(ConnectionRefusedError):
                await asyncio.open_connection(LOOPBACK, proxy.port)
        finally:
            await proxy.aclose()
            server.close()
            await server.wait_closed()

    asyncio.run(main())


@pytest.mark.multiprocess
def test_command_line_proxies_and_cuts_on_sigusr1():
    with socket.socket() as probe:
        probe.bind((LOOPBACK, 0))
        port = probe.getsockname()[1]
    with EchoServer() as echo:
        proc = subprocess.Popen([sys.executable, "-m", "larql_edge.tools.delay_proxy", "--listen", f"{LOOPBACK}:{port}",
                                 "--target", f"{LOOPBACK}:{echo.port}", "--delay-ms", "10", "--jitter-ms", "1"],
                                stderr=subprocess.PIPE, text=True)
        try:
            assert "delay_proxy:" in proc.stderr.readline()  # printed once it listens
            with connect(port) as s:
                t0 = time.monotonic()
                s.sendall(b"cli")
                assert recv_exactly(s, 3) == b"cli"
                assert time.monotonic() - t0 >= 0.018 - 0.005
                proc.send_signal(signal.SIGUSR1)
                try:
                    assert s.recv(1) == b""
                except ConnectionResetError:
                    pass
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                try:
                    connect(port, timeout=2).close()
                except ConnectionRefusedError:
                    break
                time.sleep(0.05)
            else:
                pytest.fail("still accepting after SIGUSR1")
            proc.send_signal(signal.SIGUSR2)
            deadline = time.monotonic() + 10
            while True:
                try:
                    with connect(port) as s:
                        s.sendall(b"ok")
                        assert recv_exactly(s, 2) == b"ok"
                    break
                except ConnectionRefusedError:
                    assert time.monotonic() < deadline, "not accepting again after SIGUSR2"
                    time.sleep(0.05)
        finally:
            proc.terminate()
            code = proc.wait(10)
            proc.stderr.close()  # the pipe, or an unraisable ResourceWarning fails a later test
            assert code == 0


@pytest.mark.parametrize("argv, message", [
    ([], "--target is required"),
    (["--target", "nowhere"], "expected HOST:PORT"),
    (["--target", "127.0.0.1:1", "--delay-ms", "-3"], "must be >= 0"),
])
@pytest.mark.multiprocess
def test_command_line_errors(argv, message):
    r = subprocess.run([sys.executable, "-m", "larql_edge.tools.delay_proxy", *argv], capture_output=True, text=True,
                       timeout=30)
    assert r.returncode == 2 and message in r.stderr, r.stderr


def test_stopping_with_bytes_in_flight_is_clean(caplog):
    """Stopping the proxy while a chunk waits out its delay: connections go, nothing is logged as
    an error (asyncio reports a handler task that ends cancelled as an unhandled exception)."""
    with EchoServer() as echo:
        with caplog.at_level("ERROR", logger="asyncio"):
            with DelayProxy((LOOPBACK, 0), (LOOPBACK, echo.port), delay_ms=500).running() as proxy:
                s = connect(proxy.port)
                s.sendall(b"in flight")
                time.sleep(0.05)
            s.close()
        assert [r for r in caplog.records if r.levelname == "ERROR"] == []
