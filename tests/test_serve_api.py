"""larql-serve's API surface, fast tier (in-process grid on a tiny Gemma 3, real HTTP): every field of
OpenAI's own request types honoured or refused by name, the sampling controls, n > 1 on one prefill,
batched and token-id prompts, echo, and the prefix cache (cached and uncached give the same tokens)."""

from __future__ import annotations

import typing

import httpx
import numpy as np
import pytest

from larql_edge.roles.serve import api
from larql_edge.roles.serve.app import Limits
from tests import _inproc
from tests.test_serve import _error, _serve


@pytest.fixture(scope="module")
def grid(tiny_models):
    with _inproc.grid(tiny_models["gemma3"], ["0-0", "1-1"]) as g:
        yield g


@pytest.fixture(scope="module")
def serve(tiny_models, grid):
    with _serve(tiny_models["gemma3"], grid["router"].url, Limits(context=128), chat=True) as s:
        yield s


@pytest.fixture(scope="module")
def serve_uncached(tiny_models, grid):
    with _serve(tiny_models["gemma3"], grid["router"].url, Limits(context=128, prefix_cache_bytes=0), chat=True) as s:
        yield s


def _post(url: str, path: str, **body) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=60)


def _ok(r: httpx.Response) -> dict:
    assert r.status_code == 200, r.text
    return r.json()


def _tokens(choice: dict) -> list[str]:
    return choice["logprobs"]["tokens"]


# -- every documented field --------------------------------------------------------------------------
# A value an application would send for each field of OpenAI's request types (non-null, not the default).
VALUES: dict[str, typing.Any] = {
    "model": "gemma3-hf", "max_tokens": 3, "max_completion_tokens": 3, "temperature": 0.5, "top_p": 0.9, "seed": 7,
    "stop": ["\n\n"], "n": 2, "stream": True, "stream_options": {"include_usage": True}, "presence_penalty": 0.5,
    "frequency_penalty": 0.5, "logit_bias": {"5": -100}, "user": "u1", "logprobs": True, "top_logprobs": 2,
    "echo": True, "suffix": "!", "best_of": 2, "metadata": {"k": "v"}, "store": False, "service_tier": "auto",
    "safety_identifier": "s1", "prompt_cache_key": "k", "prompt_cache_retention": "24h",
    "prompt_cache_options": {"mode": "auto"}, "modalities": ["text"],
    "response_format": {"type": "json_object"}, "tools": [{"type": "function", "function": {"name": "f"}}],
    "tool_choice": "auto", "parallel_tool_calls": True, "functions": [{"name": "f"}], "function_call": "auto",
    "audio": {"voice": "alloy", "format": "wav"}, "prediction": {"type": "content", "content": "x"},
    "web_search_options": {}, "reasoning_effort": "low", "verbosity": "low", "moderation": {"type": "x"},
}


def _documented(params_module) -> list[str]:
    names: set[str] = set()
    for cls in (params_module.CompletionCreateParamsNonStreaming, params_module.CompletionCreateParamsStreaming):
        names |= set(typing.get_type_hints(cls))
    return sorted(names)


