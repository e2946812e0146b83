"""Speculative decoding: draft a few tokens cheaply, verify them all in ONE pass through the grid.

Decode through the grid pays one round trip per layer per token. A pass with ``k + 1`` rows (the
last decided token and ``k`` drafted ones) costs the same round trips as a pass with one row: one
walk-ffn request per layer for all rows, one many-rows logits request. When the drafts are right,
one pass yields up to ``k + 1`` tokens.

- Drafters: `NgramDrafter` (prompt lookup: the longest recent n-gram of the context that occurred
  before proposes what followed it; no extra model; strong where the output copies the input:
  summaries, extraction, edits, code) and `ModelDrafter` (a small local vindex run whole here,
  same tokenizer).
- Acceptance (`accept`): greedy keeps the drafts equal to the target's argmax, then the target's own
  token: the output is token for token that of plain greedy decoding. With temperature / top-p, the
  standard speculative-sampling rule (Leviathan et al. 2023, Chen et al. 2023): draft x with draft
  probability q(x) is kept with probability min(1, p(x) / q(x)); at the first rejection the token is
  drawn from norm(max(0, p - q)); when all are kept a bonus token is drawn from p. The emitted tokens
  are distributed exactly as sampling from p one token at a time. An n-gram draft is a point mass
  (q(x) = 1).
- `AdaptiveK`: k per sequence from its recent acceptance; k = 0 for a growing number of steps when
  drafts keep failing, so a sequence the drafter cannot help (open-ended chat) decodes as without
  speculation, at the cost of an occasional one-token probe.
- In a batching step (larql-serve) a draft row costs what any row costs, and with many sequences the
  rows are most of the step: `StepCost` learns a step's fixed and per-row seconds from the steps,
  `drafts_that_pay` keeps the drafts whose chance of being kept (per sequence, fading) pays for
  their row, and the withheld ones are checked against the tokens that come (`SeqSpeculator.settle`),
  so the chance keeps learning at no cost.
- The KV cache takes all ``k + 1`` rows and is rolled back past the first rejected one
  (`KVCache.truncate`, `SeqCache.truncate`).

`generate` is the single-sequence loop (`larql generate`); larql-serve's scheduler uses the same
drafters, `accept` and `AdaptiveK` per sequence in its batching step.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from larql_edge.errors import LarqlError, RemoteError
from larql_edge.model import ops

DEFAULT_MAX_K = 4  # drafts per pass at most: past ~4, a rejected tail costs more rows than it saves
NGRAM_MAX = 4
NGRAM_MIN = 2  # a single repeated token is too weak a match: it drafts noise in open-ended text
MIN_TEMPERATURE = 1e-3  # below: greedy (as larql-serve and the embed server)


# -- distributions -------------------------------------------------------------------------------


@dataclass
class Dist:
    """A distribution over token ids: ``probs[i]`` is the probability of ``ids[i]`` (the rest 0).
    ``ids`` None: dense over the whole vocabulary (``probs[t]`` is the probability of ``t``)."""

    probs: np.ndarray
    ids: np.ndarray | None = None

    @classmethod
    def point(cls, tok: int) -> "Dist":
        return cls(np.ones(1), np.array([tok], dtype=np.int64))

    def prob(self, tok: int) -> float:
        if self.ids is None:
            return float(self.probs[tok]) if 0 <= tok < self.probs.size else 0.0
        where = np.nonzero(self.ids == tok)[0]
        return float(self.probs[where[0]]) if where.size else 0.0

    def sample(self, rng: np.random.Generator) -> int:
        i = int(rng.choice(self.probs.size, p=self.probs))
        return i if self.ids is None else int(self.ids[i])

    def minus(self, q: "Dist") -> "Dist | None":
        """norm(max(0, self - q)): where a rejected draft's token comes from (None: nothing left)."""
        p = self.probs.copy()
        if q.ids is None and self.ids is None:
            p = np.maximum(p - q.probs, 0.0)
        else:
            q_ids = np.arange(q.probs.size) if q.ids is None else q.ids
            for t, qv in zip(q_ids.tolist(), q.probs.tolist(), strict=True):
                if qv <= 0:
                    continue
                if self.ids is None:
                    if 0 <= t < p.size:
                        p[t] = max(p[t] - qv, 0.0)
                else:
                    where = np.nonzero(self.ids == t)[0]
                    if where.size:
                        p[where[0]] = max(p[where[0]] - qv, 0.0)
        total = p.sum()
        return Dist(p / total, self.ids) if total > 0 else None


