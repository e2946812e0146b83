"""Speculative decoding, fast tier: the drafters, the acceptance rules, adaptive k, KV rollback, and
exactness on the tiny models (greedy: the same tokens as plain decoding; sampling: the same
distribution, by a chi-square test against the plain model's probabilities computed directly)."""

from __future__ import annotations

import json
import math
from statistics import NormalDist

import numpy as np
import pytest

from larql_edge.errors import LarqlError
from larql_edge.format.vindex import Vindex
from larql_edge.model import speculative as sp
from larql_edge.model.forward import Transformer
from larql_edge.model.speculative import AdaptiveK, Dist, Draft, ModelDrafter, NgramDrafter
from tests._grid import wait_metrics

# Repeats an n-gram (2 4 5 6) so that prompt lookup has something to draft; longer than the tiny
# Gemma's sliding window (4), so rollback crosses it.
IDS = [2, 4, 5, 6, 7, 8, 9, 10, 4, 5, 6, 11, 12, 4, 5]


def _chi_square_ok(counts: np.ndarray, probs: np.ndarray, alpha_z: float = 3.29) -> tuple[bool, float, float]:
    """Pearson's goodness of fit at ~1e-3 (upper z 3.29 via Wilson-Hilferty; scipy is not a dependency).
    Cells expecting fewer than 5 draws are pooled."""
    n = counts.sum()
    exp = probs * n
    big = exp >= 5
    obs_cells = list(counts[big]) + [counts[~big].sum()]
    exp_cells = list(exp[big]) + [exp[~big].sum()]
    if exp_cells[-1] < 5:  # the pooled rest too small: merge it into the smallest cell
        obs_cells[-2] += obs_cells.pop()
        exp_cells[-2] += exp_cells.pop()
    stat = sum((o - e) ** 2 / e for o, e in zip(obs_cells, exp_cells, strict=True))
    df = len(exp_cells) - 1
    crit = df * (1 - 2 / (9 * df) + alpha_z * math.sqrt(2 / (9 * df))) ** 3
    return stat <= crit, stat, crit


def test_chi_square_helper_rejects_a_wrong_distribution():
    rng = np.random.default_rng(0)
    p = np.array([0.4, 0.3, 0.2, 0.1])
    good = np.bincount(rng.choice(4, 20000, p=p), minlength=4)
    bad = np.bincount(rng.choice(4, 20000, p=[0.37, 0.33, 0.2, 0.1]), minlength=4)
    assert _chi_square_ok(good, p)[0]
    assert not _chi_square_ok(bad, p)[0]
    assert NormalDist().inv_cdf(1 - 5e-4) == pytest.approx(3.29, abs=0.01)


def test_ngram_drafter_proposes_what_followed_the_most_recent_match():
    d = NgramDrafter(max_n=3, min_n=2)
    # the tail (5, 6) occurred twice before; the most recent is followed by 11 12 4
    assert d.propose([1, 5, 6, 7, 8, 5, 6, 11, 12, 4, 5, 6], 3).tokens == [11, 12, 4]
    assert d.propose([1, 5, 6, 7, 8, 5, 6, 11, 12, 4, 5, 6], 1).tokens == [11]
    # the longest n-gram wins over a more recent shorter one: (7, 5, 6) -> 9
    assert d.propose([7, 5, 6, 9, 1, 5, 6, 3, 7, 5, 6], 2).tokens == [9, 1]
    assert d.propose([1, 2, 3, 4], 3).tokens == []  # no repeat, no draft
    assert d.propose([1, 2, 1, 2], 0).tokens == []
    assert d.propose([3, 3], 2).tokens == []  # min_n 2: a single repeated token is not a match
    assert NgramDrafter(min_n=1).propose([3, 3], 2).tokens == [3]
    # a match right before the tail proposes up to what exists
    assert d.propose([9, 8, 9, 8], 4).tokens == [9, 8]


def test_greedy_acceptance_keeps_the_prefix_equal_to_the_targets_argmax():
    assert sp.accept_greedy([5, 6, 7], [5, 6, 7, 8]) == (3, 8)
    assert sp.accept_greedy([5, 6, 7], [5, 9, 7, 8]) == (1, 9)
    assert sp.accept_greedy([5, 6, 7], [4, 6, 7, 8]) == (0, 4)
    assert sp.accept_greedy([], [3]) == (0, 3)