@pytest.mark.parametrize("kind", ["completions", "chat"])
def test_every_field_of_the_openai_request_types_is_honoured_or_refused_by_name(serve, kind):
    from openai.types import completion_create_params as completion
    from openai.types.chat import completion_create_params as chat

    model = api.CompletionRequest if kind == "completions" else api.ChatCompletionRequest
    path = "/v1/completions" if kind == "completions" else "/v1/chat/completions"
    base: dict = {"prompt": [1, 5, 9]} if kind == "completions" else {"messages": [{"role": "user", "content": "hi"}]}
    fields = _documented(completion if kind == "completions" else chat)
    assert "stream" in fields and len(fields) > 10
    refused = {name for name, f in model.model_fields.items() if f.annotation is type(None)}
    ignored = {name for name, f in model.model_fields.items() if (f.description or "").startswith("Accepted and ignored")}
    unknown = [f for f in fields if f not in model.model_fields]
    assert not unknown, f"documented by OpenAI, neither implemented nor refused: {unknown}"
    honoured = []
    for name in fields:
        if name in base:
            continue
        assert name in VALUES, f"add a value for {name}"
        # A few tokens each (chat's default is the rest of the context): what is checked is the answer's status.
        body = base | {"max_tokens": 4} | {name: 2 if (name, kind) == ("logprobs", "completions") else VALUES[name]}
        if name == "top_logprobs":
            body["logprobs"] = True
        if name == "best_of":
            body["n"] = 2
        if name == "echo":
            body["logprobs"] = None
        r = _post(serve.url, path, **body)
        if name in refused:
            _error(r, 400, name, "unsupported_parameter")
            continue
        if name == "response_format":  # honoured with the real models (test_serve_structured_real.py); the
            _error(r, 400, name, "unsupported_value")  # tiny model's WordPiece tokenizer cannot carry a grammar
            continue
        assert r.status_code == 200, (name, r.text)
        if name not in ignored:
            honoured.append(name)
    # What is honoured is tested for its effect below; what is ignored is published.
    assert set(honoured) >= {"max_tokens", "temperature", "seed", "stop", "n", "stream", "presence_penalty",
                             "frequency_penalty", "logit_bias", "logprobs"}
    assert ignored <= set(api.IGNORED) | {"user", "include_obfuscation"}


def test_an_unknown_field_is_a_400_naming_it(serve):
    _error(_post(serve.url, "/v1/completions", prompt="a", temprature=0), 400, "temprature", "unknown_parameter")
    _error(_post(serve.url, "/v1/chat/completions", messages=[{"role": "user", "content": "a", "colour": 1}]),
           400, "messages[0].colour", "unknown_parameter")


@pytest.mark.parametrize("body,param", [
    ({"n": 9}, "n"), ({"n": 0}, "n"), ({"top_k": 5000}, "top_k"), ({"min_p": 1.5}, "min_p"),
    ({"repetition_penalty": 0}, "repetition_penalty"), ({"presence_penalty": 3}, "presence_penalty"),
    ({"logit_bias": {"x": 1}}, "logit_bias"), ({"logit_bias": {"1": 101}}, "logit_bias"),
    ({"logit_bias": {"99999999": -100}}, "logit_bias"), ({"logit_bias": [1]}, "logit_bias"),
    ({"best_of": 3}, "best_of"), ({"echo": True, "logprobs": 1}, "echo"), ({"prompt": [[1, 2], "a", 3]}, "prompt"),
    ({"prompt": ["a"] * 17}, "prompt"),
])
def test_bad_sampling_controls_are_400s_naming_them(serve, body, param):
    _error(_post(serve.url, "/v1/completions", **({"prompt": "a"} | body)), 400, param)


# -- sampling controls ---------------------------------------------------------------------------------
def ids_by_text(vindex) -> dict[str, list[int]]:
    """Token text (as logprobs name it) -> every id decoding to it."""
    from larql_edge.format.vindex import Vindex

    tok = Vindex.open(vindex).load_tokenizer()
    out: dict[str, list[int]] = {}
    for i, text in enumerate(tok.decode_batch([[i] for i in range(tok.get_vocab_size())])):
        out.setdefault(text, []).append(i)
    return out


@pytest.fixture(scope="module")
def ids_of(tiny_models):
    return ids_by_text(tiny_models["gemma3"])


