"""Continuous batching: one scheduler thread steps every active sequence together.

- Admission (on the event loop): at most ``max_active`` sequences hold a KV cache and are stepped, at
  most ``max_queue`` more wait for a slot; beyond that `admit` raises `TooManyRequests` (429 with
  Retry-After). ``max_active`` is also bounded by ``kv_memory_bytes / (context x bytes per
  position)``: every admitted sequence may grow to the whole context.
- Each step (in the scheduler thread, never on the loop): waiting sequences join between steps; every
  decoding sequence contributes its one new token, prefilling sequences share what is left of the
  step's ``step_tokens`` budget (a long prompt is prefilled in chunks over several steps, so it never
  stalls the others' decoding for more than one chunk); `BatchEngine.step` runs them all as one
  stack of rows (one FFN request per layer, one logits request).
- Speculation (`larql_edge.model.speculative`, on by default): a decoding sequence's chunk is its
  last token plus up to k n-gram drafts (k adaptive per sequence, 0 while drafts keep failing); the
  head returns the top candidates after each of those rows and the drafts are accepted (greedy: the
  same tokens; sampling: the speculative-sampling rule, the same distribution), the KV cache rolled
  back past the first rejected one. Sequences with and without drafts share one step.
- Sampling is local, on the top ``k`` log-probabilities the head returns (k = 64, or more for
  ``top_logprobs``): greedy takes the first (exact), otherwise temperature then top-p over those k.
- Text: the generated ids are re-decoded as a whole; text is released only when it cannot be the
  start of a stop string (stop strings are matched across token boundaries, and the text ends before
  the stop string), nor a character still incomplete (byte-fallback tokenizers).
- A sequence whose caller went away (`cancel`) leaves the active count at once and its cache at the
  next step boundary.

Events go back to each request's asyncio queue with ``loop.call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from larql_edge.errors import LarqlError, ServiceUnavailable, TooManyRequests
from larql_edge.model.batch import BatchEngine, Chunk, SeqCache
from larql_edge.model.speculative import SeqSpeculator, Settings

log = logging.getLogger("larql.serve")

HEAD_TOP_K = 64  # candidates the head returns per row: sampling draws among them
MIN_TEMPERATURE = 1e-3  # below: greedy (as the embed server's /v1/logits; smaller ones overflow the scaled logits)


@dataclass
class Params:
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    logprobs: int | None = None  # None: no logprobs; n: the chosen token's and the top n


@dataclass
class TokenInfo:
    id: int
    text: str
    logprob: float
    top: list[tuple[int, str, float]]


@dataclass
class Event:
    kind: str  # "text" | "done" | "error"
    text: str = ""
    tokens: list[TokenInfo] = field(default_factory=list)
    finish_reason: str | None = None
    error: BaseException | None = None


class Seq:
    _next = 0

    def __init__(self, prompt_ids: Sequence[int], params: Params, loop: asyncio.AbstractEventLoop):
        Seq._next += 1
        self.id = Seq._next
        self.prompt = list(prompt_ids)
        self.params = params
        self.loop = loop
        self.events: asyncio.Queue[Event] = asyncio.Queue()
        self.cache: SeqCache | None = None
        self.fed = 0  # prompt tokens already in the cache
        self.generated: list[int] = []
        self.pending_infos: list[TokenInfo] = []
        self.sent = 0  # characters of the decoded text already released
        self.rng = np.random.default_rng(params.seed)
        self.cancelled = False
        self.finished: str | None = None
        self.t_submit = time.perf_counter()
        self.t_first: float | None = None
        self.t_last: float | None = None
        self.speculator: SeqSpeculator | None = None

    def post(self, ev: Event) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, ev)
        except RuntimeError:  # the loop closed (server stopping): nobody is listening
            pass


def sample(ids: np.ndarray, lps: np.ndarray, p: Params, rng: np.random.Generator) -> int:
    """Greedy (temperature 0): the first candidate, exactly argmax. Otherwise temperature, then the
    smallest prefix of candidates whose probability reaches top_p, then one draw."""
    if p.temperature < MIN_TEMPERATURE:  # 0, or so close to it that lps / T overflows: the limit is argmax
        return int(ids[0])
    z = np.asarray(lps, dtype=np.float64) / p.temperature
    z = z - z.max()
    prob = np.exp(z)
    prob /= prob.sum()
    if p.top_p < 1.0:
        order = np.argsort(-prob, kind="stable")
        cum = np.cumsum(prob[order])
        keep = order[: int(np.searchsorted(cum, p.top_p) + 1)]
        mask = np.zeros_like(prob)
        mask[keep] = prob[keep]
        prob = mask / mask.sum()
    return int(ids[int(rng.choice(prob.size, p=prob))])


def _held_back(text: str, stops: Sequence[str]) -> int:
    """Characters at the end of ``text`` that could be the start of a stop string."""
    best = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best


class Scheduler:
    def __init__(self, engine: BatchEngine, tokenizer, *, context: int, max_active: int, max_queue: int,
                 step_tokens: int = 128, eos_ids: Sequence[int] = (),
                 on_token: Callable[[str, float], None] | None = None, speculation: Settings | None = None):
        self.engine, self.tok = engine, tokenizer
        self.context, self.max_active, self.max_queue = context, max_active, max_queue
        self.step_tokens = max(1, step_tokens)
        self.eos = set(eos_ids)
        self.on_token = on_token or (lambda kind, seconds: None)  # ("ttft" | "itl", seconds)
        self.waiting: deque[Seq] = deque()
        self.active: list[Seq] = []
        self._cond = threading.Condition()
        self._stop = False
        self.draining = False  # SIGTERM: no more admissions; what runs may finish (app.create_app)
        self._thread: threading.Thread | None = None
        self.steps = 0
        self.step_rows = 0
        self.generated_tokens = 0
        self.prompt_tokens = 0
        self.last_step_ms = 0.0
        self.speculation = speculation or Settings(enabled=False)
        self.drafted_tokens = 0
        self.accepted_tokens = 0
        self.on_step: Callable[[int], None] = lambda rows: None  # rows (positions) of each step

    # -- the event loop's side ----------------------------------------------------------------------
    @property
    def active_count(self) -> int:
        return sum(1 for s in self.active if not s.cancelled)

    @property
    def queued_count(self) -> int:
        return sum(1 for s in self.waiting if not s.cancelled)

    def admit(self, seq: Seq) -> None:
        if self.draining:
            raise ServiceUnavailable("this server is shutting down: retry on another replica")
        with self._cond:
            # Waiting sequences take the free slots first (at the next step); what is left waits in
            # the queue, and only max_queue may: a burst beside one busy slot is not all admitted.
            free = max(0, self.max_active - self.active_count)
            if self.queued_count >= free + self.max_queue:
                raise TooManyRequests(f"{self.max_active} sequences are active and {self.max_queue} queued: "
                                      "retry shortly", retry_after=1.0)
            self.waiting.append(seq)
            self.prompt_tokens += len(seq.prompt)
            self._cond.notify()
        self.start()

    def cancel(self, seq: Seq) -> None:
        with self._cond:
            seq.cancelled = True
            try:
                self.waiting.remove(seq)
            except ValueError:
                pass
            self._cond.notify()

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="serve-scheduler", daemon=True)
            self._thread.start()

    def stop(self, error: BaseException | None = None) -> None:
        """Stop stepping; with ``error``, every sequence not finished yet ends with it (its stream gets
        an error event and [DONE]) instead of waiting for events that never come."""
        with self._cond:
            self._stop = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout=10)
        if error is not None:
            with self._cond:
                left = [*self.active, *self.waiting]
                self.waiting.clear()
            for s in left:
                self._finish(s, None, error)

    # -- the scheduler thread -----------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                self.active = [s for s in self.active if not s.cancelled and s.finished is None]
                while not self._stop and not self.active and not self.waiting:
                    self._cond.wait()
                if self._stop:
                    return
                while self.waiting and len(self.active) < self.max_active:
                    s = self.waiting.popleft()
                    if s.cancelled:
                        continue
                    try:
                        # Allocated here, between steps: address space only until positions are written.
                        s.cache = self.engine.new_cache(self.context)
                    except MemoryError as e:  # the thread lives on: this caller hears a 503, the others go on
                        self._finish(s, None, ServiceUnavailable(f"no memory for a KV cache of {self.context} "
                                                                 f"positions ({e})"))
                        continue
                    if self.speculation.enabled and self.speculation.max_k > 0:
                        s.speculator = SeqSpeculator(self.speculation)
                    self.active.append(s)
                batch = list(self.active)
            try:
                self._step(batch)
            except LarqlError as e:
                for s in batch:
                    self._finish(s, None, e)
            except Exception as e:  # a bug: every sequence of the step hears a 500, the thread lives on
                log.exception("scheduler step failed")
                for s in batch:
                    self._finish(s, None, e)

    def _step(self, batch: list[Seq]) -> None:
        chunks: list[Chunk] = []
        owners: list[Seq] = []
        drafts: list[list[int]] = []
        decoding = [s for s in batch if s.fed == len(s.prompt)]
        proposed = {s.id: self._drafts(s) for s in decoding}
        budget = max(1, self.step_tokens - sum(1 + len(d) for d in proposed.values()))
        for s in batch:
            assert s.cache is not None
            if s.fed < len(s.prompt):
                if budget <= 0:
                    continue
                n = min(budget, len(s.prompt) - s.fed)
                ids = s.prompt[s.fed : s.fed + n]
                s.fed += n
                budget -= n
                chunks.append(Chunk(s.cache, ids, wants_logits=s.fed == len(s.prompt)))
                drafts.append([])
            else:
                d = proposed[s.id]
                chunks.append(Chunk(s.cache, [s.generated[-1], *d], logit_rows=1 + len(d)))
                drafts.append(d)
            owners.append(s)
        if not chunks:
            return
        # Candidates the head returns: greedy needs only the first, sampling HEAD_TOP_K, logprobs n + 1
        # (a smaller reply to build, send and parse for an all-greedy step).
        k = max(1 if s.params.temperature < MIN_TEMPERATURE else HEAD_TOP_K for s in owners)
        k = max([k] + [(s.params.logprobs or 0) + 1 for s in owners])
        t0 = time.perf_counter()
        starts = [c.cache.length for c in chunks]
        tops = self.engine.step_rows(chunks, k)
        self.last_step_ms = (time.perf_counter() - t0) * 1e3
        self.steps += 1
        rows = sum(len(c.ids) for c in chunks)
        self.step_rows += rows
        self.on_step(rows)
        for s, rows_top, d, start in zip(owners, tops, drafts, starts, strict=True):
            if not rows_top or s.cancelled:
                continue
            if not d:
                self._accept(s, *rows_top[-1])
                continue
            self._verify(s, d, rows_top, start)

    def _drafts(self, s: Seq) -> list[int]:
        """The drafts for a decoding sequence's chunk: none without speculation, and never more than
        it may still emit after its next token, nor than its cache holds."""
        if s.speculator is None or s.cache is None:
            return []
        room = min(s.params.max_tokens - len(s.generated) - 1, s.cache.context - s.cache.length - 1)
        return s.speculator.propose(s.prompt + s.generated, room) if room > 0 else []

    def _verify(self, s: Seq, d: list[int], rows_top: list[tuple[np.ndarray, np.ndarray]], start: int) -> None:
        assert s.speculator is not None and s.cache is not None
        kept, nxt = s.speculator.verify(d, rows_top, s.params.temperature, s.params.top_p, s.rng)
        s.cache.truncate(start + 1 + kept)  # the last decided token and the kept drafts stay
        self.drafted_tokens += len(d)
        self.accepted_tokens += kept
        for i, tok in enumerate([*d[:kept], nxt]):
            if s.finished is not None:
                return
            self._emit(s, tok, *rows_top[i])

    def _accept(self, s: Seq, ids: np.ndarray, lps: np.ndarray) -> None:
        self._emit(s, sample(ids, lps, s.params, s.rng), ids, lps)

    def _emit(self, s: Seq, tok: int, ids: np.ndarray, lps: np.ndarray) -> None:
        """Token ``tok`` joins the sequence; ``ids``/``lps``: the candidates it was chosen among."""
        now = time.perf_counter()
        if s.t_first is None:
            s.t_first = now
            self.on_token("ttft", now - s.t_submit)
        elif s.t_last is not None:
            self.on_token("itl", now - s.t_last)
        s.t_last = now
        s.generated.append(tok)
        self.generated_tokens += 1
        if tok in self.eos:
            self._release(s, final=True)
            self._finish(s, "stop")
            return
        if s.params.logprobs is not None:
            where = np.nonzero(ids == tok)[0]
            lp = float(lps[where[0]]) if where.size else float("-inf")
            n = s.params.logprobs
            top = [(int(i), self.tok.decode([int(i)]), float(v)) for i, v in zip(ids[:n], lps[:n], strict=True)]
            s.pending_infos.append(TokenInfo(tok, self.tok.decode([tok]), lp, top))
        if self._release(s, final=False):
            self._finish(s, "stop")
        elif len(s.generated) >= s.params.max_tokens or s.cache is None or s.cache.length + 1 > s.cache.context:
            self._release(s, final=True)
            self._finish(s, "length")

    def _release(self, s: Seq, final: bool) -> bool:
        """Post the text that can no longer change; True when a stop string ended the sequence."""
        text = self.tok.decode(s.generated, skip_special_tokens=True)
        stops = s.params.stop
        end = len(text)
        hit = False
        for st in stops:
            i = text.find(st, max(0, s.sent - len(st) + 1))
            if i >= 0 and i < end:
                end, hit = i, True
        if not hit and not final:
            if text.endswith("\ufffd"):
                return False
            end -= _held_back(text, stops)
        if end > s.sent or s.pending_infos:
            s.post(Event("text", text[s.sent : max(end, s.sent)], s.pending_infos))
            s.pending_infos = []
            s.sent = max(end, s.sent)
        return hit

    def _finish(self, s: Seq, reason: str | None, error: BaseException | None = None) -> None:
        if s.finished is not None:
            return
        s.finished = reason or "error"
        s.cache = None  # the KV cache goes back now
        s.post(Event("error", error=error) if error is not None else Event("done", finish_reason=reason))

    def stats(self) -> dict[str, Any]:
        return {"steps": self.steps, "rows": self.step_rows,
                "mean_rows_per_step": round(self.step_rows / self.steps, 3) if self.steps else None,
                "last_step_ms": round(self.last_step_ms, 3), "generated_tokens": self.generated_tokens,
                "prompt_tokens": self.prompt_tokens,
                "speculation": {**self.speculation.as_json(), "drafted_tokens": self.drafted_tokens,
                                "accepted_tokens": self.accepted_tokens,
                                "acceptance": round(self.accepted_tokens / self.drafted_tokens, 4)
                                if self.drafted_tokens else None}}
