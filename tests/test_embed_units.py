"""Unit tests of the embed server's parts: wire codec, hot cache, top-k, batcher, HTTP helpers, CLI config."""

from __future__ import annotations

import asyncio
import os
import struct
import threading
from types import SimpleNamespace

import numpy as np
import pytest

from larql_edge.errors import BadRequest, NotAcceptable, PayloadTooLarge
from larql_edge.roles.embed import requests as rq
from larql_edge.roles.embed.batcher import LogitsBatcher
from larql_edge.roles.embed.caching import CACHE_CONTROL, cache_headers, none_match
from larql_edge.roles.embed.head import log_normaliser, top_k_ids
from larql_edge.roles.embed.store import EmbeddingStore, HotCache
from larql_edge.service import Compute
from larql_edge.wire import WireError
from larql_edge.wire import embed as wire

# -- wire -------------------------------------------------------------------------------------------


def test_embed_request_roundtrip_and_layout():
    body = wire.encode_embed_request([1, 5432, 235])
    assert body == struct.pack("<4I", 3, 1, 5432, 235)
    assert wire.decode_embed_request(body).tolist() == [1, 5432, 235]


@pytest.mark.parametrize(
    "body",
    [b"", b"\x01\x00", struct.pack("<I", 2) + struct.pack("<I", 7), struct.pack("<II", 1, 7) + b"\x00", struct.pack("<III", 1, 2, 3)],
    ids=["empty", "short-header", "truncated", "odd-length", "extra"],
)
def test_embed_request_malformed(body):
    with pytest.raises(WireError):
        wire.decode_embed_request(body)


def test_embed_response_roundtrip():
    rows = np.arange(12, dtype=np.float32).reshape(3, 4)
    body = wire.encode_embed_response(rows)
    assert body[:8] == struct.pack("<II", 3, 4)
    np.testing.assert_array_equal(wire.decode_embed_response(body), rows)
    parts = [r.tobytes() for r in rows]
    assert wire.encode_embed_response_parts(3, 4, parts) == body
    with pytest.raises(WireError):
        wire.decode_embed_response(body[:-4])


def test_logits_codec():
    x = np.linspace(-1, 1, 8, dtype=np.float32)
    np.testing.assert_array_equal(wire.decode_logits_request(wire.encode_logits_request(x), 8), x)
    with pytest.raises(WireError):
        wire.decode_logits_request(x.tobytes(), 9)
    with pytest.raises(WireError):
        wire.decode_logits_request(x.tobytes()[:-1], 8)
    np.testing.assert_array_equal(wire.decode_logits_response(wire.encode_logits_response(x), 8), x)
    np.testing.assert_array_equal(wire.decode_row(wire.encode_row(x), 8), x)


# -- store and hot cache ------------------------------------------------------------------------------


def test_store_decodes_f16_rows_scaled_without_copying_the_table():
    rng = np.random.default_rng(0)
    table = rng.standard_normal((100, 8)).astype(np.float16)
    store = EmbeddingStore(table, scale=2.5, hot_capacity=10)
    assert np.shares_memory(store.table, table) and store.table.dtype == np.float16  # never an f32 copy
    want = table.astype(np.float32) * np.float32(2.5)
    np.testing.assert_array_equal(store.row(7), want[7])
    ids = np.array([3, 7, 3, 99])
    np.testing.assert_array_equal(store.rows(ids), want[ids])
    long_ids = np.arange(40) % 100  # above the vectorised threshold
    np.testing.assert_array_equal(store.rows(long_ids), want[long_ids])
    assert store.storage_dtype == "f16"


def test_hot_cache_fills_then_keeps_most_used():
    c = HotCache(vocab=1000, capacity=4, min_period=20)
    for i in range(10):  # warm-up: the first 4 distinct ids are admitted
        if c.get(i) is None:
            c.admit(i, b"x")
    assert sorted(c.entries) == [0, 1, 2, 3]
    # ids 500..503 become the most used; after the recompute they replace the cold ones
    for _ in range(5):
        for i in (500, 501, 502, 503):
            if c.get(i) is None:
                c.admit(i, b"y")
    assert c.wanted is not None
    for i in (500, 501, 502, 503):
        if c.get(i) is None:
            c.admit(i, b"y")
    assert sorted(c.entries) == [500, 501, 502, 503]
    assert c.evictions == 4
    assert c.hits + c.misses == 10 + 20 + 4
    s = c.stats()
    assert s["capacity"] == 4 and s["size"] == 4 and 0 < s["hit_rate"] < 1


def test_hot_cache_disabled():
    store = EmbeddingStore(np.ones((5, 2), np.float16), 1.0, hot_capacity=0)
    store.row(1)
    store.row(1)
    assert store.cache.stats()["size"] == 0 and store.cache.misses == 2


