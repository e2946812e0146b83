"""What one round trip to a tier cost, and hedging a slow one.

- `server_seconds`: the compute time a server reports in its ``Server-Timing`` header (every
  larql-edge server sets ``app;dur=MS``: the time from its handler's start to the reply).
- `HopLog`: each answered hop (tier, layer, URL, wall time, server time), bounded; the client's
  ``--timings`` and larql-serve's per-tier histograms read it. Network = wall - server.
- `HopTimes`: how long hops of each size took lately; the hedging threshold (1.5x their p95) and the
  stall bound (8x the slowest, >= 0.5 s) come from it.
- `Hedger`: the hop's request goes out on the caller's thread; when it has not answered by the
  threshold, the same request goes to a second replica (from a small pool) and the first answer wins.
  FFN shards are stateless, so the loser is simply abandoned. Bounded: at most one hedge per hop, and
  a token bucket of hedges per second. A request past the stall bound (a frozen replica: SIGSTOP, a
  paused VM) is given up, even before the p95 is learned or when the budget is spent, its replica is
  reported slow at once, and the hop fails over (to the hedge if one is out, else the caller's own
  failover), so the next hops go elsewhere.
- `StallWaiter`: the same stall bound on an unhedged request (``--no-hedge``, one replica).
"""

from __future__ import annotations

import math
import os
import re
import select
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

from larql_edge.net.h1 import Reply, Stalled, Superseded

T = TypeVar("T")
SERVER_TIMING = "server-timing"
_DUR = re.compile(r"(?:^|[;,\s])dur=([0-9.]+)")


def server_timing_value(seconds: float) -> str:
    """The header value every larql-edge server sends (one place: the service toolkit sets it)."""
    return f"app;dur={seconds * 1e3:.3f}"


def server_seconds(r: Reply) -> float | None:
    """The server's own time for this reply (the first ``dur`` of its Server-Timing), if it says."""
    m = _DUR.search(r.headers.get(SERVER_TIMING, ""))
    return float(m.group(1)) / 1e3 if m else None


@dataclass(frozen=True)
class Hop:
    tier: str  # "embed" | "ffn" | "logits"
    layer: int | None
    url: str
    wall_s: float  # request sent -> reply decoded, as the caller saw it
    server_s: float | None  # what the server says it spent (Server-Timing); None if it does not say
    hedged: bool = False

    @property
    def network_s(self) -> float:
        return max(0.0, self.wall_s - (self.server_s or 0.0))


class HopLog:
    """The recent hops, oldest first; bounded, so nobody reading it costs no memory."""

    def __init__(self, maxlen: int = 20000):
        self._hops: deque[Hop] = deque(maxlen=maxlen)

    def add(self, hop: Hop) -> None:
        self._hops.append(hop)  # deque appends and pops are atomic: serve's step thread writes, its loop reads

    def drain(self) -> list[Hop]:
        out = []
        while True:
            try:
                out.append(self._hops.popleft())
            except IndexError:
                return out


def _wait_readable(fds: list, seconds: float) -> list[int]:
    """The fds of ``fds`` (sockets or descriptors) that are readable within ``seconds`` (poll: no
    FD_SETSIZE limit in a server with many connections)."""
    p = select.poll()
    for f in fds:
        p.register(f, select.POLLIN)
    return [fd for fd, _ in p.poll(max(0, math.ceil(seconds * 1e3)))]


class HopTimes:
    """How long hops of each size (rows, by power of two) took lately: the hedging threshold and the
    stall bound are learned from them. Written on the caller's thread only."""

    MIN_SAMPLES = 20  # no hedging before this many hops of a size have been seen
    WINDOW = 256
    QUANTILE = 0.95
    FACTOR = 1.5  # the threshold: this much beyond the p95 (a hop just above p95 is no tail)
    FLOOR_S = 0.002  # never hedge a hop earlier than this (loopback noise is not a slow replica)
    # A stall: this many times the slowest recent hop of the size, and at least STALL_FLOOR_S. Without it
    # a frozen replica holds the hop for the whole request timeout (the budget and MIN_SAMPLES allow it).
    STALL_FACTOR = 8.0
    STALL_FLOOR_S = 0.5

    def __init__(self):
        self._recent: dict[int, deque[float]] = {}
        self._sorted: dict[int, list[float]] = {}
        self._since_sort: dict[int, int] = {}

    def observe(self, size: int, seconds: float) -> None:
        key = max(1, size).bit_length()
        q = self._recent.setdefault(key, deque(maxlen=self.WINDOW))
        q.append(seconds)
        n = self._since_sort.get(key, 0) + 1
        if n >= 16 or len(q) <= self.MIN_SAMPLES:  # re-sort now and then, not on every hop
            self._sorted[key] = sorted(q)
            n = 0
        self._since_sort[key] = n

    def threshold(self, size: int) -> float | None:
        xs = self._sorted.get(max(1, size).bit_length())
        if not xs or len(xs) < self.MIN_SAMPLES:
            return None
        p = xs[min(len(xs) - 1, int(self.QUANTILE * len(xs)))]
        return max(self.FLOOR_S, p * self.FACTOR)

    def stall_bound(self, size: int) -> float | None:
        """How long a hop of ``size`` may take before it counts as stalled; None before any was seen."""
        q = self._recent.get(max(1, size).bit_length())
        if not q:
            return None
        return max(self.STALL_FLOOR_S, self.STALL_FACTOR * max(q))


