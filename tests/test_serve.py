"""larql-serve, fast tier: the OpenAI routes in front of an in-process grid (router, two FFN shards, embed
server: real HTTP in threads) on a tiny Gemma 3, and the batch engine's exactness and request counts."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest

from larql_edge.format.vindex import Vindex
from larql_edge.model.batch import Chunk
from larql_edge.net.remote import RemoteSettings
from larql_edge.roles.serve.app import Limits, create_app, remote_engine, served_model
from larql_edge.roles.serve.chat import ChatTemplate
from larql_edge.testing.servers import ServerThread
from tests import _inproc
from tests._grid import wait_metrics

PROMPTS = [[1, 5, 9], [2, 3], [7, 8, 9, 10, 11, 12], [4], [13, 14, 15, 16], [6, 6, 6, 6, 6, 6, 6, 6, 6], [20, 21], [30]]
TEMPLATE = ("{{ bos_token }}{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")


@pytest.fixture(scope="module")
def grid(tiny_models):
    with _inproc.grid(tiny_models["gemma3"], ["0-0", "1-1"]) as g:
        yield g


def _serve(vx_path: Path, router_url: str, limits: Limits, chat: bool = False, eos: bool = True) -> ServerThread:
    vx = Vindex.open(vx_path)
    engine = remote_engine(vx, RemoteSettings(ffn=router_url, timeout=30, retries=1))
    served = served_model(vx, vx.load_tokenizer(), limits.context, None)
    if chat:
        served.chat_template = ChatTemplate(TEMPLATE, "<bos>", "<eos>", origin="test")
    if not eos:  # sequences that run until max_tokens: they hold their slots as long as a test needs
        served.eos_ids = ()
    return ServerThread(create_app(engine, served, limits))


@pytest.fixture(scope="module")
def serve(tiny_models, grid):
    with _serve(tiny_models["gemma3"], grid["router"].url, Limits(context=64), chat=True) as s:
        yield s


def _complete(url: str, **body) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json={"temperature": 0, **body}, timeout=60)


def _error(r: httpx.Response, status: int, param: str | None = None, code: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err


def test_models_and_a_greedy_completion_with_usage_and_logprobs(serve):
    models = httpx.get(serve.url + "/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == "gemma3-hf"
    r = _complete(serve.url, prompt=[1, 5, 9], max_tokens=6, logprobs=2)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion" and body["model"] == "gemma3-hf"
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 6, "total_tokens": 9,
                             "prompt_tokens_details": {"cached_tokens": 0}}
    choice = body["choices"][0]
    assert choice["finish_reason"] == "length"
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == 6 and all(v <= 0 for v in lp["token_logprobs"])
    assert all(len(t) <= 2 for t in lp["top_logprobs"])
    # greedy: the chosen token is the most likely one
    assert all(abs(max(t.values()) - v) < 1e-6 for t, v in zip(lp["top_logprobs"], lp["token_logprobs"], strict=True))


def test_the_stream_is_sse_chunks_ending_with_done_that_join_to_the_whole_text(serve):
    whole = _complete(serve.url, prompt="a b c", max_tokens=8).json()
    with httpx.stream("POST", serve.url + "/v1/completions", timeout=60,
                      json={"prompt": "a b c", "max_tokens": 8, "temperature": 0, "stream": True,
                            "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = [e for e in raw.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert text == whole["choices"][0]["text"]
    finals = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert finals == ["length"]
    assert chunks[-1]["usage"] == whole["usage"]


def test_chat_with_a_template_streams_and_not(serve):
    msgs = [{"role": "user", "content": "hi"}]
    r = httpx.post(serve.url + "/v1/chat/completions", json={"messages": msgs, "max_tokens": 5, "temperature": 0}, timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion" and body["choices"][0]["message"]["role"] == "assistant"
    with httpx.stream("POST", serve.url + "/v1/chat/completions", timeout=60,
                      json={"messages": msgs, "max_tokens": 5, "temperature": 0, "stream": True}) as s:
        raw = s.read().decode()
    chunks = [json.loads(e[6:]) for e in raw.split("\n\n") if e and e != "data: [DONE]"]
    assert raw.rstrip().endswith("data: [DONE]")
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == body["choices"][0]["message"]["content"]
    assert body["usage"]["prompt_tokens"] > 3


def test_no_chat_template_is_a_400(tiny_models, grid):
    with _serve(tiny_models["gemma3"], grid["router"].url, Limits(context=64)) as s:
        r = httpx.post(s.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
        _error(r, 400, "messages", "no_chat_template")


@pytest.mark.parametrize("body,status,param,code", [
    ({"prompt": "a", "model": "gpt-4"}, 404, "model", "model_not_found"),
    ({"prompt": [1] * 64}, 400, "prompt", "context_length_exceeded"),
    ({"prompt": "a", "temperature": 3}, 400, "temperature", None),
    ({"prompt": "a", "temperature": "hot"}, 400, "temperature", None),
    ({"prompt": "a", "top_p": -0.1}, 400, "top_p", None),
    ({"prompt": "a", "max_tokens": 0}, 400, "max_tokens", None),
    ({"prompt": "a", "max_tokens": True}, 400, "max_tokens", None),
    ({"prompt": "a", "n": 9}, 400, "n", None),
    ({"prompt": "a", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop", None),
    ({"prompt": "a", "stop": 5}, 400, "stop", None),
    ({"prompt": "a", "logprobs": 9}, 400, "logprobs", None),
    ({"prompt": "a", "seed": 1.5}, 400, "seed", None),
    ({"prompt": [1, 99999]}, 400, "prompt", None),
    ({"prompt": ""}, 400, "prompt", None),
    ({}, 400, "prompt", "missing_required_parameter"),
    ({"prompt": {"x": 1}}, 400, "prompt", None),
])
def test_bad_inputs_are_openai_errors(serve, body, status, param, code):
    _error(httpx.post(serve.url + "/v1/completions", json=body, timeout=30), status, param, code)


def test_malformed_bodies_and_routes_are_openai_errors_and_the_server_keeps_serving(serve):
    _error(httpx.post(serve.url + "/v1/completions", content=b"{bad", headers={"content-type": "application/json"}), 400)
    _error(httpx.post(serve.url + "/v1/completions", content=b"[1]", headers={"content-type": "application/json"}), 400)
    _error(httpx.post(serve.url + "/v1/completions", content=b"x", headers={"content-type": "text/plain"}), 415)
    _error(httpx.get(serve.url + "/v1/nothing"), 404)
    _error(httpx.post(serve.url + "/v1/chat/completions", json={"messages": "hi"}), 400, "messages")
    _error(httpx.post(serve.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": 3}]}), 400)
    assert _complete(serve.url, prompt="a", max_tokens=2).status_code == 200


def test_stop_strings_end_the_text_before_them(serve):
    free = _complete(serve.url, prompt=[3, 4], max_tokens=12).json()["choices"][0]["text"]
    if len(free) < 3:
        pytest.skip("platform: the tiny model's greedy text is too short to cut")  # not expected with seed 1
    stop = free[len(free) // 2 : len(free) // 2 + 2]
    cut = _complete(serve.url, prompt=[3, 4], max_tokens=12, stop=[stop]).json()["choices"][0]
    assert cut["finish_reason"] == "stop"
    assert cut["text"] == free[: free.index(stop)]


def test_batched_sequences_give_the_tokens_each_gives_alone_and_one_ffn_request_per_layer_per_step(tiny_models, grid):
    vx = Vindex.open(tiny_models["gemma3"])
    engine = remote_engine(vx, RemoteSettings(ffn=grid["router"].url, timeout=30, retries=1))
    layers = engine.spec.num_layers
    steps = 6

    def alone(prompt):
        c = engine.new_cache(64)
        out = []
        top = engine.step([Chunk(c, prompt)], 8)[0]
        for _ in range(steps):
            assert top is not None
            out.append(int(top[0][0]))
            top = engine.step([Chunk(c, [out[-1]])], 8)[0]
        return out

    want = [alone(p) for p in PROMPTS]
    # All eight together; the later half joins two steps late (continuous batching), with its prefill
    # in the same step as the others' decoding.
    caches = [engine.new_cache(64) for _ in PROMPTS]
    got: list[list[int]] = [[] for _ in PROMPTS]
    joined = set(range(4))
    pending = {i: list(p) for i, p in enumerate(PROMPTS)}
    calls_per_step = []
    for step in range(steps + 2):
        if step == 2:
            joined |= set(range(4, 8))
        chunks, who = [], []
        for i in sorted(joined):
            if len(got[i]) >= steps:
                continue
            ids = pending.pop(i) if i in pending else [got[i][-1]]
            chunks.append(Chunk(caches[i], ids))
            who.append(i)
        if not chunks:
            break
        before = engine.ffn.calls
        for i, top in zip(who, engine.step(chunks, 8), strict=True):
            got[i].append(int(top[0][0]))
        calls_per_step.append(engine.ffn.calls - before)
    assert got == want
    assert set(calls_per_step) == {layers}, calls_per_step  # one FFN request per layer, whatever the rows


@pytest.mark.slow  # tens of seconds in-process (tests/conftest.py: the tiers)
def test_eight_concurrent_http_completions_equal_each_alone(tiny_models, grid):
    with _serve(tiny_models["gemma3"], grid["router"].url, Limits(context=64, max_active=8)) as s:
        def run(p):
            r = _complete(s.url, prompt=p, max_tokens=5 + len(p) % 3, logprobs=1)
            assert r.status_code == 200, r.text
            c = r.json()["choices"][0]
            return c["text"], c["logprobs"]["tokens"]

        alone = [run(p) for p in PROMPTS]
        steps_before = httpx.get(s.url + "/v1/stats").json()["scheduler"]["steps"]
        with ThreadPoolExecutor(8) as pool:
            together = list(pool.map(run, PROMPTS))
        stats = httpx.get(s.url + "/v1/stats").json()["scheduler"]
        assert together == alone
        # batched: far fewer steps than the tokens generated
        assert stats["steps"] - steps_before < sum(5 + len(p) % 3 + 1 for p in PROMPTS)


def test_beyond_the_admission_limits_429_with_retry_after_and_a_disconnect_frees_the_slot(tiny_models, grid):
    with _serve(tiny_models["gemma3"], grid["router"].url, Limits(context=4096, max_active=1, max_queue=1),
                eos=False) as s:
        first_chunk = threading.Event()

        def long_stream():
            with httpx.stream("POST", s.url + "/v1/completions", timeout=60,
                              json={"prompt": "a", "max_tokens": 4000, "stream": True}) as r:
                for _ in r.iter_bytes():
                    first_chunk.set()
                    break  # the client goes away mid-stream

        t = threading.Thread(target=long_stream)
        t.start()
        assert first_chunk.wait(30)
        queued = threading.Thread(target=lambda: _complete(s.url, prompt="b", max_tokens=2))
        # the slot is held and one more may queue; the next is refused
        stats = httpx.get(s.url + "/v1/stats").json()
        assert stats["limits"]["max_active"] == 1 and stats["limits"]["max_queue"] == 1
        t.join(10)
        assert httpx.get(s.url + "/v1/stats").json()["scheduler"]["generated_tokens"] < 3000  # still running when cut
        deadline = time.monotonic() + 10
        while httpx.get(s.url + "/v1/stats").json()["active"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert httpx.get(s.url + "/v1/stats").json()["active"] == 0  # the departed client's slot is free
        queued.start()
        queued.join(30)

        # fill: one active and one queued (streams held open by threads), then 429
        release = threading.Event()

        def hold():
            with httpx.stream("POST", s.url + "/v1/completions", timeout=60,
                              json={"prompt": "a", "max_tokens": 4000, "stream": True}) as r:
                for _ in r.iter_bytes():
                    if release.wait(0.01):
                        return

        holders = [threading.Thread(target=hold) for _ in range(2)]
        for h in holders:
            h.start()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            stats = httpx.get(s.url + "/v1/stats").json()
            if (stats["active"], stats["queued"]) == (1, 1):
                break
            time.sleep(0.02)
        assert (stats["active"], stats["queued"]) == (1, 1), stats
        r = _complete(s.url, prompt="c", max_tokens=2)
        err = _error(r, 429, code="rate_limit_exceeded")
        assert err["type"] == "rate_limit_error" and int(r.headers["retry-after"]) >= 1
        release.set()
        for h in holders:
            h.join(30)
        deadline = time.monotonic() + 10
        while sum(httpx.get(s.url + "/v1/stats").json()[k] for k in ("active", "queued")) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _complete(s.url, prompt="c", max_tokens=2).status_code == 200


def test_metrics_export_the_serve_series(serve):
    _complete(serve.url, prompt="a b", max_tokens=3)
    names = ("larql_serve_active_sequences", "larql_serve_queued_sequences",
             "larql_serve_time_to_first_token_seconds_bucket", "larql_serve_inter_token_latency_seconds_bucket",
             "larql_serve_generated_tokens_total", "larql_serve_prompt_tokens_total", "larql_serve_requests_total",
             "larql_serve_request_duration_seconds_bucket", "larql_serve_resident_memory_bytes",
             "larql_serve_inflight")
    text = wait_metrics(serve.url, *names)
    for name in names:
        assert name in text, name


def test_the_openapi_document_is_served_and_committed(serve):
    from larql_edge.roles.serve.openapi import openapi_spec

    committed = json.loads((Path(__file__).resolve().parents[1] / "openapi" / "serve.json").read_text())
    assert httpx.get(serve.url + "/openapi.json").json() == committed == openapi_spec(), \
        "regenerate: python -m larql_edge.roles.serve.openapi > openapi/serve.json"
    documented = {(m.upper(), p) for p, ops in committed["paths"].items() for m in ops}
    import re

    routes = {(m, "/" + re.sub(r"<(\w+)(:[^>]*)?>", r"{\1}", r.path.lstrip("/"))) for r in serve.app.router.routes
              for m in r.methods if m != "HEAD"}
    assert routes <= documented | {("OPTIONS", p) for _, p in routes}, routes - documented


@pytest.mark.slow  # tens of seconds in-process (tests/conftest.py: the tiers)
def test_many_rows_logits_are_the_single_rows_in_one_product(grid):
    from larql_edge.wire import embed as ew

    stats = httpx.get(grid["embed"].url + "/v1/stats").json()
    hidden = int(stats["hidden_size"])
    x = np.random.default_rng(3).standard_normal((5, hidden)).astype(np.float32)
    singles = [httpx.post(grid["router"].url + "/v1/logits", json={"residual": r.tolist(), "top_k": 4}).json()["top_k"]
               for r in x]
    many = httpx.post(grid["router"].url + "/v1/logits", json={"residuals": x.tolist(), "top_k": 4}).json()["rows"]
    binary = httpx.post(grid["router"].url + "/v1/logits?rows=5&top_k=4", content=ew.encode_logits_rows_request(x),
                        headers={"content-type": "application/x-larql-ffn"}).json()["rows"]
    ids = lambda rows: [[t["token_id"] for t in row] for row in rows]  # noqa: E731
    assert ids(many) == ids(singles) == ids(binary)
    # one lm_head product for all the rows of a request
    before = httpx.get(grid["embed"].url + "/v1/stats").json()["logits_batching"]
    httpx.post(grid["embed"].url + "/v1/logits", json={"residuals": x.tolist(), "top_k": 1}).raise_for_status()
    after = httpx.get(grid["embed"].url + "/v1/stats").json()["logits_batching"]
    assert (after["batches"] - before["batches"], after["rows"] - before["rows"]) == (1, 5)
    raw = httpx.post(grid["embed"].url + "/v1/logits?rows=5", content=ew.encode_logits_rows_request(x),
                     headers={"content-type": "application/x-larql-ffn", "accept": "application/x-larql-ffn"})
    assert raw.status_code == 200 and len(raw.content) == 5 * int(stats["vocab_size"]) * 4
    assert httpx.post(grid["embed"].url + "/v1/logits?rows=4", content=ew.encode_logits_rows_request(x),
                      headers={"content-type": "application/x-larql-ffn"}).status_code == 400
    assert httpx.post(grid["embed"].url + "/v1/logits", json={"residuals": []}).status_code == 400
    assert httpx.post(grid["embed"].url + "/v1/logits", json={"residuals": [[0.0] * (hidden + 1)]}).status_code == 400


def test_the_remote_head_splits_more_rows_than_the_embed_servers_batch(tiny_models, grid):
    vx = Vindex.open(tiny_models["gemma3"])
    engine = remote_engine(vx, RemoteSettings(ffn=grid["router"].url, timeout=30, retries=1))
    x = np.random.default_rng(5).standard_normal((70, engine.spec.hidden_size)).astype(np.float32)
    many = engine.head.top_k_rows(x, 3)
    assert len(many) == 70
    for i in (0, 63, 64, 69):
        one = engine.head.top_k_rows(x[i : i + 1], 3)[0]
        assert list(one[0]) == list(many[i][0])


def test_chat_template_from_the_vindex_the_override_and_a_template_that_raises(tmp_path):
    from larql_edge.errors import BadRequest
    from larql_edge.roles.serve.chat import eos_from_generation_config, load_chat_template

    assert load_chat_template(tmp_path, None) is None  # no tokenizer_config.json: no chat
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": TEMPLATE, "bos_token": {"content": "<s>"}, "eos_token": "</s>"}))
    t = load_chat_template(tmp_path, None)
    assert t is not None
    assert t.render([{"role": "user", "content": "hi"}]) == "<s><user>hi\n<assistant>"
    assert t.render([{"role": "user", "content": "hi"}], add_generation_prompt=False) == "<s><user>hi\n"
    override = tmp_path / "t.jinja"
    override.write_text("{% if messages[0]['role'] != 'system' %}{{ raise_exception('system first') }}{% endif %}"
                        "{{ eos_token }}")
    t2 = load_chat_template(tmp_path, str(override))
    assert t2 is not None and t2.render([{"role": "system", "content": ""}]) == "</s>"
    with pytest.raises(BadRequest, match="system first"):
        t2.render([{"role": "user", "content": "x"}])
    # the sandbox: no attribute escapes to Python internals
    (tmp_path / "evil.jinja").write_text("{{ messages.__class__.__mro__ }}")
    with pytest.raises(BadRequest):
        load_chat_template(tmp_path, str(tmp_path / "evil.jinja")).render([{"role": "user", "content": "x"}])
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 106]}))
    assert eos_from_generation_config(tmp_path) == (1, 106)


def test_sampling_with_a_seed_is_reproducible_and_top_p_narrows_it(serve):
    body = {"prompt": [1, 2, 3], "max_tokens": 12, "temperature": 1.5, "seed": 7, "logprobs": 1}
    a = httpx.post(serve.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]
    b = httpx.post(serve.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]
    assert a["logprobs"]["tokens"] == b["logprobs"]["tokens"]
    # top_p that keeps only the most likely candidate is greedy
    narrow = httpx.post(serve.url + "/v1/completions", timeout=60,
                        json=body | {"top_p": 1e-6, "seed": 3}).json()["choices"][0]["logprobs"]["tokens"]
    greedy = _complete(serve.url, prompt=[1, 2, 3], max_tokens=12, logprobs=1).json()["choices"][0]["logprobs"]["tokens"]
    assert narrow == greedy


@pytest.mark.slow  # tens of seconds in-process (tests/conftest.py: the tiers)
def test_schemathesis_finds_no_failure(tiny_models, grid):
    """Every schemathesis check against the document narrowed to this deployment (its vocabulary and
    context), as the other roles' documents are (tests/test_openapi.py)."""
    import os

    from larql_edge.roles.serve.api import MAX_PROMPTS
    from larql_edge.roles.serve.openapi import openapi_spec
    from tests._schemathesis import run

    limits = Limits(context=64)  # a short context bounds every legal generation (4x shorter run than 256)
    with _serve(tiny_models["gemma3"], grid["router"].url, limits, chat=True) as s:
        doc = openapi_spec(httpx.get(s.url + "/v1/stats").json())
        # A schema-valid request may ask for MAX_PROMPTS prompts x n choices, each to the end of the
        # context: legal work, slow on a loaded host (two 10 s read timeouts were errors, not defects).
        # The timeout is derived from a baseline measured here: one sequence to the context's end (its
        # EOS banned), times the rounds of max_active sequences the largest request needs, times 3.
        no_eos = {str(i): -100 for i in s.app.ctx.served.eos_ids}
        t0 = time.monotonic()
        r = _complete(s.url, prompt=[1], max_tokens=limits.context, logit_bias=no_eos)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == limits.context - 1, r.text
        one = time.monotonic() - t0
        rounds = -(-MAX_PROMPTS * min(8, limits.max_active) // limits.max_active)
        timeout = max(10.0, 3 * rounds * one)
        report = run(doc, s.url, max_examples=int(os.environ.get("SCHEMATHESIS_EXAMPLES", "5")),
                     seed=int(os.environ.get("SCHEMATHESIS_SEED", "1")), request_timeout=timeout)
        print(f"schemathesis serve (request timeout {timeout:.0f} s from a {one:.2f} s baseline): {report}")
        assert report.cases > 100
        assert not report.failures and not report.errors, str(report)
        assert _complete(s.url, prompt="a", max_tokens=2).status_code == 200  # and it still serves


def test_a_chunked_prefill_gives_the_tokens_of_a_whole_one_and_does_not_stall_decoding(tiny_models, grid, serve):
    prompt = [(7 * i) % 40 + 1 for i in range(40)]
    whole = _complete(serve.url, prompt=prompt, max_tokens=6, logprobs=1).json()["choices"][0]["logprobs"]["tokens"]
    with _serve(tiny_models["gemma3"], grid["router"].url, Limits(context=64, step_tokens=8)) as s:
        chunked = _complete(s.url, prompt=prompt, max_tokens=6, logprobs=1).json()
        assert chunked["choices"][0]["logprobs"]["tokens"] == whole
        stats = httpx.get(s.url + "/v1/stats").json()["scheduler"]
        # the prompt took 5 steps of at most 8 rows; each accepted draft saved a decoding step
        assert stats["steps"] >= 40 // 8 + 5 - stats["speculation"]["accepted_tokens"]
        assert stats["rows"] / stats["steps"] <= 8


def test_a_body_over_the_limit_is_an_openai_413(serve):
    r = httpx.post(serve.url + "/v1/completions", content=b'{"prompt": "' + b"a" * (5 << 20) + b'"}',
                   headers={"content-type": "application/json"}, timeout=60)
    _error(r, 413)
