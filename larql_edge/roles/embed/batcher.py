"""An asyncio micro-batcher: concurrent logits requests share one matrix product.

One residual costs a matrix-vector product that streams the whole lm_head from memory; a stack of
n residuals streams it once for all n (``x[n, hidden] @ W.T``), so under concurrency the batch
answers many requests for little more than the price of one.

- A request arriving while nothing is computing starts its product at once (the default,
  ``--batch-wait-ms 0``): requests arriving while a batch computes queue up and form the next batch
  as soon as it ends, so under load batches form without anyone waiting. With ``--batch-wait-ms``
  above 0 an idle batcher waits for company until ``GAP`` (1 ms) passes with no new arrival, at most
  that long. Why not wait by default: a lone request (and larql-serve's one request per decode step,
  which never has company) paid the gap, and on a busy machine ``sleep(1 ms)`` lasts several.
- The product and every request's post-processing run in the app's compute thread, so the event
  loop keeps serving embeddings and health checks meanwhile, and products never compete for BLAS;
  but a lone one-row batch with that thread idle (a decode step's logits) is computed in the loop
  (``INLINE_ROWS``): the hand-off's two wake-ups cost more than the product on a busy machine.
- A many-rows request (`submit_rows`: larql-serve's one logits request for every sequence of a
  decode step) joins a batch as a block of rows: its rows and its neighbours' are still ONE product.
  ``max_batch`` counts rows; a block larger than that is a batch of its own.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from larql_edge.service import Compute


class LogitsBatcher:
    GAP = 0.001  # seconds without a new arrival that end the wait for company
    # A batch of at most this many rows, with the compute thread idle, is computed here in the event
    # loop: handing it to the compute thread and back costs two thread wake-ups, and on a busy machine
    # each waits for a core (measured: /v1/logits' p50 over the in-process product, DESIGN.md §4).
    # Requests already readable join the batch first (two loop turns: their handlers run to submit).
    INLINE_ROWS = 1

    def __init__(
        self,
        compute: Callable[[np.ndarray], np.ndarray],
        executor: Compute,
        max_batch: int = 64,
        max_wait: float = 0.0,
        on_batch: Callable[[int, float], None] | None = None,
    ):
        if max_batch < 1:
            raise ValueError("max_batch must be >= 1")
        self.compute = compute
        self.executor = executor
        self.max_batch = max_batch
        self.max_wait = max(0.0, max_wait)
        self.on_batch = on_batch
        # (rows [r, hidden], post, future, one_row): a one-row request's post gets logits[vocab],
        # a many-rows request's gets its block [r, vocab].
        self._queue: list[tuple[np.ndarray, Callable[[np.ndarray], Any], asyncio.Future, bool]] = []
        self._runner: asyncio.Task | None = None
        self._computing = 0
        self.batches = 0
        self.rows = 0
        self.largest = 0

    async def submit(self, x: np.ndarray, post: Callable[[np.ndarray], Any]) -> Any:
        """Queue one residual ``x [hidden]``; ``post(logits_row)`` runs in the executor, its result returns."""
        return await self._submit(np.asarray(x)[None, :], post, True)

    async def submit_rows(self, x: np.ndarray, post: Callable[[np.ndarray], Any]) -> Any:
        """Queue residuals ``x [rows, hidden]``; ``post(logits [rows, vocab])`` runs in the executor."""
        return await self._submit(np.atleast_2d(x), post, False)

    async def _submit(self, x: np.ndarray, post: Callable[[np.ndarray], Any], one_row: bool) -> Any:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._queue.append((x, post, fut, one_row))
        if self._runner is None or self._runner.done():
            self._runner = loop.create_task(self._run())
        return await fut

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        first = True
        while self._queue:
            if first and self.max_wait:
                await self._gather_company(loop)
            elif first and self.INLINE_ROWS:
                for _ in range(2):  # what the loop has already received submits before the batch forms
                    await asyncio.sleep(0)
            first = False
            take, rows = 0, 0
            while take < len(self._queue) and (take == 0 or rows + self._queue[take][0].shape[0] <= self.max_batch):
                rows += self._queue[take][0].shape[0]
                take += 1
            batch = self._queue[:take]
            del self._queue[:take]
            batch = [item for item in batch if not item[2].done()]  # callers that went away
            if not batch:
                continue
            t0 = time.perf_counter()
            nrows = sum(item[0].shape[0] for item in batch)
            self._computing = len(batch)
            try:
                if nrows <= self.INLINE_ROWS and not self.executor.inflight:
                    results = self._compute_batch(batch)  # here, in the loop (see INLINE_ROWS)
                else:
                    results = await self.executor.run(self._compute_batch, batch)
            except Exception as e:  # the product itself failed: every caller of the batch hears it
                for _, _, fut, _ in batch:
                    if not fut.done():
                        fut.set_exception(e)
                continue
            finally:
                self._computing = 0
            self.batches += 1
            self.rows += nrows
            self.largest = max(self.largest, nrows)
            if self.on_batch is not None:
                self.on_batch(nrows, time.perf_counter() - t0)
            for (_, _, fut, _), (ok, value) in zip(batch, results, strict=True):
                if fut.done():
                    continue
                if ok:
                    fut.set_result(value)
                else:
                    fut.set_exception(value)

    async def _gather_company(self, loop) -> None:
        deadline = loop.time() + self.max_wait
        seen = len(self._queue)
        while sum(item[0].shape[0] for item in self._queue) < self.max_batch:
            remaining = deadline - loop.time()
            if remaining <= 0:
                return
            await asyncio.sleep(min(self.GAP, remaining))
            if len(self._queue) == seen:  # nobody came during the gap: go
                return
            seen = len(self._queue)

    def _compute_batch(self, batch) -> list[tuple[bool, Any]]:
        logits = self.compute(np.concatenate([x for x, _, _, _ in batch]))  # ONE product for every row
        out: list[tuple[bool, Any]] = []
        at = 0
        for x, post, _, one_row in batch:
            block = logits[at : at + x.shape[0]]
            at += x.shape[0]
            try:
                out.append((True, post(block[0] if one_row else block)))
            except Exception as e:  # one caller's post-processing failing does not fail the others
                out.append((False, e))
        return out

    @property
    def pending(self) -> int:
        """Requests waiting for, or inside, an lm_head product (what heartbeats report as load)."""
        return len(self._queue) + self._computing

    def stats(self) -> dict:
        return {
            "batches": self.batches,
            "rows": self.rows,
            "mean_batch": round(self.rows / self.batches, 3) if self.batches else None,
            "largest_batch": self.largest,
        }