def test_logit_bias_bans_a_token_and_the_penalties_change_the_output(serve, ids_of):
    body = {"prompt": [1, 5, 9], "max_tokens": 24, "temperature": 0, "logprobs": 1}
    free = _ok(_post(serve.url, "/v1/completions", **body))["choices"][0]
    texts = _tokens(free)
    banned_texts = set(texts[:3])
    banned = {str(i): -100 for t in banned_texts for i in ids_of[t]}
    assert len(banned) <= 300
    got = _ok(_post(serve.url, "/v1/completions", **body, logit_bias=banned))["choices"][0]
    assert not set(_tokens(got)) & banned_texts
    assert _tokens(got) != texts
    # The tiny model repeats itself: a frequency penalty makes it say more different tokens.
    assert len(set(texts)) < len(texts)
    pen = _ok(_post(serve.url, "/v1/completions", **body, frequency_penalty=2.0))["choices"][0]
    assert len(set(_tokens(pen))) > len(set(_tokens(free)))
    # Sampled with one seed, a penalty changes the draws.
    hot = body | {"temperature": 1.0, "seed": 5}
    base = _tokens(_ok(_post(serve.url, "/v1/completions", **hot))["choices"][0])
    for extra in ({"repetition_penalty": 3.0}, {"presence_penalty": 2.0}):
        assert _tokens(_ok(_post(serve.url, "/v1/completions", **hot, **extra))["choices"][0]) != base, extra
    # (presence_penalty is at most 2, OpenAI's range: greedy, this random model's top token leads by more.)
    # A positive bias on a candidate makes it the greedy choice.
    second = _ok(_post(serve.url, "/v1/completions", prompt=[1, 5, 9], max_tokens=1, temperature=0, logprobs=2))
    runner_up = [t for t in second["choices"][0]["logprobs"]["top_logprobs"][0] if t != _tokens(free)[0]][0]
    rid = ids_of[runner_up][0]
    forced = _ok(_post(serve.url, "/v1/completions", prompt=[1, 5, 9], max_tokens=1, temperature=0, logprobs=1,
                       logit_bias={str(rid): 50}))
    assert _tokens(forced["choices"][0]) == [runner_up]


def test_top_k_1_and_min_p_1_are_greedy(serve):
    body = {"prompt": [2, 3], "max_tokens": 10, "logprobs": 1, "seed": 4}
    greedy = _tokens(_ok(_post(serve.url, "/v1/completions", **body, temperature=0))["choices"][0])
    for extra in ({"top_k": 1}, {"min_p": 1.0}):
        assert _tokens(_ok(_post(serve.url, "/v1/completions", **body, temperature=1.5, **extra))["choices"][0]) == greedy


def reference_controls(logits: np.ndarray, bias: dict[int, float], rep: float, presence: float, frequency: float,
                       prompt: list[int], generated: list[int]) -> np.ndarray:
    """The sampling controls on a whole logits row, from their published definitions, in vLLM's and
    llama.cpp's order: OpenAI's logit_bias (added; -100 bans), the CTRL repetition penalty as
    transformers' RepetitionPenaltyLogitsProcessor and vLLM apply it (a seen token's logit divided by
    the penalty if positive, multiplied if negative), OpenAI's presence and frequency penalties
    (``mu[j] - c[j] * alpha_frequency - (c[j] > 0) * alpha_presence``, counts over the output)."""
    out = [float(v) for v in logits]
    for t, b in bias.items():
        out[t] = float("-inf") if b <= -100 else out[t] + b
    for t in set(prompt) | set(generated):
        out[t] = out[t] / rep if out[t] > 0 else out[t] * rep
    for t in set(generated):
        out[t] -= generated.count(t) * frequency + presence
    return np.array(out)


CONTROLS = [  # (logit_bias, repetition, presence, frequency)
    ({}, 1.3, 0.0, 0.0), ({}, 0.6, 0.0, 0.0), ({}, 1.0, 1.5, 0.5), ({}, 1.0, -2.0, -1.0),
    ({7: 100.0}, 1.0, 0.0, 0.0), ({3: 4.0, 11: -100.0, 400: 2.5}, 1.2, 0.3, 0.7), ({9: -3.0}, 0.8, -0.5, 2.0),
]