@pytest.mark.parametrize("drafter", ["point", "model"])
def test_the_acceptance_rule_keeps_the_target_distribution(drafter):
    """The first emitted token of a pass is distributed as p[0], whatever the drafts and q."""
    rng = np.random.default_rng(7)
    vocab = 8
    p0 = np.array([0.30, 0.22, 0.15, 0.12, 0.09, 0.06, 0.04, 0.02])
    p = [Dist(p0), Dist(np.roll(p0, 3))]
    q0 = np.array([0.05, 0.05, 0.40, 0.05, 0.05, 0.30, 0.05, 0.05])
    counts = np.zeros(vocab, dtype=np.int64)
    wrong = np.zeros(vocab, dtype=np.int64)  # a naive rule (keep every draft) for contrast
    for _ in range(20000):
        if drafter == "point":
            d, q = [5], None  # an unlikely token drafted deterministically
        else:
            d, q = [int(rng.choice(vocab, p=q0))], [Dist(q0)]
        kept, nxt = sp.accept(d, q, p, rng)
        counts[d[0] if kept else nxt] += 1
        wrong[d[0]] += 1
    ok, stat, crit = _chi_square_ok(counts, p0)
    assert ok, (stat, crit, counts)
    assert not _chi_square_ok(wrong, p0)[0]


def test_sparse_distributions_accept_and_residual_as_dense_ones():
    rng = np.random.default_rng(3)
    p = Dist(np.array([0.5, 0.3, 0.2]), np.array([40, 7, 9]))
    assert p.prob(7) == 0.3 and p.prob(8) == 0.0
    r = p.minus(Dist.point(40))
    assert r is not None and r.prob(40) == 0.0 and r.prob(7) == pytest.approx(0.6)
    counts = np.zeros(3, dtype=np.int64)
    for _ in range(20000):
        kept, nxt = sp.accept([40], None, [p, p], rng)
        counts[[40, 7, 9].index(40 if kept else nxt)] += 1
    assert _chi_square_ok(counts, p.probs)[0]
    # a draft the target gives no probability is always rejected, the token drawn from p itself
    assert all(sp.accept([123], None, [p, p], rng)[0] == 0 for _ in range(200))


def test_top_p_distribution_matches_the_schedulers_sampler():
    from larql_edge.roles.serve.scheduler import Params, sample

    ids = np.array([11, 12, 13, 14, 15])
    lps = np.log(np.array([0.4, 0.25, 0.15, 0.12, 0.08]))
    d = sp.dist_from_top(ids, lps, temperature=0.7, top_p=0.8)
    for seed in range(50):
        assert d.sample(np.random.default_rng(seed)) == sample(ids, lps, Params(4, 0.7, 0.8), np.random.default_rng(seed))


def test_adaptive_k_backs_off_to_zero_when_drafts_keep_failing_and_recovers():
    a = AdaptiveK(4)
    assert a.next_k() == 4
    a.update(4, 4)
    assert a.k == 4
    a.update(4, 1)
    assert a.next_k() == 2
    a.update(2, 0)
    a.update(1, 0)  # patience 2: now it rests
    rest = [a.next_k() for _ in range(4)]
    assert rest == [0, 0, 0, 0]
    assert a.next_k() == 1  # one probe
    a.update(1, 0)
    a.update(1, 0)
    assert [a.next_k() for _ in range(8)] == [0] * 8  # the rest doubled
    assert a.next_k() == 1
    a.update(1, 1)
    a.update(2, 2)
    assert a.next_k() == 3  # grows back with full acceptance
    a.update(0, 0)  # no drafts: nothing learned
    assert a.next_k() == 3
    assert AdaptiveK(0).next_k() == 0


def test_step_cost_learns_a_steps_fixed_and_per_row_seconds_and_keeps_the_slope_when_rows_stop_varying():
    rng = np.random.default_rng(0)
    cost = sp.StepCost()
    assert cost.estimate() is None
    for _ in range(3):
        cost.observe(16, 0.2)
    assert cost.estimate() is None  # the rows have not varied: fixed and per-row cannot be told apart
    for _ in range(200):
        rows = int(rng.integers(16, 25))
        cost.observe(rows, 0.015 + 0.012 * rows + rng.normal(0, 0.002))
    est = cost.estimate()
    assert est is not None
    fixed, per_row = est
    assert per_row == pytest.approx(0.012, abs=0.002) and fixed == pytest.approx(0.015, abs=0.03)
    for _ in range(200):  # every draft withheld: 16 rows each step, on the same line
        cost.observe(16, 0.015 + 0.012 * 16)
    assert (cost.estimate() or (0.0, 0.0))[1] == pytest.approx(per_row, abs=5e-4)  # the slope is kept
    for _ in range(200):  # ... and then the grid got 30 ms slower a step: the prediction follows
        cost.observe(16, 0.045 + 0.012 * 16)
    fixed2, per_row2 = cost.estimate() or (-1.0, -1.0)
    assert fixed2 >= 0 and per_row2 >= 0
    assert fixed2 + 16 * per_row2 == pytest.approx(0.045 + 0.012 * 16, abs=2e-3)
    cost = sp.StepCost()
    for i in range(50):  # rows that cost nothing (a noisy fit below zero): never a negative row
        cost.observe(1 + i % 5, 0.05 - 0.001 * (i % 5))
    assert cost.estimate() == (pytest.approx(0.048, abs=1e-3), 0.0)


