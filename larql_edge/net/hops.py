"""What one round trip to a tier cost, and hedging a slow one.

- `server_seconds`: the compute time a server reports in its ``Server-Timing`` header (every
  larql-edge server sets ``app;dur=MS``: the time from its handler's start to the reply).
- `HopLog`: each answered hop (tier, layer, URL, wall time, server time), bounded; the client's
  ``--timings`` and larql-serve's per-tier histograms read it. Network = wall - server.
- `Hedger`: when a hop has not answered by a threshold learned from recent hops (the p95 of hops of
  the same size), the same request goes to a second replica and the first answer wins. FFN shards
  are stateless, so the loser is simply ignored. Bounded: at most one hedge per hop, and a token
  bucket of hedges per second. A hop that has stalled far beyond anything seen at its size (a
  frozen replica: SIGSTOP, a paused VM) is hedged even before the p95 is learned or when the budget
  is spent, and its replica is reported slow at once, so the next hops go elsewhere.
"""

from __future__ import annotations

import re
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import TypeVar

from larql_edge.net.h1 import Reply

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


class Hedger:
    """Hedged hops over replicas of one thing. Requests run on a small pool of threads, each with its
    own keep-alive connections (``make_client()`` per thread), so a losing request can finish (or time
    out) in the background without holding up the next hop."""

    MIN_SAMPLES = 20  # no hedging before this many hops of a size have been seen
    WINDOW = 256
    QUANTILE = 0.95
    FACTOR = 1.5  # the threshold: this much beyond the p95 (a hop just above p95 is no tail)
    FLOOR_S = 0.002  # never hedge a hop earlier than this (loopback noise is not a slow replica)
    # A stall: this many times the slowest recent hop of the size, and at least STALL_FLOOR_S. Without it
    # a frozen replica holds the hop for the whole request timeout (the budget and MIN_SAMPLES allow it).
    STALL_FACTOR = 8.0
    STALL_FLOOR_S = 0.5

    def __init__(self, make_client: Callable[[], object], budget_per_s: float = 20.0, threads: int = 4,
                 clock: Callable[[], float] = time.monotonic):
        self.make_client = make_client
        self.budget_per_s = budget_per_s
        self.clock = clock
        self._tokens = budget_per_s
        self._last = clock()
        self._recent: dict[int, deque[float]] = {}
        self._sorted: dict[int, list[float]] = {}
        self._since_sort: dict[int, int] = {}
        self._local = threading.local()
        self._threads = threads
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="larql-hedge")
        self._busy = 0  # submitted, not finished: a request to a frozen replica holds a thread until the timeout
        self._lock = threading.Lock()
        self.hops = 0
        self.sent = 0
        self.won = 0

    def client(self):
        c = getattr(self._local, "client", None)
        if c is None:
            c = self._local.client = self.make_client()
        return c

    # -- the threshold, learned --------------------------------------------------------------------
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

    def _submit(self, send: Callable[[str], T], url: str) -> Future:
        with self._lock:
            self._busy += 1
        f = self._pool.submit(send, url)
        f.add_done_callback(self._release)
        return f

    def _release(self, _f: Future) -> None:
        with self._lock:
            self._busy -= 1

    def _take(self) -> bool:
        now = self.clock()
        self._tokens = min(self.budget_per_s, self._tokens + (now - self._last) * self.budget_per_s)
        self._last = now
        if self._tokens >= 1.0:
            self._tokens -= 1.0
            return True
        return False

    # -- one hop ---------------------------------------------------------------------------------------
    def run(self, size: int, primary: str, second: str, send: Callable[[str], T],
            on_late: Callable[[str, float], None] | None = None) -> tuple[str, T, bool] | None:
        """``send(url)`` on ``primary``; past the threshold, once, on ``second`` too. Returns (url,
        value, hedged) of the first success, or None when every request sent failed (the caller then
        fails over as usual). ``on_late(url, seconds)`` hears how long a losing request took: once
        when it loses (so far), again when it ends."""
        if self._busy > self._threads - 2:  # no room for a hop and its hedge: stalled requests hold the pool
            return None
        self.hops += 1
        t0 = time.perf_counter()
        first = self._submit(send, primary)
        limit, stall = self.threshold(size), self.stall_bound(size)
        try:
            value = first.result(timeout=limit if limit is not None else stall)
            self.observe(size, time.perf_counter() - t0)
            return primary, value, False
        except TimeoutError:
            pass
        except Exception:  # noqa: BLE001 - the primary failed: the caller's failover takes over
            return None
        if not self._take():  # out of budget: only a stall is hedged now
            try:
                value = first.result(timeout=None if stall is None else max(0.0, stall - (time.perf_counter() - t0)))
                self.observe(size, time.perf_counter() - t0)
                return primary, value, False
            except TimeoutError:
                pass
            except Exception:  # noqa: BLE001
                return None
        self.sent += 1
        hedge = self._submit(send, second)
        urls: dict[Future, str] = {first: primary, hedge: second}
        pending = set(urls)
        while pending:
            done, pending = wait(pending, return_when=FIRST_COMPLETED)
            for f in done:
                if f.exception() is None:
                    if on_late is not None:
                        for loser in pending:  # slow now (maybe frozen): the next hops go elsewhere
                            on_late(urls[loser], time.perf_counter() - t0)
                            loser.add_done_callback(_late(on_late, urls[loser], t0))
                    if f is hedge:
                        self.won += 1
                    self.observe(size, time.perf_counter() - t0)
                    return urls[f], f.result(), True
        return None

    def stats(self) -> dict:
        return {"hops": self.hops, "hedges_sent": self.sent, "hedges_won": self.won, "budget_per_s": self.budget_per_s}

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _late(on_late: Callable[[str, float], None], url: str, t0: float) -> Callable[[Future], None]:
    return lambda _f: on_late(url, time.perf_counter() - t0)