@pytest.mark.parametrize("controls", CONTROLS)
def test_the_sampling_controls_on_the_candidates_equal_them_on_the_whole_row(controls):
    """Greedy on the head's top k plus the raised ids (and the whole row when those cannot decide) is
    greedy on the whole adjusted row, for 200 random rows; sampled, every token the controls leave
    above the k-th's score is a candidate, with the logit the reference gives it."""
    from larql_edge.model.head import candidates
    from larql_edge.roles.serve.scheduler import Params, complete, raised, sample

    bias, rep, presence, frequency = controls
    rng = np.random.default_rng(CONTROLS.index(controls))
    vocab, k, fetched = 500, 8, 0
    for trial in range(200):
        row = (rng.standard_normal(vocab) * rng.uniform(0.5, 4)).astype(np.float32)
        prompt = rng.integers(0, vocab, rng.integers(1, 30)).tolist()
        hot = np.argsort(-row)[: 3 * k]  # outputs that repeat the likely tokens: the penalties bite the top k
        generated = rng.choice(hot, rng.integers(0, 20)).tolist()
        if trial % 4 == 0:  # an output that said every likely token, often: they may all fall below the k-th
            generated = np.repeat(hot, 3).tolist()
        ref = reference_controls(row, bias, rep, presence, frequency, prompt, generated)
        for temperature in (0.0, 1.0):
            p = Params(max_tokens=1, temperature=temperature, logit_bias=bias, repetition_penalty=rep,
                       presence_penalty=presence, frequency_penalty=frequency)
            up = raised(p, prompt, generated)

            def whole(row: np.ndarray = row) -> np.ndarray:
                nonlocal fetched
                fetched += 1
                return row

            top = complete(candidates(row, k, up), p, prompt, generated, up, k, whole)
            if temperature == 0.0:
                assert sample(top.ids, top.lps, p, rng, prompt, generated, top.lse) == int(np.argmax(ref)), trial
                continue
            listed = dict(zip(top.ids.tolist(), top.lps + top.lse, strict=True))
            kth = np.sort(row)[-k]
            for t in np.nonzero(ref > kth)[0].tolist():
                assert t in listed, (trial, t)
            z = adjust_of(top, p, prompt, generated)
            assert z == pytest.approx([ref[t] for t in top.ids.tolist()], rel=1e-5, abs=1e-4)
    # the candidates decide most rows; the whole row comes when the penalties lowered every candidate
    assert fetched < 60
    if frequency >= 0.5:
        assert fetched > 0


def adjust_of(top, p, prompt, generated) -> list[float]:
    from larql_edge.roles.serve.scheduler import adjust

    return adjust(top.ids, top.lps + top.lse, p, prompt, generated).tolist()


def test_a_banned_token_is_never_drawn_and_a_bias_decides_greedy():
    from larql_edge.roles.serve.scheduler import Params, adjust, sample

    ids, lps = np.array([4, 7, 9, 2]), np.array([-0.1, -1.0, -2.0, -3.0])
    b = Params(max_tokens=1, temperature=0, logit_bias={4: -100, 2: 5})
    z = adjust(ids, lps, b, [], [])
    assert z[0] == -np.inf and z[3] == pytest.approx(2.0)
    assert sample(ids, lps, b, np.random.default_rng(0)) == 2
    hot = Params(max_tokens=1, temperature=2.0, logit_bias={4: -100})
    rng = np.random.default_rng(1)
    assert 4 not in {sample(ids, lps, hot, rng) for _ in range(500)}
    # the smallest valid repetition_penalty (schemathesis sent 5e-324): a seen token wins, no overflow to NaN
    for t in (0.0, 1e-3, 2.0):
        tiny = Params(max_tokens=1, temperature=t, repetition_penalty=5e-324)
        assert sample(ids, lps, tiny, rng, [9], [], lse=5.0) == 9