# -- head post-processing --------------------------------------------------------------------------


@pytest.mark.parametrize("n,k", [(10, 3), (5000, 10), (262_144, 5), (262_144, 1000), (1000, 1000)])
def test_top_k_ids_equals_full_sort(n, k):
    row = np.random.default_rng(n + k).standard_normal(n).astype(np.float32) * 10
    want = np.argsort(-row, kind="stable")[: min(k, n)]
    np.testing.assert_array_equal(top_k_ids(row, k), want)


def test_log_normaliser():
    row = np.array([1000.0, 999.0, -5.0], dtype=np.float32)
    want = 1000 + np.log(1 + np.exp(-1) + np.exp(-1005))
    assert abs(log_normaliser(row) - want) < 1e-5


# -- batcher ------------------------------------------------------------------------------------------


def test_batcher_stacks_concurrent_requests():
    w = np.random.default_rng(1).standard_normal((50, 8)).astype(np.float32)
    calls = []

    def compute(x):
        calls.append(x.shape[0])
        return x @ w.T

    async def go():
        ex = Compute(1)
        seen = []
        b = LogitsBatcher(compute, ex, max_batch=8, max_wait=0.05, on_batch=lambda n, s: seen.append(n))
        xs = [np.full(8, i, np.float32) for i in range(20)]
        outs = await asyncio.gather(*(b.submit(x, lambda row: row.copy()) for x in xs))
        ex.shutdown()
        return xs, outs, seen, b.stats()

    xs, outs, seen, stats = asyncio.run(go())
    for x, y in zip(xs, outs, strict=True):
        np.testing.assert_allclose(y, w @ x, rtol=1e-5, atol=1e-5)
    assert sum(calls) == 20 and max(calls) == 8 and len(calls) == 3  # 8 + 8 + 4
    assert seen == calls and stats["rows"] == 20 and stats["largest_batch"] == 8


def test_batcher_without_wait_starts_at_once_and_stacks_what_arrives_meanwhile():
    """The default (--batch-wait-ms 0): a lone request is computed at once (no wait for company);
    requests arriving while a product runs form the next product together."""
    gate = threading.Event()
    calls = []

    def compute(x):
        calls.append(x.shape[0])
        if len(calls) == 1:
            gate.wait(5)  # the first product runs until every other request has queued
        return x * 2

    async def go():
        ex = Compute(1)
        b = LogitsBatcher(compute, ex, max_batch=64)  # max_wait defaults to 0
        # two rows: off the loop (a lone one-row batch would be computed in the loop: INLINE_ROWS)
        first = asyncio.ensure_future(b.submit_rows(np.ones((2, 2), np.float32), lambda r: r[0].copy()))
        for _ in range(100):
            if calls:
                break
            await asyncio.sleep(0.01)
        assert calls == [2]  # started alone, without waiting for company
        rest = [asyncio.ensure_future(b.submit(np.full(2, i, np.float32), lambda r: r.copy())) for i in range(5)]
        await asyncio.sleep(0.05)
        gate.set()
        outs = await asyncio.gather(first, *rest)
        ex.shutdown()
        return outs

    outs = asyncio.run(go())
    assert calls == [2, 5]  # the five that came during the first product: one product
    np.testing.assert_array_equal(outs[3], np.full(2, 4, np.float32))


def test_blas_threads_cap_the_kernel_threads(monkeypatch):
    """--blas-threads N caps the compact kernels too (one pool), unless LARQL_KERNEL_THREADS says otherwise."""
    from larql_edge.config import BLAS_ENV
    from larql_edge.model.kernels import get_threads, set_threads
    from larql_edge.service.serving import pin_blas

    before = get_threads()
    for var in (*BLAS_ENV, "LARQL_KERNEL_THREADS"):
        monkeypatch.setenv(var, "x")  # restored by monkeypatch whatever pin_blas writes
        monkeypatch.delenv(var)
    try:
        set_threads(2)
        pin_blas(1)
        assert get_threads() == 1 and os.environ["LARQL_KERNEL_THREADS"] == "1"
        monkeypatch.setenv("LARQL_KERNEL_THREADS", "2")
        set_threads(2)
        pin_blas(1)
        assert get_threads() == 2  # the explicit kernel count wins
    finally:
        set_threads(before)


def test_batcher_isolates_a_failing_post():
    async def go():
        ex = Compute(1)
        b = LogitsBatcher(lambda x: x * 2, ex, max_wait=0.01)

        def bad(row):
            raise ValueError("boom")

        r = await asyncio.gather(b.submit(np.ones(2, np.float32), lambda r: r.sum()), b.submit(np.ones(2, np.float32), bad),
                                 return_exceptions=True)
        ex.shutdown()
        return r

    good, bad = asyncio.run(go())
    assert good == 4.0 and isinstance(bad, ValueError)


