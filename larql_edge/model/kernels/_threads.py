"""The kernels' threads: Python threads over row ranges for single products, one ggml thread pool for
whole graphs (`graph_pool`: the local step's graphs, an FFN shard's fused layer). Both take their size
from `get_threads` and hold no core while idle.

Single products (`split_rows`): ``threads`` Python threads (ctypes releases the GIL), each running a
one-thread ggml graph over its rows (or, for tiled products, a single-threaded SGEMM: the process keeps
BLAS at one thread, as larql-edge does with OPENBLAS_NUM_THREADS=1); the calling thread does one share
itself. Why not ggml's threads there: without a persistent ggml pool every multi-thread graph spawns
and joins its threads (measured 20-80x slower per product on this loaded 2-core machine).

Row-wise post-processing of a product (`map_rows`: the head's top k and log-normaliser of each
vocabulary row) goes over the same Python threads: numpy's reductions, partitions and exponentials
release the GIL, and on a 16-row decode step of a 262,144-token vocabulary that work is a tenth of the
head's time (DESIGN.md §4.5).

Graphs run on one persistent ggml pool whose workers sleep as soon as a graph ends (`GRAPH_POLL`):
ggml's default keeps them spinning, and a spinning pool stalls the other roles sharing the cores.
"""

from __future__ import annotations

import ctypes as C
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any, Protocol, TypeVar

import numpy as np

from larql_edge.config import kernel_threads

R = TypeVar("R")

_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None
_threads = 0


def _default_threads() -> int:
    n = kernel_threads()
    if n is not None:
        return n
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # macOS
        return max(1, os.cpu_count() or 1)


def get_threads() -> int:
    global _threads
    if not _threads:
        _threads = _default_threads()
    return _threads


def set_threads(n: int) -> None:
    """Threads one product may use (default: LARQL_KERNEL_THREADS, else the CPUs this process may run on)."""
    global _threads, _pool
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"kernel threads must be a positive integer, got {n!r}")
    with _lock:
        if _pool is not None and n != _threads:
            _pool.shutdown(wait=True)
            _pool = None
        _threads = n


def _get_pool(workers: int) -> ThreadPoolExecutor:
    global _pool
    with _lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="larql-kernel")
        return _pool


def _run_ranges(work: Callable[[int, int], object], rows: int, n: int, align: int = 1) -> None:
    """``work(a, b)`` over ``[0, rows)`` in ``n`` contiguous ranges (bounds multiples of ``align``, but
    the last's end): the first on the calling thread, the rest on the pool. An exception from any
    range is raised once every range has ended."""
    if n <= 1:
        work(0, rows)
        return
    step = -(-rows // n)
    step = -(-step // align) * align
    bounds = [(i * step, min(rows, (i + 1) * step)) for i in range(n) if i * step < rows]
    futures = [_get_pool(n - 1).submit(work, a, b) for a, b in bounds[1:]]
    try:
        work(*bounds[0])
    finally:
        wait(futures)
    for f in futures:
        f.result()


def split_rows(work, rows: int, parallel: bool, align: int = 1) -> None:
    """Run ``work(a, b)`` over ``[0, rows)``, split into contiguous ranges across the threads (each
    range's bounds multiples of ``align``, but the last's end)."""
    n = get_threads() if parallel else 1
    _run_ranges(work, rows, min(n, max(1, rows // 64)), align)


# Values in a block from which its rows' post-processing is split across the threads: a thread
# hand-off costs ~50 us, a 262,144-value row's top k and log-normaliser ~0.5 ms (DESIGN.md §4.5).
MAP_ROWS_FROM = 1 << 18


def map_rows(fn: Callable[[int, np.ndarray], R], block: np.ndarray) -> list[R]:
    """``[fn(i, row) for i, row in enumerate(block)]``, in order; from `MAP_ROWS_FROM` values on,
    the rows split into contiguous parts across the threads (the calling thread does the first).
    An exception from any part is raised once every part has ended."""
    rows = block.shape[0]
    out: list[Any] = [None] * rows

    def work(a: int, b: int) -> None:
        out[a:b] = [fn(i, block[i]) for i in range(a, b)]

    _run_ranges(work, rows, min(get_threads() if block.size >= MAP_ROWS_FROM else 1, rows))
    return out


# ggml's threads poll for the next graph ``1024 * 128 * poll`` times (``_mm_pause`` each) before they
# sleep; its default, 50, keeps a worker spinning for ~100 ms after every graph on this Zen 4. In a grid
# the next graph of a role comes after a hop, while another role (an FFN shard, the embed server's
# lm_head) needs that core: so the workers sleep at once, and a multi-thread graph pays one wake-up
# (~35 us here: a one-row FFN layer forced onto 2 threads took 153 us against 119 polling; at the 4+
# rows that take 2 threads, benchmarks/ffn_threads.py has poll 0 and 50 within the noise).
GRAPH_POLL = 0


class _Graph(Protocol):
    def run(self, threads: int, pool: int | None) -> None: ...


class GraphPool:
    """The process's one ggml thread pool (none for one thread: the calling thread computes alone).

    A ggml thread pool works on one graph at a time: two graphs computed on it at once (two models
    in one process on two threads, e.g. in-process clients generating side by side) corrupt each
    other's work; seen as NaN rows sent to the router, then a segfault inside ggml_graph_compute
    (tests/test_swarm.py's in-process streams, 2 threads, load ~5). So a multi-thread compute holds
    the pool's lock, and the pool is only replaced under it. One thread needs no pool and no lock."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.n = 0
        self.ptr: int | None = None

    def run(self, graph: _Graph, threads: int | None = None) -> None:
        """``graph.run(threads, pool)`` on ``threads`` threads (default: `get_threads`)."""
        n = threads or get_threads()
        if n == 1:
            graph.run(1, None)
            return
        with self.lock:
            if n != self.n:
                from larql_edge.model.kernels import _ggml

                L = _ggml.lib()
                if self.ptr:
                    L.cpu.ggml_threadpool_free(self.ptr)
                    self.ptr = None
                params = L.base.ggml_threadpool_params_default(n)
                params.poll = GRAPH_POLL
                self.ptr = L.cpu.ggml_threadpool_new(C.byref(params))
                self.n = n
            graph.run(self.n, self.ptr)


graph_pool = GraphPool()
