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
  back past the first rejected one. Sequences with and without drafts share one step. A draft goes
  in only where it pays for its row (`drafts_that_pay`, from the steps' measured fixed and per-row
  cost and the sequence's record; off: ``--no-spec-budget``): in a step of many sequences a row costs
  nearly what a token is worth, so only a near-certain draft does.
- Sampling is local, on the top ``k`` log-probabilities the head returns (k = 64, or more for
  ``top_logprobs``): greedy takes the first (exact), otherwise temperature then top-p over those k.
- logit_bias and the penalties (`adjust`) act as on the whole row: the head also returns every id
  they may raise (`raised`: a positive bias, a negative penalty's tokens), whatever its rank, and the
  logits' scale (the repetition penalty divides logits); every other token only loses score, so it
  stays below the head's k-th. Greedy is then exact unless the penalties lowered every candidate
  below the k-th, and then (or beyond `MAX_EXTRA_IDS` raised ids) the whole row is fetched.
- Structured output: a sequence with a grammar (`structured.Constraint`) sends its allowed-token
  bitmask with its row; the head's top k are then among the allowed tokens only, so whatever is
  sampled keeps the grammar satisfiable. The grammar takes each token; when nothing but the end can
  follow, the sequence stops (``stop``) without spending a step on the end-of-sequence token.
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
from larql_edge.model.head import Top, candidates
from larql_edge.model.prefix_cache import PrefixCache
from larql_edge.model.speculative import SeqSpeculator, Settings, StepCost, drafts_that_pay
from larql_edge.wire.embed import MAX_EXTRA_IDS

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
    # The sampling controls, on the head's candidates (see `sample`).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    top_k: int = 0  # 0: off
    min_p: float = 0.0

    @property
    def adjusts(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias)

    def candidates(self) -> int:
        """How many candidates the head must return for this sequence."""
        k = 1 if self.temperature < MIN_TEMPERATURE and not self.adjusts else HEAD_TOP_K
        # A banned token is never drawn: at least one candidate beyond every banned id survives.
        bans = sum(1 for b in self.logit_bias.values() if b <= BAN)
        return max(k, self.top_k, bans + 1, (self.logprobs or 0) + 1)


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
    index: int = 0  # which of a request's n sequences


class Seq:
    _next = 0

    def __init__(self, prompt_ids: Sequence[int], params: Params, loop: asyncio.AbstractEventLoop,
                 events: asyncio.Queue[Event] | None = None, index: int = 0, constraint: Any = None,
                 ends: Callable[[str], bool] | None = None):
        """``events``: a request's n sequences post to one queue, each event carrying its ``index``;
        ``constraint``: its own `structured.Constraint` (never shared between sequences), or None;
        ``ends``: says, of the text so far, that the reply is whole (a tool-call list that repeats a call)."""
        Seq._next += 1
        self.constraint = constraint  # a structured.Constraint, or None
        self.ends = ends
        self.id = Seq._next
        self.index = index
        self.prompt = list(prompt_ids)
        self.params = params
        self.loop = loop
        self.events: asyncio.Queue[Event] = asyncio.Queue() if events is None else events
        self.cache: SeqCache | None = None
        self.fed = 0  # prompt tokens already in the cache
        self.generated: list[int] = []
        self.pending_infos: list[TokenInfo] = []
        self.sent = 0  # characters of the decoded text already released
        # n sequences of one seeded request: n different draws, the same n on a rerun.
        self.rng = np.random.default_rng(params.seed if index == 0 or params.seed is None else (params.seed, index))
        self.siblings: list[Seq] = []  # a request's other n - 1 sequences: they take this one's prompt KV
        self.leader: Seq | None = None
        self.cached = 0  # prompt positions that came from the prefix cache
        self.cancelled = False
        self.finished: str | None = None
        self.t_submit = time.perf_counter()
        self.t_first: float | None = None
        self.t_last: float | None = None
        self.speculator: SeqSpeculator | None = None
        self.raised = np.empty(0, dtype=np.int64)  # this step's ids a control may raise (`raised`)

    def post(self, ev: Event) -> None:
        ev.index = self.index
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, ev)
        except RuntimeError:  # the loop closed (server stopping): nobody is listening
            pass


SCORE_CAP = 1e300  # the largest adjusted score (see `adjust`)
BAN = -100.0  # a logit_bias this low removes the token (OpenAI: "should result in a ban")


def adjust(ids: np.ndarray, logits: np.ndarray, p: Params, prompt: Sequence[int], generated: Sequence[int]) -> np.ndarray:
    """The candidates' logits after logit_bias and the penalties, in vLLM's and llama.cpp's order
    (bias, then penalties; all before temperature): repetition_penalty divides a seen token's
    positive logit and multiplies a negative one (seen: in the prompt or the output), presence and
    frequency penalties subtract per the output only (OpenAI's and vLLM's rule)."""
    z = np.asarray(logits, dtype=np.float64).copy()
    if not p.adjusts:
        return z
    ids = np.asarray(ids, dtype=np.int64)
    if p.logit_bias:
        keys = np.fromiter(p.logit_bias, dtype=np.int64, count=len(p.logit_bias))
        vals = np.fromiter(p.logit_bias.values(), dtype=np.float64, count=len(p.logit_bias))
        order = np.argsort(keys)
        keys, vals = keys[order], vals[order]
        pos = np.minimum(np.searchsorted(keys, ids), keys.size - 1)
        hit = keys[pos] == ids
        bias = np.where(hit, vals[pos], 0.0)
        z = np.where(hit & (bias <= BAN), -np.inf, z + bias)
    if p.repetition_penalty != 1.0:
        seen = np.isin(ids, np.fromiter((*prompt, *generated), dtype=np.int64, count=len(prompt) + len(generated)))
        r = p.repetition_penalty
        # a tiny penalty (5e-324 is valid) would divide to +inf and a draw's z - max to NaN: cap the
        # scores where temperature (>= 1e-3) cannot overflow them either
        with np.errstate(over="ignore"):
            z = np.where(seen, np.where(z > 0, np.minimum(z / r, SCORE_CAP), z * r), z)
    if (p.presence_penalty or p.frequency_penalty) and generated:
        uniq, counts = np.unique(np.asarray(generated, dtype=np.int64), return_counts=True)
        pos = np.minimum(np.searchsorted(uniq, ids), uniq.size - 1)
        count = np.where(uniq[pos] == ids, counts[pos], 0)
        z -= p.frequency_penalty * count + p.presence_penalty * (count > 0)
    return z


def raised(p: Params, prompt: Sequence[int], generated: Sequence[int]) -> np.ndarray:
    """The ids `adjust` may score higher than the model does (sorted): a positive logit_bias, a negative
    presence or frequency penalty (the output's tokens), a repetition_penalty below 1 (the prompt's
    and the output's). Every other token only keeps or loses score, so a token outside the head's
    top k and not raised stays at or below the k-th: these are the ids the head must add."""
    out = [np.fromiter((t for t, b in p.logit_bias.items() if b > 0), dtype=np.int64)]
    if p.repetition_penalty < 1.0:
        out.append(np.asarray(prompt, dtype=np.int64))
    if p.repetition_penalty < 1.0 or p.presence_penalty < 0 or p.frequency_penalty < 0:
        out.append(np.asarray(generated, dtype=np.int64))
    return np.unique(np.concatenate(out))


def complete(top: Top, p: Params, prompt: Sequence[int], generated: Sequence[int], raised_ids: np.ndarray, k: int,
             whole_row: Callable[[], np.ndarray]) -> Top:
    """The candidates the sampler chooses among, as if on the whole row: the head's top k and every
    raised id (asked for with the row: ``top``). The whole row (``whole_row()``, one more head request)
    when the raised ids were too many to ask for, or when greedy's best adjusted score does not beat
    ``top.floor`` (the penalties lowered every candidate: an unlisted token may be the argmax)."""
    is_greedy = p.temperature < MIN_TEMPERATURE
    full = raised_ids.size > MAX_EXTRA_IDS
    if not full and is_greedy and top.floor > -np.inf:
        z = adjust(top.ids, top.lps + top.lse, p, prompt, generated)
        full = not z.max() > top.floor + top.lse
    if not full:
        return top
    row = whole_row()
    best = candidates(row, k, None if is_greedy else raised_ids)
    if not is_greedy:
        return best
    rest = np.setdiff1d(np.nonzero(np.isfinite(row))[0], best.ids)  # greedy: every token competes
    return Top(np.concatenate([best.ids, rest]), np.concatenate([best.lps, row[rest] - best.lse]), best.lse)


def greedy(ids: np.ndarray, z: np.ndarray) -> int:
    """The best score's token; ties: the lowest id (argmax over the whole row), whatever the order."""
    best = z.max()
    return int(np.asarray(ids)[z == best].min())


def sample(ids: np.ndarray, lps: np.ndarray, p: Params, rng: np.random.Generator,
           prompt: Sequence[int] = (), generated: Sequence[int] = (), lse: float = 0.0) -> int:
    """Greedy (temperature 0): the best candidate, exactly argmax when nothing adjusts the scores.
    Otherwise logit_bias and the penalties (`adjust`, on the logits ``lps + lse``), temperature, then
    top_k, min_p and top_p (the smallest prefix of candidates whose probability reaches it), then
    one draw."""
    z = adjust(ids, np.asarray(lps, dtype=np.float64) + lse, p, prompt, generated)
    if p.temperature < MIN_TEMPERATURE:  # 0, or so close to it that z / T overflows: the limit is argmax
        return greedy(ids, z)
    z = z / p.temperature
    z = z - z[np.isfinite(z)].max()
    prob = np.exp(z)
    if p.top_k and p.top_k < prob.size:
        prob[np.argsort(-prob, kind="stable")[p.top_k:]] = 0.0
    prob /= prob.sum()
    if p.min_p > 0.0:
        prob = np.where(prob >= p.min_p * prob.max(), prob, 0.0)
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
                 on_token: Callable[[str, float], None] | None = None, prefix: PrefixCache | None = None,
                 speculation: Settings | None = None):
        self.engine, self.tok = engine, tokenizer
        self.context, self.max_active, self.max_queue = context, max_active, max_queue
        self.step_tokens = max(1, step_tokens)
        self.eos = set(eos_ids)
        self.prefix = prefix
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
        self.withheld_tokens = 0  # proposed drafts the budget left out (`drafts_that_pay`)
        self.cost = StepCost()  # decoding steps' seconds: fixed + per row
        self.step_draft: deque[float] = deque(maxlen=10000)  # a draft model's seconds per step (metrics drain it)
        self.accepted_tokens = 0
        self.full_rows = 0  # whole logits rows asked for (sampling controls the candidates could not decide)
        self.on_step: Callable[[int], None] = lambda rows: None  # rows (positions) of each step

    # -- the event loop's side ----------------------------------------------------------------------
    @property
    def active_count(self) -> int:
        return sum(1 for s in self.active if not s.cancelled)

    @property
    def queued_count(self) -> int:
        return sum(1 for s in self.waiting if not s.cancelled)

    def admit(self, seq: Seq, siblings: Sequence[Seq] = ()) -> None:
        """``siblings``: the request's other sequences (n > 1), on the same prompt: they take a slot each
        together with ``seq`` and copy its prompt's KV once it is prefilled (one prefill for the n)."""
        if self.draining:
            raise ServiceUnavailable("this server is shutting down: retry on another replica")
        if len(siblings) + 1 > self.max_active:
            raise ValueError("more sequences in one request than max_active")
        seq.siblings = list(siblings)
        for s in siblings:
            s.leader = seq
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
                left = [*self.active, *(g for s in self.waiting for g in (s, *s.siblings))]
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
                while self.waiting:
                    s = self.waiting[0]
                    group = [s, *s.siblings]
                    if not s.cancelled and len(self.active) + len(group) > self.max_active:
                        break  # first come, first served: a group waits for its n slots
                    self.waiting.popleft()
                    if s.cancelled:
                        continue
                    try:
                        # Allocated here, between steps: address space only until positions are written.
                        for g in group:
                            g.cache = self.engine.new_cache(self.context)
                    except MemoryError as e:  # the thread lives on: this caller hears a 503, the others go on
                        for g in group:
                            self._finish(g, None, ServiceUnavailable(f"no memory for a KV cache of {self.context} "
                                                                     f"positions ({e})"))
                        continue
                    if self.prefix is not None:
                        assert s.cache is not None
                        s.fed = s.cached = self.prefix.load(s.prompt, s.cache)
                    if self.speculation.enabled and self.speculation.max_k > 0:
                        for g in group:
                            g.speculator = SeqSpeculator(self.speculation)
                    self.active.extend(group)
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
        t_draft = time.perf_counter()
        proposed = {s.id: self._drafts(s) for s in decoding}
        if self.speculation.draft is not None and decoding:
            self.step_draft.append(time.perf_counter() - t_draft)
        if self.speculation.budget:
            self._budget(decoding, proposed)
        budget = max(1, self.step_tokens - sum(1 + len(d) for d in proposed.values()))
        for s in batch:
            assert s.cache is not None
            if s.leader is not None and s.fed < len(s.prompt):
                continue  # its prompt's KV comes from its leader's prefill
            if s.fed < len(s.prompt):
                if budget <= 0:
                    continue
                n = min(budget, len(s.prompt) - s.fed)
                ids = s.prompt[s.fed : s.fed + n]
                s.fed += n
                budget -= n
                last = s.fed == len(s.prompt)
                chunks.append(Chunk(s.cache, ids, wants_logits=last,
                                    mask=s.constraint.mask() if last and s.constraint is not None else None,
                                    extra=self._extra(s) if last else None))
                drafts.append([])
            else:
                d = proposed[s.id]
                chunks.append(Chunk(s.cache, [s.generated[-1], *d], logit_rows=1 + len(d),
                                    mask=s.constraint.mask() if s.constraint is not None else None,
                                    extra=self._extra(s)))
                drafts.append(d)
            owners.append(s)
        if not chunks:
            return
        # Candidates the head returns: greedy needs only the first, sampling HEAD_TOP_K, logprobs n + 1
        # (a smaller reply to build, send and parse for an all-greedy step).
        k = max(s.params.candidates() for s in owners)
        t0 = time.perf_counter()
        starts = [c.cache.length for c in chunks]
        tops = self.engine.step_rows(chunks, k)
        seconds = time.perf_counter() - t0
        self.last_step_ms = seconds * 1e3
        self.steps += 1
        rows = sum(len(c.ids) for c in chunks)
        if len(chunks) == len(decoding):  # decoding steps only: a prefill row costs otherwise than a decoding one
            self.cost.observe(rows, seconds)
        self.step_rows += rows
        self.on_step(rows)
        for i, (s, rows_top, d, start) in enumerate(zip(owners, tops, drafts, starts, strict=True)):
            if not rows_top or s.cancelled:
                continue
            if not d:
                top = self._complete(s, i, rows_top[-1], k)
                if not s.generated:  # the prompt is in: keep it for later prompts, hand it to the siblings
                    self._prefilled(s, top)
                self._accept(s, top)
            else:
                self._verify(s, d, rows_top, start)
            if s.speculator is not None:
                s.speculator.settle(s.generated)

    def _budget(self, decoding: list[Seq], proposed: dict[int, list[int]]) -> None:
        """Leave out the proposed drafts that would not pay for their rows in this step (`drafts_that_pay`:
        each sequence's chance of a kept draft against the step's fixed and per-row cost)."""
        # A seeded sampling sequence keeps every draft adaptive k allows: which drafts are verified decides
        # how its draws consume its generator, and the budget follows measured time, so a rerun would differ.
        drafting = [(s, s.speculator) for s in decoding if proposed[s.id] and s.speculator is not None
                    and (s.params.seed is None or s.params.temperature < MIN_TEMPERATURE)]
        if not drafting:
            return
        take = drafts_that_pay([sp.chance for _, sp in drafting], [len(proposed[s.id]) for s, _ in drafting],
                               len(decoding), len(decoding), self.cost.estimate())
        for (s, sp), n in zip(drafting, take, strict=True):
            d = proposed[s.id]
            if n < len(d):
                self.withheld_tokens += len(d) - n
                if n == 0:
                    sp.withhold(d, len(s.generated))
                proposed[s.id] = d[:n]

    def _extra(self, s: Seq) -> np.ndarray | None:
        """The ids the head must add to this sequence's candidates (`raised`), when the many-rows form
        takes them; beyond `MAX_EXTRA_IDS` the whole row is asked for after the step (`_complete`)."""
        if not s.params.adjusts:
            return None
        s.raised = raised(s.params, s.prompt, s.generated)
        return s.raised if 0 < s.raised.size <= MAX_EXTRA_IDS else None

    def _complete(self, s: Seq, chunk: int, top: Top, k: int) -> Top:
        if not s.params.adjusts:
            return top

        def row() -> np.ndarray:
            self.full_rows += 1
            return self.engine.row_logits(chunk)

        return complete(top, s.params, s.prompt, s.generated, s.raised, k, row)

    def _drafts(self, s: Seq) -> list[int]:
        """The drafts for a decoding sequence's chunk: none without speculation, and never more than
        it may still emit after its next token, nor than its cache holds. A sequence whose sampler
        does more than temperature and top-p (penalties, logit_bias, top_k, min_p) or follows a
        grammar gets none: verification reproduces exactly that sampler's distribution only."""
        p = s.params
        if (s.speculator is None or s.cache is None or s.constraint is not None or p.adjusts or p.top_k
                or p.min_p > 0.0):
            return []
        room = min(p.max_tokens - len(s.generated) - 1, s.cache.context - s.cache.length - 1)
        return s.speculator.propose(s.prompt + s.generated, room) if room > 0 else []

    def _verify(self, s: Seq, d: list[int], rows_top: Sequence[tuple[np.ndarray, np.ndarray]], start: int) -> None:
        assert s.speculator is not None and s.cache is not None
        kept, nxt = s.speculator.verify(d, rows_top, s.params.temperature, s.params.top_p, s.rng)
        s.cache.truncate(start + 1 + kept)  # the last decided token and the kept drafts stay
        self.drafted_tokens += len(d)
        self.accepted_tokens += kept
        for i, tok in enumerate([*d[:kept], nxt]):
            if s.finished is not None:
                return
            self._emit(s, tok, *rows_top[i])

    def _prefilled(self, s: Seq, top: Top) -> None:
        assert s.cache is not None
        if self.prefix is not None:
            self.prefix.store(s.prompt, s.cache)
        n = s.cache.length
        for sib in s.siblings:
            if sib.cancelled or sib.cache is None:
                continue
            for layer in range(len(s.cache.keys)):
                sib.cache.keys[layer][:, :n] = s.cache.keys[layer][:, :n]
                sib.cache.values[layer][:, :n] = s.cache.values[layer][:, :n]
            sib.cache.length, sib.fed, sib.cached = n, len(sib.prompt), s.cached
            self._accept(sib, top)  # the same next-token candidates, its own draw

    def _accept(self, s: Seq, top: Top) -> None:
        if s.constraint is not None and s.constraint.error is not None:
            log.error("sequence %d: %s", s.id, s.constraint.error)
            self._finish(s, None, RuntimeError(s.constraint.error))
            return
        ids, lps = top
        lse = top.lse if s.params.adjusts else 0.0  # only repetition_penalty needs the logits' scale
        self._emit(s, sample(ids, lps, s.params, s.rng, s.prompt, s.generated, lse), ids, lps)

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
        if s.constraint is not None:
            try:
                s.constraint.accept(tok)
            except RuntimeError as e:  # the grammar and the head disagree (a bug): this sequence alone fails
                log.error("sequence %d: %s", s.id, e)
                self._finish(s, None, e)
                return
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
        elif s.constraint is not None and s.constraint.complete:
            self._release(s, final=True)
            self._finish(s, "stop")
        elif s.ends is not None and s.ends(self.tok.decode(s.generated, skip_special_tokens=True)):
            self._release(s, final=True)
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
        if error is None and self.prefix is not None and s.cache is not None:
            # The reply's KV too: a chat's next turn re-sends it as history.
            self.prefix.store(s.prompt + s.generated, s.cache)
        s.cache = None  # the KV cache goes back now
        s.post(Event("error", error=error) if error is not None else Event("done", finish_reason=reason))

    def stats(self) -> dict[str, Any]:
        return {"steps": self.steps, "rows": self.step_rows,
                "mean_rows_per_step": round(self.step_rows / self.steps, 3) if self.steps else None,
                "last_step_ms": round(self.last_step_ms, 3), "generated_tokens": self.generated_tokens,
                "prompt_tokens": self.prompt_tokens, "full_logit_rows": self.full_rows,
                "prefix_cache": None if self.prefix is None else self.prefix.stats(),
                "speculation": {**self.speculation.as_json(), "drafted_tokens": self.drafted_tokens,
                                "withheld_tokens": self.withheld_tokens, "step_cost_ms": self._cost_ms(),
                                "accepted_tokens": self.accepted_tokens,
                                "acceptance": round(self.accepted_tokens / self.drafted_tokens, 4)
                                if self.drafted_tokens else None}}

    def _cost_ms(self) -> dict[str, float] | None:
        est = self.cost.estimate()
        return None if est is None else {"fixed": round(est[0] * 1e3, 3), "per_row": round(est[1] * 1e3, 3)}