def test_batcher_does_not_block_the_loop():
    gate = threading.Event()

    def slow(x):
        gate.wait(5)
        return x

    async def go():
        ex = Compute(1)
        b = LogitsBatcher(slow, ex, max_wait=0)
        task = asyncio.ensure_future(b.submit_rows(np.ones((2, 2), np.float32), lambda r: "done"))
        await asyncio.sleep(0.05)
        assert not task.done()  # the product is still running, yet this coroutine runs
        gate.set()
        out = await task
        ex.shutdown()
        return out

    assert asyncio.run(go()) == "done"


def test_a_lone_row_is_computed_in_the_loop_and_company_goes_to_the_compute_thread():
    """INLINE_ROWS: one row with the compute thread idle is computed in the event loop's thread (no
    hand-off); rows that arrive together still form one product, in the compute thread."""
    where: list[tuple[int, str]] = []

    def compute(x):
        where.append((x.shape[0], threading.current_thread().name))
        return x * 2

    async def go():
        ex = Compute(1, name="compute")
        b = LogitsBatcher(compute, ex, max_wait=0)
        one = await b.submit(np.ones(2, np.float32), lambda r: r.copy())
        many = await asyncio.gather(*(b.submit(np.full(2, i, np.float32), lambda r: r.copy()) for i in range(3)))
        ex.shutdown()
        return one, many

    one, many = asyncio.run(go())
    loop_thread = threading.current_thread().name  # asyncio.run runs the loop in this thread
    assert where[0] == (1, loop_thread)
    assert where[1][0] == 3 and where[1][1].startswith("compute")  # the three together, off the loop
    np.testing.assert_array_equal(one, np.full(2, 2, np.float32))
    assert [float(m[0]) for m in many] == [0.0, 2.0, 4.0]


# -- HTTP helpers -----------------------------------------------------------------------------------


def _req(headers: dict) -> SimpleNamespace:
    from sanic.headers import parse_accept

    h = {k.lower(): v for k, v in headers.items()}
    return SimpleNamespace(headers=h, accept=parse_accept(h.get("accept") or "*/*"))


@pytest.mark.parametrize(
    "accept,default_binary,want",
    [
        (None, True, True),
        ("*/*", True, True),
        ("application/json", True, False),
        ("application/json, */*;q=0.1", True, False),
        ("application/x-larql-ffn", False, True),
        (None, False, False),
        ("application/*", False, False),
        ("application/json;q=0.5, application/x-larql-ffn", False, True),
        ("text/html,application/xhtml+xml,*/*;q=0.8", True, True),
    ],
)
def test_accept_negotiation(accept, default_binary, want):
    headers = {"accept": accept} if accept else {}
    assert rq.wants_binary(_req(headers), default_binary) is want


def test_accept_nothing_acceptable():
    with pytest.raises(NotAcceptable):
        rq.wants_binary(_req({"accept": "text/html"}), True)


def test_if_none_match_forms():
    tag = '"abc-1-bin"'
    assert none_match('"abc-1-bin"', tag)
    assert none_match('"zzz", "abc-1-bin"', tag)
    assert none_match('W/"abc-1-bin"', tag)  # weak comparison for If-None-Match
    assert none_match("*", tag)
    assert not none_match('"abc-1-json"', tag)
    assert not none_match(None, tag)
    assert not none_match("abc-1-bin", tag)  # unquoted is not an entity tag
    h = cache_headers(tag, vary_model=False)
    assert h == {"ETag": tag, "Cache-Control": CACHE_CONTROL, "Vary": "Accept"}
    assert cache_headers(tag, vary_model=True)["Vary"] == "Accept, X-Model-Id"


def test_value_validation():
    assert rq.path_id("9515") == 9515
    for bad in ("-1", "1.5", "abc", " 1", "", "1e3", "99999999999"):
        with pytest.raises(BadRequest):
            rq.path_id(bad)
    assert rq.json_ids([1, 2.0]).tolist() == [1, 2]  # JSON Schema's integer: 2 and 2.0 alike
    with pytest.raises(BadRequest):
        rq.json_ids([1, 2.5])
    with pytest.raises(BadRequest):
        rq.json_ids([True])
    with pytest.raises(BadRequest):
        rq.json_ids("1,2")
    with pytest.raises(BadRequest):
        rq.check_ids(np.array([], np.int64), 10, 5)
    with pytest.raises(PayloadTooLarge):
        rq.check_ids(np.arange(6), 10, 5)
    with pytest.raises(BadRequest):
        rq.check_ids(np.array([10]), 10, 5)
    with pytest.raises(BadRequest):
        rq.residual([1.0, float("nan")], 2)
    with pytest.raises(BadRequest):
        rq.residual([1.0, 1e39], 2)  # beyond float32: becomes inf
    with pytest.raises(BadRequest):
        rq.residual([1.0, "2"], 2)
    with pytest.raises(BadRequest):
        rq.residual([[1.0, 2.0]], 2)
    assert rq.temperature_param(None) == 1.0 and rq.temperature_param(0) == 0.0
    for bad in (-0.1, float("nan"), float("inf"), "x", True, [1]):
        with pytest.raises(BadRequest):
            rq.temperature_param(bad)
    assert rq.int_param("7", "top_k", 5, 1, 10) == 7
    for bad in (0, 11, -1, 2.5, "1.5", True):
        with pytest.raises(BadRequest):
            rq.int_param(bad, "top_k", 5, 1, 10)


