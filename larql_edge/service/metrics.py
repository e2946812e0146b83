"""Prometheus metrics for every Sanic role (embed server, FFN shard, router): one prefix per role.

``Metrics("embed")`` names everything ``larql_embed_*`` and provides what every role reports:

- ``larql_<role>_requests_total{route, method, status}``
- ``larql_<role>_errors_total{route, type}`` (type: the `LarqlError` kind, or the Sanic error class)
- ``larql_<role>_request_duration_seconds{route}``, buckets from 10 µs to 10 s

plus `counter`/`gauge`/`histogram` for the role's own series. ``route`` is the route's path
template (``/v1/embed/<token>``), never the raw path, so label cardinality stays bounded;
requests that match no route are counted as ``unmatched``.

Several Sanic workers are several processes, so the values live in Prometheus' multiprocess mode:
the CLI's main process calls `prepare_multiprocess` before any worker starts (and before
``prometheus_client`` is imported anywhere), every worker writes its own files in that folder, and
``GET /metrics`` on any worker aggregates all of them. Without that folder (unit tests, a library
user) the metrics live in a private in-process registry instead.
"""

from __future__ import annotations

import atexit
import bisect
import os
import shutil
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from larql_edge.errors import SetupError

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"

# Table lookups answer in tens of microseconds, logits in tens of milliseconds: cover both.
DURATION_BUCKETS = (
    10e-6, 25e-6, 50e-6, 100e-6, 250e-6, 500e-6,
    1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3, 100e-3, 250e-3, 500e-3,
    1.0, 2.5, 5.0, 10.0,
)  # fmt: skip


def prepare_multiprocess(role: str) -> Path:
    """Make (or adopt) the multiprocess folder; call in the main process before workers start.

    An operator-provided ``PROMETHEUS_MULTIPROC_DIR`` is used as is (and left in place); otherwise a
    fresh temporary folder is made, exported for the workers, and removed when the process exits.
    """
    given = os.environ.get(MULTIPROC_ENV)
    if given:
        p = Path(given)
        try:
            p.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise SetupError(f"{MULTIPROC_ENV}={given} cannot be made: {e.strerror or e}") from None
        return p
    try:
        p = Path(tempfile.mkdtemp(prefix=f"larql-{role}-metrics-"))
    except OSError as e:  # a read-only container: say what to mount instead of a traceback
        raise SetupError(
            f"no writable temporary folder for the workers' metrics ({e.strerror or e}); a read-only container "
            f"needs one, e.g. docker run --read-only --tmpfs /tmp ..., or set {MULTIPROC_ENV}"
        ) from None
    os.environ[MULTIPROC_ENV] = str(p)
    atexit.register(shutil.rmtree, p, ignore_errors=True)
    return p


def multiprocess_enabled() -> bool:
    return bool(os.environ.get(MULTIPROC_ENV))


def _add_to_histogram(child, counts: list[int], total: float) -> None:
    """Add pre-bucketed observations to a histogram child.

    prometheus_client has no public call for this; its children keep one (non-cumulative) value per
    bucket and one for the sum, in memory or in the multiprocess files alike. Should that layout
    change, fall back to observing each bucket's bound (exact counts, approximate sum).
    """
    buckets, sum_value = getattr(child, "_buckets", None), getattr(child, "_sum", None)
    if buckets is not None and sum_value is not None and len(buckets) == len(counts):
        for value, n in zip(buckets, counts, strict=True):
            if n:
                value.inc(n)
        sum_value.inc(total)
        return
    bounds = list(DURATION_BUCKETS) + [DURATION_BUCKETS[-1]]
    for bound, n in zip(bounds, counts, strict=True):
        for _ in range(n):
            child.observe(bound)


# The method label takes these values only: any other name a caller sends ("FOO", "X1", ...) is
# "other", or every distinct name would add series for good (20,000 requests: a 41,000-line scrape).
KNOWN_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "TRACE", "CONNECT"})


