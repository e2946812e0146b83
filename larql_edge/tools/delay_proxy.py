"""A TCP proxy that adds latency: a WAN link between a client and a grid, on one machine.

    python -m larql_edge.tools.delay_proxy --listen 127.0.0.1:19090 --target 127.0.0.1:9090 \\
        --delay-ms 10 --jitter-ms 1

Every chunk read from one side is written to the other side ``delay`` later (plus a uniform jitter
in ``[-jitter, +jitter]``), in each direction on its own, so a request/reply round trip costs
``2 x delay``. Chunks of one direction never overtake each other (a chunk is due no earlier than
the one before it), so the byte stream arrives intact and in order, as over TCP. A half-close
(EOF) is delayed like data.

Why user space: this machine's kernel has no netem (``tc qdisc ... netem`` is unknown), so latency
cannot come from the kernel. The proxy is one asyncio loop: it costs ~tens of microseconds per
chunk, far below the delays it adds.

`cut()` aborts every open connection (both sides see a reset) and refuses new ones (the listening
socket is closed: connection refused) until `heal()`. Memory is bounded: at most
``MAX_QUEUED_CHUNKS`` chunks wait per direction; beyond that the proxy stops reading and TCP's own
flow control pushes back on the sender.

Python API (tests, benchmarks)::

    with DelayProxy(("127.0.0.1", 0), ("127.0.0.1", 9090), delay_ms=10).running() as proxy:
        url = proxy.url            # http://127.0.0.1:<port>
        proxy.cut(); proxy.heal()

or inside a running event loop: ``await proxy.start()`` ... ``await proxy.aclose()``.
SIGUSR1 cuts and SIGUSR2 heals a proxy started from the command line.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import random
import signal
import socket
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass

log = logging.getLogger("larql.delay_proxy")

CHUNK = 64 * 1024
MAX_QUEUED_CHUNKS = 256  # per direction and connection: <= 16 MiB in flight
CONNECT_TIMEOUT_S = 5.0
_EOF = object()  # the sender half-closed: half-close the other side too
_RESET = object()  # the sender's connection broke: abort the other side too


def parse_address(text: str) -> tuple[str, int]:
    """``HOST:PORT`` or ``[V6]:PORT`` -> (host, port); a clear ValueError otherwise."""
    host, sep, port = text.strip().rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"{text!r}: expected HOST:PORT")
    return host.strip("[]"), int(port)


@dataclass
class Stats:
    connections: int = 0  # accepted and connected to the target
    refused: int = 0  # accepted but the target could not be reached
    bytes_up: int = 0  # client -> target
    bytes_down: int = 0  # target -> client
    cut_connections: int = 0


class DelayProxy:
    """listen -> target, ``delay_ms`` (+- ``jitter_ms``) added to every chunk in each direction."""

    def __init__(self, listen: tuple[str, int], target: tuple[str, int], *, delay_ms: float = 0.0,
                 jitter_ms: float = 0.0, seed: int | None = None):
        if delay_ms < 0 or jitter_ms < 0:
            raise ValueError("delay and jitter must be >= 0 ms")
        self.listen_host, self.listen_port = listen
        self.target = target
        self.delay = delay_ms / 1e3
        self.jitter = jitter_ms / 1e3
        self.stats = Stats()
        self._rng = random.Random(seed)
        self._server: asyncio.AbstractServer | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._conns: set[tuple[asyncio.StreamWriter, asyncio.StreamWriter]] = set()
        self._tasks: set[asyncio.Task] = set()
        self._cut = False
        self._thread: threading.Thread | None = None

    # ---- address ---------------------------------------------------------------------------

    @property
    def port(self) -> int:
        return self.listen_port

    @property
    def address(self) -> str:
        host = f"[{self.listen_host}]" if ":" in self.listen_host else self.listen_host
        return f"{host}:{self.listen_port}"

    @property
    def url(self) -> str:
        return f"http://{self.address}"

    @property
    def open_connections(self) -> int:
        return len(self._conns)

    # ---- lifecycle (inside an event loop) --------------------------------------------------

    async def start(self) -> "DelayProxy":
        self._loop = asyncio.get_running_loop()
        await self._listen()
        log.info("delay proxy %s -> %s:%d, %.1f ms +- %.1f ms each way", self.address, *self.target,
                 self.delay * 1e3, self.jitter * 1e3)
        return self

    async def _listen(self) -> None:
        # reuse_address: heal() binds the same port again right after cut() closed it.
        self._server = await asyncio.start_server(self._accept, self.listen_host, self.listen_port,
                                                  reuse_address=True)
        self.listen_port = self._server.sockets[0].getsockname()[1]  # a port of 0 is now a real one

    async def aclose(self) -> None:
        await self._cut_now(refuse=True)
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _cut_now(self, refuse: bool = True) -> None:
        server = None
        if refuse:
            self._cut = True
            server, self._server = self._server, None
            if server is not None:
                server.close()  # no new connections: a client now sees "connection refused"
        for a, b in list(self._conns):
            for w in (a, b):
                w.transport.abort()  # RST to both peers: the link is gone, not a polite close
            self.stats.cut_connections += 1
        self._conns.clear()
        if server is not None:
            # (Python >= 3.12 waits here for the connection handlers too; they end on the aborts.)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(server.wait_closed(), 5.0)

    async def _heal_now(self) -> None:
        self._cut = False
        if self._server is None:
            await self._listen()

    # ---- thread-safe controls ---------------------------------------------------------------

    def _call(self, coro_fn, timeout: float = 10.0) -> None:
        if self._loop is None:
            raise RuntimeError("the proxy is not running")
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self._loop:  # called from the proxy's own loop: schedule, cannot block it
            self._spawn(coro_fn())
            return
        asyncio.run_coroutine_threadsafe(coro_fn(), self._loop).result(timeout)

    def cut(self) -> None:
        """Abort every connection (both peers see a reset) and refuse new ones until `heal()`."""
        self._call(lambda: self._cut_now(refuse=True))

    def drop_connections(self) -> None:
        """Abort every open connection but keep accepting new ones (a flapping link)."""
        self._call(lambda: self._cut_now(refuse=False))

    def heal(self) -> None:
        """Accept connections again after `cut()` (on the same port)."""
        self._call(self._heal_now)

    @contextlib.contextmanager
    def running(self, timeout: float = 10.0) -> Iterator["DelayProxy"]:
        """Run the proxy in a thread of its own (its own event loop) for the ``with`` block."""
        ready = threading.Event()
        failure: list[BaseException] = []
        stop: list[asyncio.Event] = []

        async def main() -> None:
            stop.append(asyncio.Event())
            try:
                await self.start()
            except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
                failure.append(e)
                ready.set()
                return
            ready.set()
            await stop[0].wait()
            await self.aclose()

        self._thread = threading.Thread(target=asyncio.run, args=(main(),), name="delay-proxy", daemon=True)
        self._thread.start()
        if not ready.wait(timeout):
            raise TimeoutError(f"delay proxy did not start in {timeout}s")
        if failure:
            self._thread.join(timeout)
            raise failure[0]
        try:
            yield self
        finally:
            loop = self._loop
            if loop is not None and not loop.is_closed():
                with contextlib.suppress(RuntimeError):
                    loop.call_soon_threadsafe(stop[0].set)
            self._thread.join(timeout)

    # ---- the proxying ----------------------------------------------------------------------

    def _spawn(self, coro) -> asyncio.Task:
        t = asyncio.ensure_future(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)
        return t

    def _due(self, last_due: float) -> float:
        d = self.delay
        if self.jitter:
            d += self._rng.uniform(-self.jitter, self.jitter)
        # Never before the previous chunk of this direction: order is preserved.
        return max(asyncio.get_running_loop().time() + max(d, 0.0), last_due)

    async def _accept(self, c_reader: asyncio.StreamReader, c_writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:  # aclose() cancels and awaits every connection handler
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        try:
            await self._proxy(c_reader, c_writer)
        except asyncio.CancelledError:
            # The end of this connection's own task: returning (not re-raising) keeps asyncio's
            # stream callback (3.11) from logging the cancellation as an error.
            c_writer.transport.abort()

    async def _proxy(self, c_reader: asyncio.StreamReader, c_writer: asyncio.StreamWriter) -> None:
        if self._cut:
            c_writer.transport.abort()
            return
        try:
            t_reader, t_writer = await asyncio.wait_for(asyncio.open_connection(*self.target), CONNECT_TIMEOUT_S)
        except (OSError, asyncio.TimeoutError) as e:
            self.stats.refused += 1
            log.debug("target %s:%d unreachable: %s", *self.target, e)
            c_writer.transport.abort()  # the client sees what it would see from the target: no peer
            return
        for w in (c_writer, t_writer):
            sock = w.get_extra_info("socket")
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        pair = (c_writer, t_writer)
        self._conns.add(pair)
        self.stats.connections += 1
        try:
            await asyncio.gather(self._pipe(c_reader, t_writer, "bytes_up"),
                                 self._pipe(t_reader, c_writer, "bytes_down"))
        finally:
            self._conns.discard(pair)
            for w in pair:
                w.close()

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, counter: str) -> None:
        """One direction: a reader stamps each chunk with its due time, a writer sends it then."""
        queue: asyncio.Queue = asyncio.Queue(MAX_QUEUED_CHUNKS)
        loop = asyncio.get_running_loop()

        async def read() -> None:
            last = 0.0
            try:
                while True:
                    data = await reader.read(CHUNK)
                    last = self._due(last)
                    if not data:
                        await queue.put((last, _EOF))
                        return
                    setattr(self.stats, counter, getattr(self.stats, counter) + len(data))
                    await queue.put((last, data))
            except (ConnectionError, OSError):
                await queue.put((self._due(last), _RESET))

        async def write() -> None:
            while True:
                due, data = await queue.get()
                wait = due - loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)
                if data is _RESET:
                    writer.transport.abort()
                    return
                if data is _EOF:
                    with contextlib.suppress(OSError, RuntimeError):
                        if writer.can_write_eof():
                            writer.write_eof()
                    return
                writer.write(data)
                await writer.drain()

        reader_task = asyncio.ensure_future(read())
        try:
            await write()
        except (ConnectionError, OSError):
            pass
        finally:
            reader_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, ConnectionError, OSError):
                await reader_task


# ---- command line -------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    from larql_edge.config import Flags

    p = argparse.ArgumentParser(prog="python -m larql_edge.tools.delay_proxy",
                                description="TCP proxy adding a fixed latency plus jitter to each direction "
                                "(a WAN link on one machine). SIGUSR1 cuts every connection, SIGUSR2 heals.")
    f = Flags(p)
    f.add("--listen", default="127.0.0.1:19090", metavar="HOST:PORT", help="address to accept clients on",
          env="LARQL_DELAY_PROXY_LISTEN")
    f.add("--target", default=None, metavar="HOST:PORT", help="address to forward to (required)",
          env="LARQL_DELAY_PROXY_TARGET")
    f.add("--delay-ms", type=float, default=0.0, help="latency added to each direction (ms)",
          env="LARQL_DELAY_PROXY_DELAY_MS")
    f.add("--jitter-ms", type=float, default=0.0, help="uniform jitter +- this much on each chunk (ms)",
          env="LARQL_DELAY_PROXY_JITTER_MS")
    f.add("--seed", type=int, default=None, help="jitter seed (reproducible runs)", env="LARQL_DELAY_PROXY_SEED")
    f.add("--log-level", default="info", help="debug, info, warning", env="LARQL_DELAY_PROXY_LOG_LEVEL")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.target:
        parser.error("--target is required")
    try:
        listen, target = parse_address(args.listen), parse_address(args.target)
    except ValueError as e:
        parser.error(str(e))
    if args.delay_ms < 0 or args.jitter_ms < 0:
        parser.error("--delay-ms and --jitter-ms must be >= 0")
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s: %(message)s")
    proxy = DelayProxy(listen, target, delay_ms=args.delay_ms, jitter_ms=args.jitter_ms, seed=args.seed)

    async def serve() -> None:
        try:
            await proxy.start()
        except OSError as e:
            raise SystemExit(f"delay_proxy: cannot listen on {args.listen}: {e.strerror or e}") from None
        loop = asyncio.get_running_loop()
        done = asyncio.Event()
        for sig, fn in ((signal.SIGUSR1, proxy.cut), (signal.SIGUSR2, proxy.heal)):
            loop.add_signal_handler(sig, fn)
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, done.set)
        print(f"delay_proxy: {proxy.address} -> {args.target}, {args.delay_ms:g} ms +- {args.jitter_ms:g} ms "
              "each way (Ctrl-C stops)", file=sys.stderr, flush=True)
        await done.wait()
        await proxy.aclose()

    asyncio.run(serve())
    return 0


if __name__ == "__main__":
    sys.exit(main())