# -- CLI configuration ----------------------------------------------------------------------------------


def test_every_flag_has_an_env_twin(monkeypatch, tiny_models):
    from larql_edge.roles.embed.cli import _sources, build_parser, config_from_args

    monkeypatch.setenv("LARQL_HOT_CACHE", "123")
    monkeypatch.setenv("LARQL_BATCH_WAIT_MS", "7.5")
    monkeypatch.setenv("LARQL_MAX_TOP_K", "42")
    monkeypatch.setenv("LARQL_BLAS_THREADS", "1")
    monkeypatch.setenv("LARQL_EMBED_ONLY", "true")
    parser = build_parser()
    for action in parser._actions:
        if action.option_strings and action.dest != "help":
            assert "[env LARQL_" in action.help, action.option_strings
    args = parser.parse_args([f"tiny={tiny_models['llama']}", str(tiny_models["gemma3"])])
    cfg = config_from_args(args, _sources(args.vindex))
    assert cfg.hot_cache == 123 and cfg.limits.batch_wait_ms == 7.5 and cfg.limits.max_top_k == 42
    assert cfg.blas_threads == 1 and cfg.embed_only
    assert [m.id for m in cfg.models] == ["tiny", "gemma3-hf"]  # index.json "model" of the tiny Gemma


def test_no_writable_temporary_folder_is_one_line(monkeypatch, tiny_models, capsys):
    """`docker run --read-only larql-embed`: the metrics folder cannot be made; say what to mount."""
    import tempfile

    from larql_edge.roles.embed.cli import main

    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    monkeypatch.setattr(tempfile, "tempdir", "/nonexistent-read-only")
    assert main([str(tiny_models["gemma3"]), "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--tmpfs /tmp" in err and "Traceback" not in err


# -- the reusable metrics helper ------------------------------------------------------------------------


def test_metrics_helper_in_process():
    from larql_edge.service.metrics import Metrics

    m = Metrics("unit_role")
    m.observe_request("/v1/x", "GET", 200, 20e-6, None)
    m.observe_request("/v1/x", "GET", 200, 0.3, None)
    m.observe_request("/v1/x", "POST", 404, 0.001, "not_found")
    t = m.render().decode()
    assert 'larql_unit_role_requests_total{method="GET",route="/v1/x",status="200"} 2.0' in t
    assert 'larql_unit_role_errors_total{route="/v1/x",type="not_found"} 1.0' in t
    assert 'larql_unit_role_request_duration_seconds_bucket{le="2.5e-05",route="/v1/x"} 1.0' in t
    assert 'larql_unit_role_request_duration_seconds_bucket{le="0.5",route="/v1/x"} 3.0' in t
    assert 'larql_unit_role_request_duration_seconds_count{route="/v1/x"} 3.0' in t


_MP_WRITER = """
import os, sys
from larql_edge.service.metrics import Metrics
m = Metrics("mp_role")
for _ in range(int(sys.argv[1])):
    m.observe_request("/r", "GET", 200, 0.002, None)
m.counter("widgets", "widgets made").inc(2)
m.flush()
"""
_MP_READER = """
from larql_edge.service.metrics import Metrics
print(Metrics("mp_role").render().decode())
"""


@pytest.mark.multiprocess
def test_metrics_helper_adds_up_processes(tmp_path):
    """Prometheus multiprocess mode: what each process wrote, any process renders, summed."""
    import subprocess
    import sys

    env = {**__import__("os").environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    for n in (3, 4):
        subprocess.run([sys.executable, "-c", _MP_WRITER, str(n)], env=env, check=True, timeout=60)
    out = subprocess.run([sys.executable, "-c", _MP_READER], env=env, check=True, timeout=60, capture_output=True, text=True).stdout
    assert 'larql_mp_role_requests_total{method="GET",route="/r",status="200"} 7.0' in out
    assert 'larql_mp_role_request_duration_seconds_count{route="/r"} 7.0' in out
    assert "larql_mp_role_widgets_total 4.0" in out