def test_the_controls_through_the_grid_equal_a_whole_row_reference(tiny_models, grid, monkeypatch):
    """Greedy through the grid with the head's candidates cut to 4 (the tiny vocabulary has 45 tokens):
    a +100 logit_bias on a token the reference ranks 10th is chosen, and 10 tokens under the penalties
    and biases equal greedy on the reference's whole logits rows (`tests.tinymodel.reference_logits`,
    float64 from the safetensors) with the controls applied by `reference_controls`."""
    from larql_edge.roles.serve import scheduler
    from tests.tinymodel import reference_logits

    monkeypatch.setattr(scheduler, "HEAD_TOP_K", 4)
    folder, prompt = tiny_models["gemma3-hf"], [2, 5, 9, 13, 5]
    with _serve(tiny_models["gemma3"], grid["router"].url, Limits(context=128, prefix_cache_bytes=0), eos=False) as s:
        ids = ids_by_text(tiny_models["gemma3"])

        def greedy(n: int, **controls) -> list[int]:
            got = _ok(_post(s.url, "/v1/completions", prompt=prompt, max_tokens=n, temperature=0, logprobs=1,
                            **controls))["choices"][0]
            out = []
            for t in _tokens(got):
                assert len(ids[t]) == 1, t
                out.append(ids[t][0])
            return out

        order = np.argsort(-reference_logits(folder, prompt)[-1], kind="stable")
        tenth = int(order[9])
        lowered = {str(t): -30.0 for t in order[:8].tolist()}  # every candidate falls below the rest
        assert greedy(1, logit_bias={str(tenth): 100}) == [tenth]
        for bias, rep, presence, frequency in [({str(tenth): 3.0}, 1.0, 0.0, 0.0), ({}, 0.5, 0.0, 0.0),
                                               ({}, 1.0, -2.0, 0.0), ({"9": -100, "11": 2.0}, 1.5, 0.5, 1.0),
                                               ({}, 1.0, 0.0, 2.0), (lowered, 1.0, 0.0, 0.0)]:
            bias = {str(t): -100 for t in range(4)} | bias  # the special tokens decode to no text: never them
            want: list[int] = []
            for _ in range(10):
                row = reference_logits(folder, prompt + want)[-1]
                ref = reference_controls(row, {int(t): b for t, b in bias.items()}, rep, presence, frequency,
                                         prompt, want)
                want.append(int(np.argmax(ref)))
            got = greedy(10, logit_bias=bias, repetition_penalty=rep, presence_penalty=presence,
                         frequency_penalty=frequency)
            assert got == want, (bias, rep, presence, frequency)
        stats = httpx.get(s.url + "/v1/stats").json()["scheduler"]
        assert stats["full_logit_rows"] > 0  # -30 lowered every candidate: the whole row decided


def test_a_sequence_ends_where_its_reply_is_whole(tiny_models):
    """A sequence's ``ends`` (a tool-call list that repeats a call) stops it, ``stop``, at the token that
    made its text whole, however many ``max_tokens`` allow."""
    import asyncio

    from larql_edge.format.vindex import Vindex
    from larql_edge.model.batch import BatchEngine, LocalTopK
    from larql_edge.model.forward import Transformer
    from larql_edge.roles.serve.scheduler import Event, Params, Scheduler, Seq

    m = Transformer.local(tiny_models["gemma3"])
    engine = BatchEngine(m.spec, m.attn, m.embedder, m.ffn_provider, LocalTopK(m.head), m.backend)
    seen: list[str] = []

    def three_words(text: str) -> bool:
        seen.append(text)
        return len(text.split()) >= 3

    async def run() -> tuple[Seq, list[Event]]:
        sched = Scheduler(engine, Vindex.open(tiny_models["gemma3"]).load_tokenizer(), context=64, max_active=2,
                          max_queue=2)
        s = Seq([2, 5, 9], Params(20, 0.0, logit_bias={t: -100 for t in range(4)}), asyncio.get_running_loop(),
                ends=three_words)
        try:
            sched.admit(s)
            out = [await s.events.get()]
            while out[-1].kind == "text":
                out.append(await s.events.get())
        finally:
            sched.stop()
        return s, out

    s, events = asyncio.run(run())
    assert events[-1].kind == "done" and events[-1].finish_reason == "stop"
    assert len(s.generated) == 3 and len(seen) == 3
    assert len("".join(e.text for e in events).split()) == 3


# -- n, batched prompts, echo ----------------------------------------------------------------------------
def test_n_choices_with_a_seed_are_distinct_draws_reproducible_and_share_one_prefill(tiny_models, grid):
    with _serve(tiny_models["gemma3"], grid["router"].url, Limits(context=128, prefix_cache_bytes=0)) as s:
        prompt = [(3 * i) % 40 + 1 for i in range(40)]
        body = {"prompt": prompt, "max_tokens": 8, "temperature": 1.5, "seed": 11, "n": 4}
        before = httpx.get(s.url + "/v1/stats").json()["scheduler"]["rows"]
        a = _ok(_post(s.url, "/v1/completions", **body))
        rows = httpx.get(s.url + "/v1/stats").json()["scheduler"]["rows"] - before
        assert [c["index"] for c in a["choices"]] == [0, 1, 2, 3]
        # 4 x 8 tokens, fewer only where a choice drew its end-of-sequence token (temperature 1.5)
        finished = [c["finish_reason"] for c in a["choices"]]
        assert a["usage"]["prompt_tokens"] == 40 and a["usage"]["completion_tokens"] <= 32
        assert (a["usage"]["completion_tokens"] == 32) == (finished == ["length"] * 4), (a["usage"], finished)
        assert rows < 2 * 40  # the prompt went through the grid once, not 4 times
        texts = [c["text"] for c in a["choices"]]
        assert len(set(texts)) > 1
        b = _ok(_post(s.url, "/v1/completions", **body))
        assert [c["text"] for c in b["choices"]] == texts
        # greedy: every choice is the one-choice completion
        g = _ok(_post(s.url, "/v1/completions", prompt=prompt, max_tokens=8, temperature=0, n=3))
        one = _ok(_post(s.url, "/v1/completions", prompt=prompt, max_tokens=8, temperature=0))["choices"][0]["text"]
        assert [c["text"] for c in g["choices"]] == [one] * 3