def test_drafts_that_pay_for_their_rows_go_in_and_the_others_do_not():
    # Nothing measured yet: every proposed draft.
    assert sp.drafts_that_pay([0.1, 0.9], [4, 2], 2, 2, None) == [4, 2]
    # One sequence, the hops dominate (50 ms a step, 1 ms a row): even a coin flip's fourth draft pays.
    assert sp.drafts_that_pay([0.5], [4], 1, 1, (0.050, 0.001)) == [4]
    # ... but not a poor record's: chance 0.05 x 51 ms < 1 ms x 1 token.
    assert sp.drafts_that_pay([0.01], [4], 1, 1, (0.050, 0.001)) == [0]
    # 16 sequences, rows dominate (15 ms fixed, 12 ms a row: a row is 0.93 of a token's time): the coin
    # flips stay out, a near-certain copier's drafts go in while their chance lasts (0.99^j > ~0.93).
    chances = [0.5] * 15 + [0.99]
    take = sp.drafts_that_pay(chances, [4] * 16, 16, 16, (0.015, 0.012))
    assert take == [0] * 15 + [4]
    take = sp.drafts_that_pay([0.97], [8], 16, 16, (0.015, 0.012))
    assert 0 < take[0] < 8 and all(0.97 ** j * (0.015 + 0.012 * (16 + j - 1)) > 0.012 * 16 for j in range(1, take[0] + 1))
    # A draft goes in only behind the ones before it: the likeliest rows first across sequences.
    # (0.9, 0.81, 0.729 of the first, then 0.6 of the second pay; 0.36 x 34 ms < 4 ms x 5.04 tokens)
    take = sp.drafts_that_pay([0.9, 0.6], [3, 3], 2, 2, (0.010, 0.004))
    assert take == [3, 1]
    assert sp.drafts_that_pay([1.0, 1.0], [2, 2], 2, 2, (0.0, 0.001)) == [0, 0]  # a row at no gain: out


def test_withheld_drafts_are_checked_against_the_tokens_that_come():
    s = sp.SeqSpeculator(sp.Settings(max_k=4))
    assert s.chance == 0.5  # the prior: one in two
    s.withhold([5, 6, 7], at=3)
    s.withhold([1, 1], at=4)  # one withheld proposal at a time: the first stands
    s.settle([9, 9, 9])
    s.settle([9, 9, 9, 5])  # the first came true; the second not decided yet
    assert s.chance == 0.5
    s.settle([9, 9, 9, 5, 6, 8])  # two kept, the third missed
    assert s.chance == pytest.approx((0.8 + 2) / (1.6 + 3))
    assert s.adapt.k == 3  # AdaptiveK learns from it as from a verified pass
    assert s.drafted == 0 and s.accepted == 0  # nothing was sent
    s.withhold([4, 4], at=6)
    s.settle([9, 9, 9, 5, 6, 8, 4, 4])  # every one came true
    assert s.chance == pytest.approx((2.8 * 0.8 + 2) / (4.6 * 0.8 + 2))
    s.settle([9, 9, 9, 5, 6, 8, 4, 4, 1])  # decided: nothing pending
    assert s.chance == pytest.approx((2.8 * 0.8 + 2) / (4.6 * 0.8 + 2))


def _scheduler_run(tiny_models, settings, cost=None, prompts=None, tokens=12):
    import asyncio

    from larql_edge.model.batch import BatchEngine, LocalTopK
    from larql_edge.roles.serve.scheduler import Params, Scheduler, Seq

    m = Transformer.local(tiny_models["gemma3"])
    engine = BatchEngine(m.spec, m.attn, m.embedder, m.ffn_provider, LocalTopK(m.head), m.backend)
    prompts = prompts or [IDS, IDS[3:], [2, 7, 8, 9, 7, 8, 9, 7, 8]]

    async def run() -> tuple[list[list[int]], dict]:
        loop = asyncio.get_running_loop()
        sched = Scheduler(engine, Vindex.open(tiny_models["gemma3"]).load_tokenizer(), context=64, max_active=8,
                          max_queue=8, speculation=settings)
        if cost is not None:
            sched.cost = cost
        seqs = [Seq(p, Params(tokens, temperature=0.0), loop) for p in prompts]
        try:
            for q in seqs:
                sched.admit(q)
            for q in seqs:
                while (await q.events.get()).kind == "text":
                    pass
        finally:
            sched.stop()
        return [q.generated for q in seqs], sched.stats()["speculation"]

    return asyncio.run(run())


