"""What the benchmarks share (the test suite is not imported: servers come from larql_edge.testing)."""

from __future__ import annotations


def tree_cpu(pid: int) -> float:
    """CPU seconds (user + system) used so far by a process and all its descendants (a server's workers)."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0.0
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total