def test_n_streams_every_choice_by_index(serve):
    with httpx.stream("POST", serve.url + "/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "temperature": 0, "n": 2,
            "stream": True}) as r:
        raw = r.read().decode()
    import json

    chunks = [json.loads(e[6:]) for e in raw.split("\n\n") if e and e != "data: [DONE]"]
    text = {0: "", 1: ""}
    finish = {}
    for c in chunks:
        for ch in c["choices"]:
            text[ch["index"]] += ch["delta"].get("content", "")
            if ch["finish_reason"]:
                finish[ch["index"]] = ch["finish_reason"]
    assert text[0] == text[1] and set(finish) == {0, 1}


def test_batched_and_token_id_prompts_and_echo(serve):
    tok = _ok(_post(serve.url, "/tokenize", content="a b c"))["tokens"]
    by_text = _ok(_post(serve.url, "/v1/completions", prompt="a b c", max_tokens=4, temperature=0))
    by_ids = _ok(_post(serve.url, "/v1/completions", prompt=tok, max_tokens=4, temperature=0))
    assert by_ids["choices"][0]["text"] == by_text["choices"][0]["text"]
    batch = _ok(_post(serve.url, "/v1/completions", prompt=["a b c", [2, 3]], max_tokens=4, temperature=0, n=2))
    assert [c["index"] for c in batch["choices"]] == [0, 1, 2, 3]
    assert batch["choices"][0]["text"] == batch["choices"][1]["text"] == by_text["choices"][0]["text"]
    other = _ok(_post(serve.url, "/v1/completions", prompt=[2, 3], max_tokens=4, temperature=0))["choices"][0]["text"]
    assert batch["choices"][2]["text"] == other
    echo = _ok(_post(serve.url, "/v1/completions", prompt="a b c", max_tokens=4, temperature=0, echo=True))
    assert echo["choices"][0]["text"] == "a b c" + by_text["choices"][0]["text"]


# -- prefix cache -----------------------------------------------------------------------------------------
def test_a_second_chat_turn_is_served_from_the_prefix_cache_with_the_same_greedy_tokens(serve, serve_uncached):
    history = [{"role": "system", "content": "You are terse. " * 6}, {"role": "user", "content": "Say a word."}]
    body = {"max_tokens": 8, "temperature": 0, "logprobs": True}
    first = _ok(_post(serve.url, "/v1/chat/completions", messages=history, **body))
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0 or True  # another test may have warmed it
    history += [{"role": "assistant", "content": first["choices"][0]["message"]["content"]},
                {"role": "user", "content": "Another."}]
    second = _ok(_post(serve.url, "/v1/chat/completions", messages=history, **body))
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert 0 < cached < second["usage"]["prompt_tokens"]
    cold = _ok(_post(serve_uncached.url, "/v1/chat/completions", messages=history, **body))
    assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert [t["token"] for t in second["choices"][0]["logprobs"]["content"]] == \
        [t["token"] for t in cold["choices"][0]["logprobs"]["content"]]
    stats = httpx.get(serve.url + "/v1/stats").json()
    assert stats["scheduler"]["prefix_cache"]["hits"] >= 1
    assert stats["scheduler"]["prefix_cache"]["bytes"] <= stats["limits"]["prefix_cache_bytes"]