class Metrics:
    """The metric families of one role. Create once per process (per worker)."""

    CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

    def __init__(self, role: str):
        from prometheus_client import CollectorRegistry

        if not role.replace("_", "").isalnum():
            raise ValueError(f"metrics role {role!r}: letters, digits and underscores only")
        self.role = role
        self.prefix = f"larql_{role}_"
        self.multiprocess = multiprocess_enabled()
        # In multiprocess mode values go to files and are collected from there; registering them
        # too would report this worker's values twice.
        self.registry = None if self.multiprocess else CollectorRegistry()
        self.requests = self.counter("requests", "HTTP requests answered", ("route", "method", "status"))
        self.errors = self.counter("errors", "HTTP error responses, by error type", ("route", "type"))
        self.duration = self.histogram(
            "request_duration_seconds", "Time from request received to response ready", ("route",)
        )
        # What an autoscaler and the memory alert read; both are set at every flush (see below).
        self.inflight = self.gauge("inflight", "Requests being computed or queued for compute in this process")
        self.memory = self.gauge("resident_memory_bytes", "Resident memory of this process")
        self._inflight_fn = lambda: 0
        self._children: dict[tuple, Any] = {}
        self._flushers: list = [self._flush_requests, self._flush_process]
        # Per-request figures accumulate here and reach Prometheus at the next flush.
        self._pending_requests: dict[tuple[str, str, int], int] = {}
        self._pending_errors: dict[tuple[str, str], int] = {}
        self._pending_durations: dict[str, list] = {}  # route -> [per-bucket counts, sum]

    # A Prometheus update costs microseconds (a lock and an mmap write in multiprocess mode), as
    # much as a whole table lookup. So the request metrics, and any hot-path counts a role registers
    # with `add_flusher`, accumulate in plain Python and move into Prometheus at a flush: before
    # every render and every FLUSH_SECONDS, so another worker's figures are at most that old.
    FLUSH_SECONDS = 1.0

    def add_flusher(self, fn) -> None:
        self._flushers.append(fn)

    def track_inflight(self, fn) -> None:
        """Where ``larql_<role>_inflight`` comes from (a role's compute queue, its upstream requests)."""
        self._inflight_fn = fn

    def _flush_process(self) -> None:
        import psutil

        self.inflight.set(self._inflight_fn())
        self.memory.set(psutil.Process().memory_info().rss)

    def flush(self) -> None:
        for fn in self._flushers:
            fn()

    # -- families ----------------------------------------------------------------------------------
    def counter(self, name: str, doc: str, labels: Sequence[str] = ()):
        from prometheus_client import Counter

        return Counter(self.prefix + name, doc, tuple(labels), registry=self.registry)

    def gauge(self, name: str, doc: str, labels: Sequence[str] = (), mode: Any = "livesum"):
        """``mode`` is how workers' values combine: livesum, liveall, max, min, mostrecent..."""
        from prometheus_client import Gauge

        return Gauge(self.prefix + name, doc, tuple(labels), registry=self.registry, multiprocess_mode=mode)

    def histogram(self, name: str, doc: str, labels: Sequence[str] = (), buckets: Sequence[float] = DURATION_BUCKETS):
        from prometheus_client import Histogram

        return Histogram(self.prefix + name, doc, tuple(labels), registry=self.registry, buckets=tuple(buckets))

    # -- recording ----------------------------------------------------------------------------------
    def _child(self, family, *values: str):
        # labels() validates and locks on every call; the hot path reuses the child objects.
        key = (id(family), values)
        c = self._children.get(key)
        if c is None:
            c = self._children[key] = family.labels(*values)
        return c

    def observe_request(self, route: str, method: str, status: int, seconds: float, error_type: str | None) -> None:
        """Count one answered request (plain dictionary work: this runs on every request)."""
        key = (route, method, status)
        pr = self._pending_requests
        pr[key] = pr.get(key, 0) + 1
        d = self._pending_durations.get(route)
        if d is None:
            d = self._pending_durations[route] = [[0] * (len(DURATION_BUCKETS) + 1), 0.0]
        d[0][bisect.bisect_left(DURATION_BUCKETS, seconds)] += 1  # the first bucket with le >= seconds
        d[1] += seconds
        if status >= 400:
            ek = (route, error_type or f"http_{status}")
            self._pending_errors[ek] = self._pending_errors.get(ek, 0) + 1

    def batched(self, family, *labels: str) -> "BatchedObserver":
        """A histogram child (DURATION_BUCKETS) whose observations accumulate in plain Python and
        reach Prometheus at the next flush, as the request metrics do (a per-layer hot path)."""
        obs = BatchedObserver(lambda: self._child(family, *labels))
        self.add_flusher(obs.flush)
        return obs

    def _flush_requests(self) -> None:
        pending, self._pending_requests = self._pending_requests, {}
        for (route, method, status), n in pending.items():
            self._child(self.requests, route, method, str(status)).inc(n)
        errors, self._pending_errors = self._pending_errors, {}
        for (route, kind), n in errors.items():
            self._child(self.errors, route, kind).inc(n)
        durations, self._pending_durations = self._pending_durations, {}
        for route, (counts, total) in durations.items():
            _add_to_histogram(self._child(self.duration, route), counts, total)

    def render(self) -> bytes:
        from prometheus_client import CollectorRegistry, generate_latest, multiprocess

        self.flush()
        if self.multiprocess:
            reg = CollectorRegistry()
            multiprocess.MultiProcessCollector(reg)
            return generate_latest(reg)
        assert self.registry is not None
        return generate_latest(self.registry)

    def mark_process_dead(self) -> None:
        """Drop this worker's live gauges (call when a worker stops)."""
        if self.multiprocess:
            from prometheus_client import multiprocess

            multiprocess.mark_process_dead(os.getpid())

    # -- Sanic -------------------------------------------------------------------------------------
    def install(self, app, path: str = "/metrics") -> None:
        """Time and count every request of ``app`` and serve the exposition at ``path``."""
        from sanic.response import raw
        from sanic.signals import Event

        from larql_edge.service._envelope import error_kind

        @app.signal(Event.HTTP_LIFECYCLE_EXCEPTION)
        async def _remember_error(request, exception):
            if request is not None:
                request.ctx.error_type = error_kind(exception)

        @app.on_response(priority=-1000)
        async def _record(request, response):
            # Sanic stamps perf_counter() on its HTTP/1 stream when the handler stage starts; using
            # it saves a request middleware on every request (tests check durations are counted).
            t0 = getattr(request.stream, "perft0", None)
            if t0 is None:  # failed before a handler stage began (e.g. malformed headers)
                return
            route = request.route
            label = "/" + route.path if route is not None else "unmatched"
            status = response.status
            # request.ctx is made on first access: read it only for errors (the signal above set it).
            kind = getattr(request.ctx, "error_type", None) if status >= 400 else None
            method = request.method if request.method in KNOWN_METHODS else "other"
            self.observe_request(label, method, status, time.perf_counter() - t0, kind)

        async def metrics_route(request):
            return raw(self.render(), content_type=self.CONTENT_TYPE)

        app.add_route(metrics_route, path, methods=["GET"], name="metrics")

        async def _flush_periodically(app_):
            import asyncio

            while True:
                await asyncio.sleep(self.FLUSH_SECONDS)
                self.flush()

        @app.after_server_start
        async def _start_flusher(app_):
            import asyncio

            # A plain task we cancel and await ourselves (Sanic warns about its own tasks at shutdown).
            app_.ctx.metrics_flusher = asyncio.get_running_loop().create_task(_flush_periodically(app_))

        @app.before_server_stop
        async def _last_flush(app_):
            import asyncio
            import contextlib

            task = getattr(app_.ctx, "metrics_flusher", None)
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            self.flush()

        @app.after_server_stop
        async def _dead(app_):
            self.mark_process_dead()


