"""The kernels' one thread pool: plain Python threads over row ranges (ctypes releases the GIL).

Why not ggml's own threads: without a persistent ggml threadpool every multi-thread graph spawns and
joins its threads (measured 20-80x slower per product on this loaded 2-core machine), and a persistent
one spins or sleeps beside OpenBLAS's workers: two pools that stall each other on 2 cores (DESIGN.md).
Here the only parallelism is ``threads`` Python threads, each running a one-thread ggml graph over its
rows (or, for tiled products, a single-threaded SGEMM: the process keeps BLAS at one thread, as
larql-edge does with OPENBLAS_NUM_THREADS=1). The calling thread does one share itself.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

from larql_edge.config import kernel_threads

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


def split_rows(work, rows: int, parallel: bool, align: int = 1) -> None:
    """Run ``work(a, b)`` over ``[0, rows)``, split into contiguous ranges across the threads (each
    range's bounds multiples of ``align``, but the last's end)."""
    n = get_threads() if parallel else 1
    n = min(n, max(1, rows // 64))
    if n == 1:
        work(0, rows)
        return
    step = -(-rows // n)
    step = -(-step // align) * align
    bounds = [(i * step, min(rows, (i + 1) * step)) for i in range(n) if i * step < rows]
    futures = [_get_pool(n - 1).submit(work, a, b) for a, b in bounds[1:]]
    try:
        work(*bounds[0])
    finally:
        for f in futures:
            f.result()