# -- API keys -------------------------------------------------------------------------------------------
def test_api_keys_401_before_the_body_is_read_and_health_stays_open(tiny_models, grid, caplog):
    import socket

    from larql_edge.format.vindex import Vindex
    from larql_edge.net.remote import RemoteSettings
    from larql_edge.roles.serve.app import create_app, remote_engine, served_model
    from larql_edge.testing.servers import ServerThread

    vx = Vindex.open(tiny_models["gemma3"])
    engine = remote_engine(vx, RemoteSettings(ffn=grid["router"].url, timeout=30, retries=1))
    served = served_model(vx, vx.load_tokenizer(), 64, None)
    keys = ("k-one-secret", "k-two-secret")
    with ServerThread(create_app(engine, served, Limits(context=64), api_keys=keys)) as s:
        body = {"prompt": "a", "max_tokens": 2}
        for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": "Basic k-one-secret"},
                        {"authorization": "Bearer k-one-secretX"}):
            r = httpx.post(s.url + "/v1/completions", json=body, headers=headers)
            err = _error(r, 401, None, "invalid_api_key")
            assert "secret" not in r.text and err["type"] == "invalid_request_error"
        for k in keys:
            r = httpx.post(s.url + "/v1/completions", json=body, headers={"authorization": f"Bearer {k}"}, timeout=60)
            assert r.status_code == 200, r.text
        for path in ("/v1/health", "/v1/ready", "/metrics", "/openapi.json"):
            assert httpx.get(s.url + path).status_code == 200, path
        _error(httpx.get(s.url + "/v1/models"), 401)
        # A 200 MiB body announced without a key: the 401 comes back at once, none of the body is read.
        host, port = s.url.removeprefix("http://").split(":")
        # The headers only: the reply comes while not one byte of the body has been sent.
        with socket.create_connection((host, int(port)), timeout=30) as c:
            c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: %d\r\n\r\n" % (200 << 20))
            reply = c.recv(65536)
        assert reply.startswith(b"HTTP/1.1 401"), reply[:200]
        assert httpx.get(s.url + "/v1/health").status_code == 200
    assert not any(k in rec.getMessage() for rec in caplog.records for k in keys)


# -- /tokenize, /detokenize, /v1/models/{id} ---------------------------------------------------------------
def test_tokenize_and_detokenize_in_llama_cpp_and_vllm_shapes(serve):
    from tests.tinymodel import WORDS

    text = " ".join(WORDS[:3])
    llama = _ok(_post(serve.url, "/tokenize", content=text))
    vllm = _ok(_post(serve.url, "/tokenize", prompt=text, add_special_tokens=False))
    assert llama["tokens"] == vllm["tokens"] and vllm["count"] == len(vllm["tokens"]) == 3
    assert vllm["max_model_len"] == 128
    with_bos = _ok(_post(serve.url, "/tokenize", prompt=text))["tokens"]  # vLLM: special tokens by default
    assert len(with_bos) == len(llama["tokens"]) + 1
    pieces = _ok(_post(serve.url, "/tokenize", content=text, with_pieces=True))["tokens"]
    assert [p["id"] for p in pieces] == llama["tokens"] and [p["piece"] for p in pieces] == WORDS[:3]
    back = _ok(_post(serve.url, "/detokenize", tokens=llama["tokens"]))
    assert back == {"content": text, "prompt": text}
    chat = _ok(_post(serve.url, "/tokenize", messages=[{"role": "user", "content": "hi"}]))
    served = _ok(_post(serve.url, "/v1/chat/completions", messages=[{"role": "user", "content": "hi"}], max_tokens=1))
    assert chat["count"] == served["usage"]["prompt_tokens"]
    _error(_post(serve.url, "/tokenize", content="a", prompt="b"), 400)
    _error(_post(serve.url, "/tokenize"), 400, None, "missing_required_parameter")
    _error(_post(serve.url, "/detokenize", tokens=[1, 999]), 400, "tokens")
    _error(_post(serve.url, "/detokenize", tokens=[-1]), 400, "tokens[0]")


def test_one_model_with_its_context_and_grid(serve):
    m = _ok(httpx.get(serve.url + "/v1/models/gemma3-hf"))
    assert m["id"] == "gemma3-hf" and m["object"] == "model" and m["max_model_len"] == 128
    assert "grid" in m
    _error(httpx.get(serve.url + "/v1/models/gpt-4"), 404, "model", "model_not_found")
