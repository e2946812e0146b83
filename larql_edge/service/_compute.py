"""Heavy compute off the event loop, with an honest in-flight count.

A server's event loop must stay free for health checks, heartbeats and cheap requests while a
long prefill computes, so every matrix product runs in a small thread pool (numpy releases the
GIL inside BLAS). One thread by default: on a small machine two products in parallel only fight
over the same cores and BLAS threads (DESIGN.md §7). ``inflight`` counts jobs queued or running:
what membership heartbeats and the ``larql_<role>_inflight`` gauge report.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")


class Compute:
    def __init__(self, threads: int = 1, name: str = "compute"):
        self.threads = max(1, threads)
        self.name = name
        self.inflight = 0
        self.jobs = 0
        self._pool: ThreadPoolExecutor | None = None

    @property
    def pool(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=self.threads, thread_name_prefix=self.name)
        return self._pool

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        self.inflight += 1
        self.jobs += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)
        finally:
            self.inflight -= 1

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
