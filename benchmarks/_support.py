"""What the benchmarks share (the test suite is not imported: servers come from larql_edge.testing)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator


def process_tree(pid: int) -> Iterator:
    """A process and all its descendants (a server's workers) that still exist, as psutil processes."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    yield from procs


def _tree_sum(pid: int, value: Callable) -> float:
    import psutil

    total = 0.0
    for p in process_tree(pid):
        try:
            total += value(p)
        except psutil.NoSuchProcess:  # ended while being read
            pass
    return total


def tree_cpu(pid: int) -> float:
    """CPU seconds (user + system) used so far by a process and all its descendants."""
    return _tree_sum(pid, lambda p: p.cpu_times().user + p.cpu_times().system)


def tree_rss(pid: int) -> int:
    """Resident bytes of a process and all its descendants (Sanic serves from a child process)."""
    return int(_tree_sum(pid, lambda p: p.memory_info().rss))


def median_ms(fn: Callable[[], object], n: int = 200, warmup: int = 10,
              clock: Callable[[], float] = time.perf_counter) -> float:
    """Median milliseconds of ``n`` calls of ``fn``, after ``warmup`` calls that are not counted.
    ``clock``: wall time by default; ``time.thread_time`` counts only this thread's CPU, so the
    neighbours' load on a shared machine does not."""
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(n):
        t0 = clock()
        fn()
        ts.append(clock() - t0)
    return statistics.median(ts) * 1e3


def save_keeping_earlier(out: str, lines: list[str]) -> None:
    """Write a run's lines to ``out``, the file's earlier runs kept below them (figures from a noisy
    machine are read side by side)."""
    from pathlib import Path

    path = Path(out)
    old = path.read_text() if path.exists() else ""
    path.write_text("\n".join(lines) + "\n" + ("\n--- earlier run ---\n" + old if old else ""))