class StallWaiter:
    """A request's `Waiter` that gives it up (``Stalled``) at ``t0 + bound`` (monotonic): the
    unhedged hops of the direct path, so a frozen replica costs the bound, not the timeout."""

    def __init__(self, bound: float, on_stall: Callable[[float], None] | None = None):
        self.t0 = time.monotonic()
        self.until = self.t0 + bound
        self.on_stall = on_stall

    def wait(self, sock, deadline: float) -> None:
        now = time.monotonic()
        if now < self.until and _wait_readable([sock], min(deadline, self.until) - now):
            return
        if time.monotonic() >= self.until:
            if self.on_stall is not None:
                self.on_stall(time.monotonic() - self.t0)
            raise Stalled(f"no reply in {self.until - self.t0:.2f}s (8x the slowest recent hop of its size)")
        # the deadline passed first: the socket's own timeout reports it


_PRIMARY, _HEDGE = "primary", "hedge"


class _Race:
    """One hedged hop: the primary request on the caller's thread, the hedge (if sent) on a pool
    thread. Each side's `Waiter` wakes on its socket or on a pipe the other side writes to when it
    ends, so the loser gives up at once (``Superseded``) instead of holding a thread or the caller."""

    def __init__(self, hedger: "Hedger", size: int):
        self.h, self.size = hedger, size
        self.t0 = time.monotonic()
        self.threshold, self.stall = hedger.times.threshold(size), hedger.times.stall_bound(size)
        self.asked = False  # the threshold passed and the budget was asked (once)
        self.send: Callable[[str, object], object] | None = None
        self.second = ""
        self.hedge: Future | None = None
        self.hedge_t0 = 0.0
        self.winner: str | None = None
        self.done = {_PRIMARY: False, _HEDGE: False}
        self._lock = threading.Lock()
        self._r = self._w = -1  # the pipe, made when a hedge is sent

    def finish(self, side: str, ok: bool) -> None:
        with self._lock:
            if ok and self.winner is None:
                self.winner = side
            self.done[side] = True
            if self._w >= 0:
                if all(self.done.values()):
                    os.close(self._r)
                    os.close(self._w)
                    self._r = self._w = -1
                else:
                    os.write(self._w, b"x")  # wake the other side's waiter

    def start_hedge(self, send: Callable[[str, object], object], second: str) -> None:
        r, w = os.pipe()
        self._r, self._w = r, w
        self.hedge_t0 = time.monotonic()
        self.h.sent += 1
        self.hedge = self.h._submit(self._run_hedge, send, second)

    def _run_hedge(self, send: Callable[[str, object], object], url: str) -> object:
        ok = False
        try:
            value = send(url, _Side(self, _HEDGE))
            ok = True
            return value
        finally:
            self.finish(_HEDGE, ok)

    def wait(self, side: str, sock, deadline: float) -> None:
        while True:
            if self.winner is not None and self.winner != side:
                raise Superseded("the other request of this hedged hop answered first")
            now = time.monotonic()
            if side == _PRIMARY:
                at = [t for t in ((None if self.asked or self.threshold is None else self.t0 + self.threshold),
                                  (None if self.stall is None else self.t0 + self.stall)) if t is not None]
            else:
                at = [] if self.stall is None else [self.hedge_t0 + self.stall]
            until = min([deadline, *at])
            pipe = self._pipe_for(side)
            ready = _wait_readable([sock] if pipe < 0 else [sock, pipe], until - now)
            if self.winner is not None and self.winner != side:
                continue  # (raises above)
            if sock.fileno() in ready:
                return
            if ready:
                continue  # the other side ended: its pipe byte is left unread, so it is watched no more
            now = time.monotonic()
            if now >= deadline:
                return  # the socket's own timeout reports it
            if side == _HEDGE:
                if self.stall is not None and now >= self.hedge_t0 + self.stall:
                    raise Stalled(f"hedge: no reply in {now - self.hedge_t0:.2f}s")
                continue
            if self.stall is not None and now >= self.t0 + self.stall:
                self.h.stalls += 1
                raise Stalled(f"no reply in {now - self.t0:.2f}s (8x the slowest recent hop of its size)")
            if not self.asked and self.threshold is not None and now >= self.t0 + self.threshold:
                self.asked = True
                if self.hedge is None and self.send is not None and self.h._room() and self.h._take():
                    self.start_hedge(self.send, self.second)

    def _pipe_for(self, side: str) -> int:
        other = _HEDGE if side == _PRIMARY else _PRIMARY
        with self._lock:
            return self._r if self._r >= 0 and not self.done[other] else -1