def dist_from_logits(logits: np.ndarray, temperature: float) -> Dist:
    """The client's sampling distribution: softmax(logits / T) over the whole vocabulary, the same
    arithmetic as `larql_edge.model.forward.sample`."""
    lp = ops.log_softmax(np.asarray(logits) / temperature)
    p = np.exp(lp)
    return Dist(p / p.sum())


def dist_from_top(ids: np.ndarray, lps: np.ndarray, temperature: float, top_p: float = 1.0) -> Dist:
    """larql-serve's sampling distribution over the head's top candidates: temperature, then the
    smallest prefix whose probability reaches top_p (the arithmetic of the scheduler's `sample`)."""
    z = np.asarray(lps, dtype=np.float64) / temperature
    z = z - z.max()
    prob = np.exp(z)
    prob /= prob.sum()
    if top_p < 1.0:
        order = np.argsort(-prob, kind="stable")
        cum = np.cumsum(prob[order])
        keep = order[: int(np.searchsorted(cum, top_p) + 1)]
        mask = np.zeros_like(prob)
        mask[keep] = prob[keep]
        prob = mask / mask.sum()
    return Dist(prob, np.asarray(ids, dtype=np.int64))


# -- acceptance ----------------------------------------------------------------------------------


def accept_greedy(drafts: Sequence[int], argmaxes: Sequence[int]) -> tuple[int, int]:
    """(drafts kept, the target's token after them). ``argmaxes[i]`` is the target's token after
    the ``i``-th row of the pass (row 0: the last decided token), ``len(drafts) + 1`` of them."""
    n = 0
    while n < len(drafts) and int(drafts[n]) == int(argmaxes[n]):
        n += 1
    return n, int(argmaxes[n])


def accept(drafts: Sequence[int], q: Sequence[Dist] | None, p: Sequence[Dist],
           rng: np.random.Generator) -> tuple[int, int]:
    """The speculative-sampling rule: (drafts kept, the next token). ``p[i]`` is the target's
    distribution after row ``i`` (``len(drafts) + 1`` of them), ``q[i]`` the distribution draft
    ``i`` was drawn from (None: every draft a point mass, as n-gram drafts are)."""
    for i, d in enumerate(drafts):
        qi = Dist.point(int(d)) if q is None else q[i]
        pd, qd = p[i].prob(int(d)), qi.prob(int(d))
        if qd > 0 and rng.random() < min(1.0, pd / qd):
            continue
        residual = p[i].minus(qi)
        return i, (residual.sample(rng) if residual is not None else p[i].sample(rng))
    return len(drafts), p[len(drafts)].sample(rng)


# -- adaptive k ----------------------------------------------------------------------------------