class _Fixed(sp.StepCost):
    def __init__(self, est):
        super().__init__()
        self.est = est

    def estimate(self):
        return self.est


def test_serve_withholds_drafts_that_cannot_pay_and_gives_the_same_tokens(tiny_models):
    """In larql-serve's scheduler: when a row costs a whole token's share of the step, no draft is sent
    (withheld ones are still settled: the record learns); when rows cost nothing every draft goes in;
    greedy gives the tokens of plain decoding either way."""
    plain, _ = _scheduler_run(tiny_models, sp.Settings(enabled=False))
    dear, st = _scheduler_run(tiny_models, sp.Settings(max_k=4), _Fixed((0.0, 0.01)))
    assert dear == plain
    assert st["drafted_tokens"] == 0 and st["withheld_tokens"] > 0
    assert st["step_cost_ms"] == {"fixed": 0.0, "per_row": 10.0}
    free, st = _scheduler_run(tiny_models, sp.Settings(max_k=4), _Fixed((0.01, 0.0)))
    assert free == plain
    assert st["drafted_tokens"] > 0 and st["withheld_tokens"] == 0 and st["accepted_tokens"] > 0
    off, st = _scheduler_run(tiny_models, sp.Settings(max_k=4, budget=False), _Fixed((0.0, 0.01)))
    assert off == plain and st["withheld_tokens"] == 0 and st["drafted_tokens"] > 0 and st["budget"] is False


@pytest.mark.parametrize("family", ["gemma3", "llama"])
def test_kv_rollback_gives_the_logits_of_a_cache_that_never_saw_the_rejected_rows(tiny_models, family):
    m = Transformer.local(tiny_models[family])
    want = m.next_logits(IDS)  # one plain pass over the whole sequence
    cache = m.new_cache()
    m.forward(IDS[:9], cache)
    m.forward([IDS[9], 33, 34, 35], cache)  # one kept row, three rejected
    cache.truncate(10, m.windows())
    got = m.next_logits(IDS[10:], cache)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
    with pytest.raises(ValueError):
        cache.truncate(cache.length + 1)


def test_kv_rollback_past_the_sliding_window_needs_slack(tiny_models):
    m = Transformer.local(tiny_models["gemma3"])  # window 4
    tight = m.new_cache()
    for t in IDS[:10]:
        m.forward([t], tight)
    with pytest.raises(ValueError, match="slack"):
        tight.truncate(6, m.windows())
    loose = m.new_cache(slack=8)
    for t in IDS[:10]:
        m.forward([t], loose)
    loose.truncate(6, m.windows())
    np.testing.assert_allclose(m.next_logits(IDS[6:12], loose), m.next_logits(IDS[:12]), atol=1e-5, rtol=0)


@pytest.mark.parametrize("family", ["gemma3", "llama"])
@pytest.mark.parametrize("drafter", ["ngram", "same-model", "other-model"])
def test_greedy_speculation_gives_the_tokens_of_plain_decoding(tiny_models, family, drafter):
    m = Transformer.local(tiny_models[family])
    other = "llama" if family == "gemma3" else "gemma3"
    d = {"ngram": None, "same-model": lambda: ModelDrafter(Transformer.local(tiny_models[family])),
         "other-model": lambda: ModelDrafter(Transformer.local(tiny_models[other]))}[drafter]
    for prompt in (IDS, IDS[:5], [2, 4, 4, 4, 4]):
        want = list(m.generate(prompt, 40, stop_ids=[]))
        stats = sp.SpecStats()
        got = list(sp.generate(m, prompt, 40, stop_ids=[], drafter=d() if d else None, stats=stats))
        assert got == want
        assert stats.tokens == 40 and stats.passes + 1 <= 40
    if drafter == "same-model":  # a perfect drafter: every draft kept, ~k+1 tokens per pass
        assert stats.accepted == stats.drafted and stats.passes <= 40 // 4