class _Side:
    """The `Waiter` of one side of a race."""

    def __init__(self, race: _Race, side: str):
        self.race, self.side = race, side

    def wait(self, sock, deadline: float) -> None:
        self.race.wait(self.side, sock, deadline)


class Hedger:
    """Hedged hops over replicas of one thing. The primary request runs on the caller's thread (a
    hand-off to another thread costs about what a hop on loopback does, more on a loaded machine);
    only a hedge goes to a small pool of threads, each with its own keep-alive connections
    (``make_client()`` per thread; the caller's thread has its own too)."""

    def __init__(self, make_client: Callable[[], object], budget_per_s: float = 20.0, threads: int = 4,
                 clock: Callable[[], float] = time.monotonic, times: HopTimes | None = None):
        self.make_client = make_client
        self.budget_per_s = budget_per_s
        self.clock = clock
        self.times = times if times is not None else HopTimes()
        self._tokens = budget_per_s
        self._last = clock()
        self._local = threading.local()
        self._threads = threads
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="larql-hedge")
        self._busy = 0  # hedges submitted, not finished
        self._lock = threading.Lock()
        self.hops = 0
        self.sent = 0
        self.won = 0
        self.stalls = 0  # primaries given up at the stall bound (the caller's failover took the hop)

    def client(self):
        c = getattr(self._local, "client", None)
        if c is None:
            c = self._local.client = self.make_client()
        return c

    # the learned times (kept here too: tests and the metrics read them through the hedger)
    def observe(self, size: int, seconds: float) -> None:
        self.times.observe(size, seconds)

    def threshold(self, size: int) -> float | None:
        return self.times.threshold(size)

    def stall_bound(self, size: int) -> float | None:
        return self.times.stall_bound(size)

    def _submit(self, fn: Callable, *args) -> Future:
        with self._lock:
            self._busy += 1
        f = self._pool.submit(fn, *args)
        f.add_done_callback(self._release)
        return f

    def _release(self, _f: Future) -> None:
        with self._lock:
            self._busy -= 1

    def _room(self) -> bool:
        return self._busy < self._threads  # hedges to a stalled replica end at their own stall bound

    def _take(self) -> bool:
        now = self.clock()
        self._tokens = min(self.budget_per_s, self._tokens + (now - self._last) * self.budget_per_s)
        self._last = now
        if self._tokens >= 1.0:
            self._tokens -= 1.0
            return True
        return False

    # -- one hop ---------------------------------------------------------------------------------------
    def run(self, size: int, primary: str, second: str, send: Callable[[str, object], T],
            on_late: Callable[[str, float], None] | None = None) -> tuple[str, T, bool] | None:
        """``send(url, waiter)`` on ``primary``, on this thread; past the threshold (and within the
        budget), once, on ``second`` too, from the pool. ``send`` passes ``waiter`` to
        `HttpClient.request` (or calls ``waiter.wait(sock, deadline)`` before each receive). Returns
        (url, value, hedged) of the first success, or None when every request sent failed or the
        primary stalled (past the stall bound) unhedged: the caller then fails over as usual.
        ``on_late(url, seconds)`` hears how long a losing or stalled request had taken."""
        self.hops += 1
        race = _Race(self, size)
        race.send, race.second = send, second
        value: T | None = None
        ok = False
        try:
            value = send(primary, _Side(race, _PRIMARY))
            ok = True
        except Exception as e:  # noqa: BLE001 - Superseded (the hedge won), Stalled, or the primary failed
            if isinstance(e, Stalled) and on_late is not None:
                on_late(primary, time.monotonic() - race.t0)
        finally:
            race.finish(_PRIMARY, ok)
        hedged = race.hedge is not None
        if ok:
            if hedged and on_late is not None:  # the hedge lost: as slow as it has been so far
                on_late(second, time.monotonic() - race.hedge_t0)
            self.times.observe(size, time.monotonic() - race.t0)
            return primary, value, hedged  # type: ignore[return-value]
        if race.hedge is None:
            return None
        try:
            value = race.hedge.result()
        except Exception:  # noqa: BLE001 - the hedge failed too (or stalled): the caller's failover
            return None
        if race.winner == _HEDGE and on_late is not None:
            on_late(primary, time.monotonic() - race.t0)
        self.won += 1
        self.times.observe(size, time.monotonic() - race.t0)
        return second, value, True

    def stats(self) -> dict:
        return {"hops": self.hops, "hedges_sent": self.sent, "hedges_won": self.won, "stalls": self.stalls,
                "budget_per_s": self.budget_per_s}

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