# One hop of the data path: ~0.1 ms on loopback, tens of ms over a WAN.
HOP_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class HopMetrics:
    """``larql_<role>_hop_compute_seconds{tier}`` (what the server said it spent: Server-Timing),
    ``..._hop_network_seconds{tier}`` (the rest of the hop's wall time), ``..._local_seconds`` (attention
    here, per token or step), ``..._draft_seconds`` (a draft model's, with --draft) and
    ``..._hedges_total{outcome}``: the split of a token's time that shows
    which hop is slow. Shared by the client (``larql generate --metrics-file``) and larql-serve."""

    def __init__(self, metrics: Metrics):
        self.compute = metrics.histogram("hop_compute_seconds", "Server time of one hop, by tier (Server-Timing)",
                                         ("tier",), HOP_BUCKETS)
        self.network = metrics.histogram("hop_network_seconds", "Network (and queueing) time of one hop, by tier",
                                         ("tier",), HOP_BUCKETS)
        self.local = metrics.histogram("local_seconds", "Attention computed here, per token (client) or step (serve)",
                                       (), HOP_BUCKETS)
        self.draft = metrics.histogram("draft_seconds", "A draft model's time (--draft), per token (client) or step (serve)",
                                       (), HOP_BUCKETS)
        self.hedges = metrics.counter("hedges", "Hedged hops: sent to a second replica, and won by it", ("outcome",))
        for outcome in ("sent", "won"):
            self.hedges.labels(outcome)  # both series exist from the start (at 0)
        self._hedged = (0, 0)

    def record(self, hops, local_s: float | None = None, draft_s: float | None = None) -> None:
        for h in hops:
            self.compute.labels(h.tier).observe(h.server_s or 0.0)
            self.network.labels(h.tier).observe(h.network_s)
        if local_s is not None:
            self.local.observe(local_s)
        if draft_s is not None:
            self.draft.observe(draft_s)

    def hedged(self, sent: int, won: int) -> None:
        """The hedger's running totals; counts what is new since the last call."""
        s0, w0 = self._hedged
        if sent > s0:
            self.hedges.labels("sent").inc(sent - s0)
        if won > w0:
            self.hedges.labels("won").inc(won - w0)
        self._hedged = (sent, won)


class BatchedObserver:
    """``observe(seconds)``: a bucket count and a sum in Python; ``flush`` adds them to the child."""

    def __init__(self, child) -> None:
        import threading

        self._child = child
        self._counts = [0] * (len(DURATION_BUCKETS) + 1)
        self._sum = 0.0
        self._lock = threading.Lock()  # observed in the compute thread, flushed in the event loop

    def observe(self, seconds: float) -> None:
        i = bisect.bisect_left(DURATION_BUCKETS, seconds)
        with self._lock:
            self._counts[i] += 1
            self._sum += seconds

    def flush(self) -> None:
        with self._lock:
            counts, total = self._counts, self._sum
            if not any(counts):
                return
            self._counts, self._sum = [0] * (len(DURATION_BUCKETS) + 1), 0.0
        _add_to_histogram(self._child(), counts, total)
