"""CPU hogs beside a test or a benchmark: the product must hold on a busy host (issue #19).

`cpu_hogs(n)` runs ``stress-ng --cpu n`` (Debian's stress-ng) for the duration of a ``with`` block,
in its own session, and stops it (and only it) on the way out, even when the block raises. If the
process that started it dies without unwinding (a segfault, a SIGKILL), nothing stops it: so the hogs
also stop by themselves after ``limit_s`` (stress-ng's --timeout; default the suite's per-test limit).
Seen: a crashed pytest worker's hogs ran on for 45 minutes and slowed every test after them.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def cpu_hogs(n: int = 2, limit_s: int = 900) -> Iterator[subprocess.Popen | None]:
    if n <= 0:
        yield None
        return
    exe = shutil.which("stress-ng")
    if exe is None:
        raise RuntimeError("stress-ng is not installed (Debian: apt-get install stress-ng): it runs the CPU hogs")
    proc = subprocess.Popen([exe, "--cpu", str(n), "--cpu-method", "matrixprod", "--timeout", f"{int(limit_s)}s", "--quiet"],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        yield proc
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # stress-ng forks its workers into the session's group
        except ProcessLookupError:
            pass
        proc.wait(timeout=30)