def test_greedy_speculation_stops_at_eos_and_max_tokens_as_plain_decoding(tiny_models):
    m = Transformer.local(tiny_models["gemma3"])
    plain = list(m.generate(IDS, 30, stop_ids=[]))
    stop = plain[12]
    for n in (1, 2, 5, 13, 30):
        assert list(sp.generate(m, IDS, n, stop_ids=[])) == plain[:n]
    want = list(m.generate(IDS, 30, stop_ids=[stop]))
    assert list(sp.generate(m, IDS, 30, stop_ids=[stop],
                            drafter=ModelDrafter(Transformer.local(tiny_models["gemma3"])))) == want
    with pytest.raises(ValueError):
        list(sp.generate(m, [], 3))


class _FixedDrafter:
    """Always drafts the same tokens as point masses (a valid, if poor, drafter)."""

    def __init__(self, tokens):
        self.tokens = tokens

    def propose(self, context, k, temperature, rng):
        return Draft(self.tokens[:k])


# 3000 sampled generations each (6-7 s of CPU, 30 s on a loaded machine): the slow tier. The fast tier
# keeps the acceptance rule's own chi-square (above) and serve's sampled speculation (below).
@pytest.mark.slow
@pytest.mark.parametrize("drafter", ["fixed", "model"])
def test_sampled_speculation_keeps_the_models_distribution(tiny_models, drafter):
    """The second token of a sampled continuation (3 tokens: the second is the first one that went through acceptance) over
    many seeds, against sum_t1 p(t1) p(t2 | t1) from the plain model."""
    m = Transformer.local(tiny_models["gemma3"])
    temperature = 1.5  # a flat distribution: many cells
    ctx = IDS[:6]
    p1 = sp.dist_from_logits(m.next_logits(ctx), temperature).probs
    p2 = np.zeros_like(p1)
    for t1 in np.nonzero(p1 > 1e-9)[0]:
        p2 += p1[t1] * sp.dist_from_logits(m.next_logits([*ctx, int(t1)]), temperature).probs
    # one drafter for every run: the model drafter rolls its cache back to the common prefix
    draft = {"fixed": lambda: _FixedDrafter([int(np.argsort(p2)[-3])]),
             "model": lambda: ModelDrafter(Transformer.local(tiny_models["llama"]))}[drafter]()
    counts = np.zeros(p1.size, dtype=np.int64)
    runs = 3000
    stats = sp.SpecStats()
    for seed in range(runs):
        out = list(sp.generate(m, ctx, 3, temperature, seed=seed, stop_ids=[], drafter=draft, stats=stats))
        counts[out[1]] += 1
    assert stats.drafted == runs  # every second token went through the acceptance rule
    assert 0 < stats.accepted < runs
    ok, stat, crit = _chi_square_ok(counts, p2)
    assert ok, (stat, crit)
    assert not _chi_square_ok(counts, p1)[0]  # the test tells the two distributions apart


def test_a_draft_model_with_another_tokenizer_is_refused(tmp_path, tiny_models):
    from tokenizers import Tokenizer, models

    tok = Vindex.open(tiny_models["gemma3"]).load_tokenizer()
    other = Tokenizer(models.WordLevel(vocab={"x": 0, "y": 1}, unk_token="x"))
    sp.check_draft_tokenizer(tok, Vindex.open(tiny_models["llama"]).load_tokenizer(), 10, 10)
    with pytest.raises(LarqlError, match="same tokenizer"):
        sp.check_draft_tokenizer(tok, other, 10, 2)
    with pytest.raises(LarqlError, match="same tokenizer"):
        sp.check_draft_tokenizer(tok, other, 10, 10)


# -- larql-serve: drafts per sequence in the batching step (in-process grid) ---------------------

# Repetitive prompts (drafts find matches) and not (no drafts): they share the steps.
SERVE_PROMPTS = [IDS, [2, 4, 5, 6, 4, 5, 6, 4, 5], [7, 8, 9], [2, 3, 2, 3, 2, 3], [10, 11, 12, 13, 10, 11],
                 [4], [20, 21, 22, 20, 21], [30, 31]]


def _serve_app(vx_path, router_url, speculation):
    from larql_edge.net.remote import RemoteSettings
    from larql_edge.roles.serve.app import Limits, create_app, remote_engine, served_model
    from larql_edge.testing.servers import ServerThread

    vx = Vindex.open(vx_path)
    engine = remote_engine(vx, RemoteSettings(ffn=router_url, timeout=30, retries=1))
    served = served_model(vx, vx.load_tokenizer(), 96, None)
    served.eos_ids = ()  # every sequence runs to max_tokens: more tokens to compare
    return ServerThread(create_app(engine, served, Limits(context=96, max_active=8), speculation=speculation))