@dataclass
class AdaptiveK:
    """How many drafts a sequence asks for next. Full acceptance grows k, a partial one sets it just
    past what was kept, and after ``patience`` passes in a row with nothing kept the sequence stops
    drafting for ``backoff`` passes (doubling each time, to ``max_backoff``) before one probe."""

    max_k: int = DEFAULT_MAX_K
    k: int = field(default=-1)
    patience: int = 2
    backoff: int = 4
    max_backoff: int = 64
    misses: int = 0
    rest: int = 0  # passes left without drafts

    def __post_init__(self) -> None:
        self.max_k = max(0, self.max_k)
        self.k = self.max_k if self.k < 0 else min(self.k, self.max_k)

    def next_k(self) -> int:
        if self.rest > 0:
            self.rest -= 1
            return 0
        return self.k

    def update(self, drafted: int, kept: int) -> None:
        if drafted <= 0:
            return
        if kept == drafted:
            self.k = min(self.max_k, self.k + 1)
            self.misses = 0
            self.backoff = max(4, self.backoff // 2)
        elif kept == 0:
            self.misses += 1
            self.k = max(1, self.k // 2)
            if self.misses >= self.patience:
                self.rest, self.misses = self.backoff, 0
                self.backoff = min(self.max_backoff, self.backoff * 2)
        else:
            self.k = max(1, min(self.max_k, kept + 1))
            self.misses = 0


# -- what a draft row is worth (a batching step) --------------------------------------------------


class StepCost:
    """A batching step's seconds as ``fixed + per_row x rows``, fitted to the recent decoding steps
    (least squares, each older step weighing `DECAY` times less): ``fixed`` is what a step costs
    whatever its rows (the hops, the weights streamed once), ``per_row`` what one more row adds (its
    share of the head, the FFN, the attention). A draft row is worth its cost only where its chance
    of being kept beats that row's share of the step's time per token (`drafts_that_pay`). Until the
    rows have varied enough to tell the two apart there is no estimate, and every proposed draft goes
    in; when they stop varying (every draft withheld), the last slope is kept and the level follows."""

    DECAY = 0.95  # per step: ~20 steps of memory, so a change of load or of grid shows within a second
    MIN_SPREAD = 0.25  # variance of the rows (rows^2) below which the slope is not refitted
    MIN_STEPS = 4.0

    def __init__(self) -> None:
        self.w = self.r = self.t = self.rr = self.rt = 0.0
        self.slope: float | None = None

    def observe(self, rows: int, seconds: float) -> None:
        d = self.DECAY
        self.w = self.w * d + 1.0
        self.r = self.r * d + rows
        self.t = self.t * d + seconds
        self.rr = self.rr * d + rows * rows
        self.rt = self.rt * d + rows * seconds
        mr, mt = self.r / self.w, self.t / self.w
        var = self.rr / self.w - mr * mr
        if self.w >= self.MIN_STEPS and var > self.MIN_SPREAD:
            self.slope = max(0.0, (self.rt / self.w - mr * mt) / var)

    def estimate(self) -> tuple[float, float] | None:
        """(fixed, per_row) seconds, or None while nothing can be told apart."""
        if self.slope is None:
            return None
        mr, mt = self.r / self.w, self.t / self.w
        per_row = min(self.slope, mt / max(mr, 1.0))  # never more than the whole step per row: fixed >= 0
        return mt - per_row * mr, per_row


def drafts_that_pay(chances: Sequence[float], proposed: Sequence[int], rows: int, tokens: float,
                    cost: tuple[float, float] | None) -> list[int]:
    """How many of each sequence's ``proposed[s]`` drafts go into a step of ``rows`` rows that yields
    ``tokens`` without them. Sequence ``s``'s ``j``-th draft is kept with chance ``chances[s] ** j``
    (``chances[s]``: its chance that a draft is kept when the one before it was). Rows are added, the
    likeliest first, while each raises the step's expected tokens per second: with ``C = fixed +
    per_row x rows``, a row of chance ``p`` pays when ``(tokens + p) / (C + per_row) > tokens / C``,
    i.e. ``p x C > per_row x tokens``. So under a light load (the hops dominate ``C``) a coin-flip
    draft pays, and in a step of many sequences (their rows dominate) only a near-certain one does.
    ``cost`` None (nothing measured yet): every proposed draft."""
    if cost is None:
        return list(proposed)
    fixed, per_row = cost
    take = [0] * len(proposed)
    seconds = fixed + per_row * rows
    ranked = sorted(((c ** j, s, j) for s, (c, n) in enumerate(zip(chances, proposed, strict=True))
                     for j in range(1, n + 1)), key=lambda e: (-e[0], e[2]))
    for p, s, j in ranked:
        if p * seconds <= per_row * tokens:
            break
        if j == take[s] + 1:  # a draft only behind the ones before it (ties of chance 1: in order)
            take[s] = j
            seconds += per_row
            tokens += p
    return take


# -- drafters ------------------------------------------------------------------------------------


@dataclass
class Draft:
    tokens: list[int]
    q: list[Dist] | None = None  # None: point masses (deterministic drafts)


class Drafter(Protocol):
    def propose(self, context: Sequence[int], k: int, temperature: float,
                rng: np.random.Generator) -> Draft: ...


class NgramDrafter:
    """Prompt lookup (llama.cpp's lookup decoding, vLLM's n-gram speculation): the last ``n`` tokens
    of the context (n from ``max_n`` down to ``min_n``) are searched for earlier in the context, most
    recent match first; the tokens that followed it are the drafts."""

    def __init__(self, max_n: int = NGRAM_MAX, min_n: int = NGRAM_MIN, window: int = 4096):
        self.max_n, self.min_n, self.window = max_n, max(1, min_n), window

    def propose(self, context: Sequence[int], k: int, temperature: float = 0.0,
                rng: np.random.Generator | None = None) -> Draft:
        if k <= 0:
            return Draft([])
        ctx = np.asarray(context[-self.window :], dtype=np.int64)
        n_ctx = ctx.size
        for n in range(min(self.max_n, n_ctx - 1), self.min_n - 1, -1):
            tail = ctx[n_ctx - n :]
            # every start i < n_ctx - n where ctx[i : i + n] == tail, found with one vector compare per offset
            hits = np.ones(n_ctx - n, dtype=bool)
            for j in range(n):
                hits &= ctx[j : n_ctx - n + j] == tail[j]
            starts = np.nonzero(hits)[0]
            if starts.size:
                follow = int(starts[-1]) + n  # the most recent earlier occurrence
                return Draft([int(t) for t in ctx[follow : follow + k]])
        return Draft([])


class ModelDrafter:
    """Drafts from a small model run whole in this process (``--draft VINDEX``), with a KV cache kept
    in step with the context: each proposal rolls its cache back to the common prefix, feeds what is
    new, then decodes ``k`` tokens (greedy, or sampled at the target's temperature, recording q)."""

    def __init__(self, model):
        self.model = model  # a local `Transformer`
        # slack: its proposals are rolled back by up to k positions, past what a sliding window keeps
        self.cache = model.new_cache(slack=64)
        self.windows = model.windows()
        self.fed: list[int] = []
        self.seconds = 0.0  # spent drafting, so far (--timings, larql_serve_draft_seconds)

    def propose(self, context: Sequence[int], k: int, temperature: float = 0.0,
                rng: np.random.Generator | None = None) -> Draft:
        if k <= 0:
            return Draft([])
        t0 = time.perf_counter()
        try:
            return self._propose(context, k, temperature, rng)
        finally:
            self.seconds += time.perf_counter() - t0

    def _propose(self, context: Sequence[int], k: int, temperature: float,
                 rng: np.random.Generator | None) -> Draft:
        common = 0
        limit = min(len(self.fed), len(context) - 1)  # at least one new token gives the next logits
        while common < limit and self.fed[common] == context[common]:
            common += 1
        self.cache.truncate(common, self.windows)
        self.fed = list(context[:common])
        new = list(context[common:])
        tokens: list[int] = []
        q: list[Dist] = []
        for _ in range(k):
            logits = self.model.next_logits(new, self.cache)
            self.fed.extend(new)
            if temperature < MIN_TEMPERATURE:
                t = int(np.argmax(logits))
            else:
                d = dist_from_logits(logits, temperature)
                t = d.sample(rng if rng is not None else np.random.default_rng())
                q.append(d)
            tokens.append(t)
            new = [t]
        return Draft(tokens, q if temperature >= MIN_TEMPERATURE else None)


def check_draft_tokenizer(target_tok, draft_tok, target_vocab: int, draft_vocab: int) -> None:
    """A draft model must share the target's tokenizer: its ids are fed to the target as they are."""
    def vocab(t) -> dict:
        return t.get_vocab(with_added_tokens=True)

    if target_vocab != draft_vocab or vocab(target_tok) != vocab(draft_tok):
        raise LarqlError(f"--draft: the draft vindex's tokenizer differs from the model's (vocabularies of "
                         f"{draft_vocab} and {target_vocab} ids{', different tokens' if target_vocab == draft_vocab else ''}): "
                         "a draft model must use the same tokenizer")


def open_draft(path: str, target_tok, target_vocab: int):
    """``--draft VINDEX`` (`larql generate`, larql-serve): the small model run whole here, refused with
    a clear error unless it is a full vindex with the target's tokenizer."""
    from larql_edge.errors import VindexError
    from larql_edge.format.vindex import Vindex
    from larql_edge.model.forward import Transformer

    try:
        vx = Vindex.open(path)
    except VindexError as e:
        raise VindexError(f"--draft: {e}") from None
    try:
        draft = Transformer.local(vx)
    except VindexError as e:
        raise VindexError(f"--draft {path}: a draft model runs whole here and needs a full vindex ({e})") from None
    check_draft_tokenizer(target_tok, vx.load_tokenizer(), target_vocab, draft.spec.vocab_size)
    return draft


# -- the single-sequence loop --------------------------------------------------------------------


@dataclass
class SpecStats:
    passes: int = 0  # passes through the model after the prefill
    drafted: int = 0
    accepted: int = 0
    tokens: int = 0


class _Targets:
    """Per row of a pass: the target's argmax (greedy) or its sampling distribution. A pass of many
    rows asks the head ONCE (`RemoteHead.top_k_rows`, or its many-rows raw logits when sampling); a
    single row asks as plain decoding does. A server without the many-rows form (LARQL's embed server
    answers top-k JSON per row) is asked row by row, as `RemoteHead.logits` does by itself."""

    def __init__(self, head, temperature: float):
        self.head, self.temperature = head, temperature
        self.many_rows = hasattr(head, "top_k_rows")

    def __call__(self, h: np.ndarray) -> list:
        head = self.head
        if self.temperature < MIN_TEMPERATURE:
            if h.shape[0] > 1 and self.many_rows and getattr(head, "mode", "raw") == "raw":
                try:
                    return [int(ids[0]) for ids, _ in head.top_k_rows(h, 1)]
                except RemoteError:
                    self.many_rows = False
            return [int(np.argmax(row)) for row in np.asarray(head.logits(h), dtype=np.float32)]
        return [dist_from_logits(row, self.temperature) for row in np.asarray(head.logits(h), dtype=np.float32)]


def generate(model, ids: Sequence[int], max_tokens: int, temperature: float = 0.0, seed: int | None = None,
             stop_ids: Sequence[int] | None = None, drafter: Drafter | None = None, max_k: int = DEFAULT_MAX_K,
             stats: SpecStats | None = None) -> Iterator[int]:
    """`Transformer.generate` with speculation: the same tokens greedy, the same distribution sampled."""
    if not ids:
        raise ValueError("empty prompt: nothing to condition on")
    drafter = drafter or NgramDrafter()
    stats = stats if stats is not None else SpecStats()
    rng = np.random.default_rng(seed)
    stop = set(model.spec.eos_token_ids if stop_ids is None else stop_ids)
    greedy = temperature < MIN_TEMPERATURE
    cache = model.new_cache()
    windows = model.windows()
    context = list(ids)
    targets_of = _Targets(model.head, temperature)
    first = targets_of(model.forward(context, cache)[-1:])[0]
    adapt = AdaptiveK(max_k)
    out = 0
    emit = [first if isinstance(first, int) else first.sample(rng)]
    while True:
        for t in emit:
            yield t
            out += 1
            stats.tokens += 1
            context.append(t)
            if t in stop or out >= max_tokens:
                return
        pending = emit[-1]  # decided, not yet in the cache
        k = min(adapt.next_k(), max_tokens - out - 1)  # kept drafts and the token after them fit
        draft = drafter.propose(context, k, temperature, rng) if k > 0 else Draft([])
        drafts = draft.tokens[:k]
        start = cache.length
        targets = targets_of(model.forward([pending, *drafts], cache, alone=True))  # as plain decoding's rows
        if greedy:
            kept, nxt = accept_greedy(drafts, targets)
        else:
            kept, nxt = accept(drafts, draft.q, targets, rng)
        cache.truncate(start + 1 + kept, windows)  # the last decided token and the kept drafts stay
        adapt.update(len(drafts), kept)
        stats.passes += 1
        stats.drafted += len(drafts)
        stats.accepted += kept
        emit = [*drafts[:kept], nxt]


# -- per sequence, for a batching scheduler (larql-serve) ----------------------------------------


@dataclass(frozen=True)
class Settings:
    """What speculation does (larql-serve's ``/v1/stats`` shows it)."""

    enabled: bool = True
    max_k: int = DEFAULT_MAX_K
    ngram_min: int = NGRAM_MIN
    ngram_max: int = NGRAM_MAX
    draft: object | None = field(default=None, compare=False)  # a local `Transformer` (--draft): drafts from it
    draft_name: str | None = None  # what /v1/stats names it (the vindex's path)
    # Drafts go into a step only where they pay for their rows (`drafts_that_pay`); False: every
    # proposed draft (what AdaptiveK alone says).
    budget: bool = True

    def as_json(self) -> dict:
        drafter = None if not self.enabled else ("model" if self.draft is not None else "ngram")
        return {"enabled": self.enabled, "drafter": drafter, "draft": self.draft_name if self.draft is not None else None,
                "max_k": self.max_k, "ngram": [self.ngram_min, self.ngram_max], "adaptive": True,
                "budget": self.budget}


class SeqSpeculator:
    """One sequence's speculation in a batching step: `propose` the drafts that go in its chunk after
    its last decided token, then `verify` them against the top candidates of each of its rows.

    With a draft model, each sequence has a `ModelDrafter` of its own (its KV cache follows the
    sequence; the weights are shared) that drafts greedily: point-mass drafts, which the sampling
    rule verifies exactly as n-gram ones."""

    def __init__(self, settings: Settings):
        self.drafter: NgramDrafter | ModelDrafter = (ModelDrafter(settings.draft) if settings.draft is not None
                                                     else NgramDrafter(settings.ngram_max, settings.ngram_min))
        self.adapt = AdaptiveK(settings.max_k)
        self.drafted = 0
        self.accepted = 0
        # The chance that a draft is kept when the one before it was: kept / tried, both fading by
        # `FADE` a pass, from a prior of one in two.
        self._kept, self._tried = 1.0, 2.0
        self._shadow: tuple[list[int], int] | None = None  # withheld drafts and where they would have gone

    FADE = 0.8

    @property
    def chance(self) -> float:
        """How likely this sequence's next draft is to be kept (when the drafts before it were)."""
        return self._kept / self._tried

    def _learn(self, drafted: int, kept: int) -> None:
        self.adapt.update(drafted, kept)
        self._kept = self._kept * self.FADE + kept
        self._tried = self._tried * self.FADE + kept + (kept < drafted)

    def withhold(self, drafts: Sequence[int], at: int) -> None:
        """``drafts`` proposed for the sequence's tokens ``at``, ``at + 1``, ... but left out of the step
        (they would not pay: `drafts_that_pay`). They are checked against the tokens that come
        (`settle`), so the chance keeps learning without the rows. Exact in expectation: a greedy
        draft is kept iff it is the token that comes; a sampled point-mass draft with probability
        p(draft), the chance that the draw is that token."""
        if self._shadow is None and drafts:
            self._shadow = (list(drafts), at)

    def settle(self, generated: Sequence[int]) -> None:
        """Check withheld drafts against ``generated`` (the sequence's tokens so far), once it decides them."""
        if self._shadow is None:
            return
        drafts, at = self._shadow
        came = generated[at : at + len(drafts)]
        kept = 0
        while kept < len(came) and came[kept] == drafts[kept]:
            kept += 1
        if kept < len(came) or kept == len(drafts):  # a miss, or every draft matched: decided
            self._shadow = None
            self._learn(len(drafts), kept)

    @property
    def seconds(self) -> float:
        """Time spent in a draft model so far (0 for n-gram drafts: they cost next to nothing)."""
        return getattr(self.drafter, "seconds", 0.0)

    def propose(self, context: Sequence[int], room: int) -> list[int]:
        """At most ``room`` drafts (what the sequence may still emit after the next token, and what
        its cache still holds)."""
        k = min(self.adapt.next_k(), room)
        return self.drafter.propose(context, k).tokens[:k] if k > 0 else []

    def verify(self, drafts: Sequence[int], rows: Sequence[tuple[np.ndarray, np.ndarray]], temperature: float,
               top_p: float, rng: np.random.Generator) -> tuple[int, int]:
        """(drafts kept, the token after them); ``rows[i]`` is the (ids, log-probabilities) top of the
        target after row ``i`` of the sequence's chunk, ``len(drafts) + 1`` of them."""
        if temperature < MIN_TEMPERATURE:
            kept, nxt = accept_greedy(drafts, [int(ids[0]) for ids, _ in rows])
        else:
            kept, nxt = accept(drafts, None, [dist_from_top(ids, lps, temperature, top_p) for ids, lps in rows], rng)
        self._learn(len(drafts), kept)
        self.drafted += len(drafts)
        self.accepted += kept
        return kept, nxt