def _sample(metrics: str, name: str) -> float | None:
    """The value of the first sample of ``name`` in a Prometheus text page (None: not there)."""
    lines = [line for line in metrics.splitlines() if line.startswith(name)]
    return float(lines[0].split()[-1]) if lines else None


def test_serve_speculation_gives_the_tokens_without_it_for_8_concurrent_streams(tiny_models):
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    from tests import _inproc

    def run(url, prompt):
        r = httpx.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": 24, "temperature": 0,
                                                        "logprobs": 1}, timeout=60)
        assert r.status_code == 200, r.text
        c = r.json()["choices"][0]
        return c["text"], c["logprobs"]["tokens"], c["logprobs"]["token_logprobs"]

    with _inproc.grid(tiny_models["gemma3"], ["0-0", "1-1"]) as g:
        with _serve_app(tiny_models["gemma3"], g["router"].url, sp.Settings(enabled=False)) as off:
            want = [run(off.url, p) for p in SERVE_PROMPTS]
            assert httpx.get(off.url + "/v1/stats").json()["speculation"]["enabled"] is False
        with _serve_app(tiny_models["gemma3"], g["router"].url, sp.Settings(max_k=4)) as on:
            with ThreadPoolExecutor(8) as pool:
                got = list(pool.map(lambda p: run(on.url, p), SERVE_PROMPTS))
            stats = httpx.get(on.url + "/v1/stats").json()
            metrics = wait_metrics(on.url, "larql_serve_step_positions_bucket", until=lambda t: _sample(
                t, "larql_serve_speculative_drafted_tokens_total") == stats["scheduler"]["speculation"]["drafted_tokens"])
    assert [g[:2] for g in got] == [w[:2] for w in want]
    for g_, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g_[2], w[2], atol=1e-4)
    assert stats["speculation"] == {"enabled": True, "drafter": "ngram", "draft": None, "max_k": 4, "ngram": [2, 4],
                                    "adaptive": True, "budget": True}
    spec = stats["scheduler"]["speculation"]
    assert spec["drafted_tokens"] > 0 and 0 < spec["accepted_tokens"] <= spec["drafted_tokens"]
    # accepted drafts are tokens without a step of their own
    generated = stats["scheduler"]["generated_tokens"]
    assert generated == 24 * len(SERVE_PROMPTS)
    assert stats["scheduler"]["steps"] <= generated - spec["accepted_tokens"]
    assert spec["withheld_tokens"] >= 0 and (spec["step_cost_ms"] is None or spec["step_cost_ms"]["per_row"] >= 0)
    for name in ("larql_serve_speculative_drafted_tokens_total", "larql_serve_speculative_accepted_tokens_total",
                 "larql_serve_speculative_withheld_tokens_total", "larql_serve_step_positions_bucket"):
        assert name in metrics, name
    assert _sample(metrics, "larql_serve_speculative_drafted_tokens_total") == spec["drafted_tokens"]


def test_serve_with_a_draft_model_gives_the_tokens_without_speculation(tiny_models):
    """``larql-serve --draft VINDEX``: each sequence drafts from the small model (here the same one, a
    perfect drafter) with a KV cache of its own; 8 concurrent streams give the tokens of plain decoding,
    drafts are mostly kept, and the draft model's time is exported."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    from tests import _inproc

    def run(url, prompt):
        r = httpx.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": 16, "temperature": 0}, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]

    v = tiny_models["gemma3"]
    with _inproc.grid(v, ["0-0", "1-1"]) as g:
        with _serve_app(v, g["router"].url, sp.Settings(enabled=False)) as off:
            want = [run(off.url, p) for p in SERVE_PROMPTS]
        settings = sp.Settings(max_k=4, draft=Transformer.local(v), draft_name=str(v))
        with _serve_app(v, g["router"].url, settings) as on:
            with ThreadPoolExecutor(8) as pool:
                got = list(pool.map(lambda p: run(on.url, p), SERVE_PROMPTS))
            stats = httpx.get(on.url + "/v1/stats").json()
            metrics = wait_metrics(on.url, until=lambda t: (_sample(t, "larql_serve_draft_seconds_count") or 0) > 0)
    assert got == want
    assert stats["speculation"]["drafter"] == "model" and stats["speculation"]["draft"] == str(v)
    spec = stats["scheduler"]["speculation"]
    assert spec["drafted_tokens"] > 0 and spec["accepted_tokens"] >= 0.9 * spec["drafted_tokens"], spec
    assert (_sample(metrics, "larql_serve_draft_seconds_count") or 0) > 0, metrics


@pytest.mark.parametrize("args, message", [
    (["--draft", "VX", "--no-speculate"], "cannot go with --no-speculate"),
    (["--draft", "/nonexistent/draft.vindex"], "--draft: /nonexistent/draft.vindex"),
    (["--draft", "OTHER"], "a draft model must use the same tokenizer"),
])
def test_larql_serve_refuses_a_bad_draft_in_one_line(tiny_models, tmp_path, args, message):
    """larql-serve checks ``--draft`` at start-up (the tokenizer above all), before it listens."""
    from larql_edge.roles.serve.cli import main
    from tests import _inproc
    from tests._cli import run_cli

    other = tmp_path / "other"
    if "OTHER" in args:  # the tiny llama with a vocabulary of its own
        import shutil

        shutil.copytree(tiny_models["llama"], other)
        tok = json.loads((other / "tokenizer.json").read_text())
        tok["model"]["vocab"] = {f"w{k}": i for k, i in tok["model"]["vocab"].items()}
        (other / "tokenizer.json").write_text(json.dumps(tok))
    args = [str(tiny_models["llama"]) if a == "VX" else str(other) if a == "OTHER" else a for a in args]
    with _inproc.grid(tiny_models["gemma3"], ["0-1"]) as g:
        r = run_cli(main, str(tiny_models["gemma3"]), "--ffn", g["router"].url, "--port", "0", *args)
    assert r.returncode != 0
    assert message in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_larql_generate_timings_show_the_draft_models_time(tiny_models, tmp_path):
    from tests._cli import larql

    v = str(tiny_models["gemma3"])
    prompt = "the capital of france is the capital of france is the"
    metrics = tmp_path / "client.prom"
    r = larql("generate", "--vindex", v, "--prompt", prompt, "--max-tokens", "12", "--timings", "--draft", v,
              "--metrics-file", str(metrics))
    assert r.returncode == 0, r.stderr
    assert "+ draft model " in r.stderr, r.stderr
    count = [x for x in metrics.read_text().splitlines() if x.startswith("larql_client_draft_seconds_count")]
    assert count and float(count[0].split()[-1]) > 0, count
    j = larql("generate", "--vindex", v, "--prompt", prompt, "--max-tokens", "12", "--timings", "--json", "--draft", v)
    body = json.loads(j.stdout)
    assert body["speculation"]["draft_seconds"] > 0
    assert sum(t["draft_ms"] for t in body["timings"]["tokens"]) > 0


# -- larql generate's flags (in process, tiny models) --------------------------------------------


def test_larql_generate_speculates_by_default_and_gives_the_tokens_without(tiny_models, monkeypatch):
    import json

    from tests._cli import larql

    v = str(tiny_models["gemma3"])
    prompt = "the capital of france is the capital of france is the"
    on = larql("generate", "--vindex", v, "--prompt", prompt, "--max-tokens", "12", "--json")
    off = larql("generate", "--vindex", v, "--prompt", prompt, "--max-tokens", "12", "--json", "--no-speculate")
    drafted = larql("generate", "--vindex", v, "--prompt", prompt, "--max-tokens", "12", "--json",
                    "--draft", str(tiny_models["llama"]), "--temperature", "0.8", "--seed", "3")
    assert on.returncode == off.returncode == drafted.returncode == 0, on.stderr + off.stderr + drafted.stderr
    a, b = json.loads(on.stdout), json.loads(off.stdout)
    assert a["generated_ids"] == b["generated_ids"] and a["speculation"]["drafter"] == "ngram"
    assert b["speculation"] is None
    assert json.loads(drafted.stdout)["speculation"]["drafter"] == "model"
    monkeypatch.setenv("LARQL_SPECULATE", "false")  # the flag's environment twin
    assert json.loads(larql("generate", "--vindex", v, "--prompt", prompt, "--max-tokens", "2", "--json").stdout
                      )["speculation"] is None


@pytest.mark.parametrize("args, message", [
    (["--spec-k", "0"], "--spec-k must be between 1 and 16"),
    (["--spec-k", "99"], "--spec-k must be between 1 and 16"),
    (["--draft", "VX", "--no-speculate"], "cannot go with --no-speculate"),
    (["--draft", "/nonexistent/draft.vindex"], "--draft: /nonexistent/draft.vindex"),
])
def test_larql_generate_refuses_bad_speculation_flags_in_one_line(tiny_models, args, message):
    from tests._cli import larql

    args = [str(tiny_models["llama"]) if a == "VX" else a for a in args]
    r = larql("generate", "--vindex", str(tiny_models["gemma3"]), "--prompt", "the", "--max-tokens", "2", *args)
    assert r.returncode != 0
    assert message in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_a_draft_vindex_without_ffn_weights_is_refused(tiny_models, tmp_path):
    from tests._cli import larql, slicer

    out = tmp_path / "attn"
    assert slicer("slice", str(tiny_models["llama"]), "-o", str(out), "--preset", "attn").returncode == 0
    r = larql("generate", "--vindex", str(tiny_models["gemma3"]), "--prompt", "the", "--max-tokens", "2",
              "--draft", str(out))
    assert r.returncode != 0 and "--draft" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_serve_sampling_with_speculation_keeps_the_distribution(tiny_models):
    """larql-serve's scheduler (in process, a local engine), temperature and top-p: the second token of
    many seeded 3-token sequences, each one verified as a draft, against sum_t1 p(t1) p(t2 | t1) of
    plain (one token per step) sampling over the same top candidates."""
    import asyncio

    from larql_edge.model.batch import BatchEngine, Chunk, LocalTopK
    from larql_edge.roles.serve.scheduler import Params, Scheduler, Seq

    m = Transformer.local(tiny_models["gemma3"])
    engine = BatchEngine(m.spec, m.attn, m.embedder, m.ffn_provider, LocalTopK(m.head), m.backend)
    vocab = m.spec.vocab_size
    # every token once, shuffled: a unigram match drafts after any first token (a spread-out p1: 9 tokens)
    prompt = [2, *np.random.default_rng(0).permutation(np.arange(4, vocab)).tolist()]
    temperature, top_p = 1.5, 0.9

    def dist(ctx_cache, ids):
        top = engine.step([Chunk(ctx_cache, ids)], vocab)[0]
        assert top is not None
        return sp.dist_from_top(*top, temperature, top_p)

    p1 = dist(engine.new_cache(vocab + 4), prompt)
    p2 = np.zeros(vocab)
    for t1, w in zip(p1.ids.tolist(), p1.probs.tolist(), strict=True):
        if w > 0:
            d = dist(engine.new_cache(vocab + 4), [*prompt, t1])
            p2[d.ids] += w * d.probs

    runs = 1500

    async def run_all() -> tuple[list[list[int]], dict]:
        loop = asyncio.get_running_loop()
        sched = Scheduler(engine, Vindex.open(tiny_models["gemma3"]).load_tokenizer(), context=vocab + 4,
                          max_active=8, max_queue=runs, speculation=sp.Settings(max_k=1, ngram_min=1, budget=False))
        seqs = [Seq(prompt, Params(3, temperature, top_p, seed=i), loop) for i in range(runs)]
        try:
            for s in seqs:
                sched.admit(s)
            for s in seqs:
                while (await s.events.get()).kind == "text":
                    pass
        finally:
            sched.stop()
        return [s.generated for s in seqs], sched.stats()["speculation"]

    outs, stats = asyncio.run(run_all())
    assert all(len(o) == 3 for o in outs)
    # most first tokens are in the prompt (the rest, specials, draft nothing and sample plainly)
    assert stats["drafted_tokens"] > 0.8 * runs and 0.02 * runs < stats["accepted_tokens"] < stats["drafted_tokens"]
    counts = np.bincount([o[1] for o in outs], minlength=vocab)
    ok, stat, crit = _chi_square_ok(counts, p2)
    assert ok, (stat, crit)
    assert not _chi_square_ok(counts, np.bincount(p1.ids, weights=p1.probs, minlength=vocab))[0]


def test_speculation_with_an_embed_server_that_answers_top_k_json_only(tiny_models):
    """LARQL's /v1/logits (top-k JSON per row, no many-rows form): verification asks row by row and
    greedy speculation still gives plain decoding's tokens."""
    from larql_edge.net.remote import RemoteSettings
    from larql_edge.roles.client._build import build_remote
    from tests import _inproc
    from tests._grid import StubEmbed

    v = tiny_models["gemma3"]
    want = list(Transformer.local(v).generate(IDS, 12, stop_ids=[]))
    with StubEmbed(v, larql_logits=True) as stub, _inproc.shard(v, "0-1") as shard:
        remote = build_remote(Vindex.open(v), RemoteSettings(ffn=shard.url, embed=stub.url, logits_top_k=8,
                                                             timeout=20, retries=1))
        remote.head.notice = lambda text: None
        stats = sp.SpecStats()
        assert list(sp.generate(remote, IDS, 12, stop_ids=[], stats=stats)) == want
        assert remote.head.mode == "top-k JSON" and stats.drafted > 0
        assert not any("rows=" in r for r in stub.requests)  # never asked for a form it lacks
