"""larql-serve's API surface on a real model, slow tier: the unmodified `openai` client (raw HTTP for what
it cannot send) against larql-serve in front of a real grid of processes (router, two FFN shards, embed
server), Gemma 3 270M: n with a seed, the penalties and logit_bias, prompt caching against a server
without it, API keys."""

from __future__ import annotations

import socket

import httpx
import numpy as np
import openai
import pytest

from tests._grid import Procs
from tests.test_serve_api import ids_by_text

pytestmark = pytest.mark.slow
KEY = "sk-test-serveapi-key"
MODEL = "gemma3-270m"


@pytest.fixture(scope="module")
def real(gemma_f32, real_grid_f32, tmp_path_factory):
    g = real_grid_f32("gemma3-270m", gemma_f32)
    with Procs(tmp_path_factory.mktemp("serve-api")) as procs:
        common = ["--ffn", g["router"].url, "--blas-threads", "1", "--served-model-name", MODEL, "--max-active", "4",
                  "--context", "512"]
        on = procs.start("serve-cache", "larql-serve", str(gemma_f32), *common, env={"LARQL_API_KEY": KEY})
        off = procs.start("serve-nocache", "larql-serve", str(gemma_f32), *common, "--prefix-cache-mb", "0")
        on.wait_ready(300)
        off.wait_ready(300)
        yield {"on": on, "off": off, "vindex": gemma_f32, "procs": procs, "grid_procs": g["procs"],
               "client": openai.OpenAI(base_url=on.url + "/v1", api_key=KEY, max_retries=0, timeout=600),
               "uncached": openai.OpenAI(base_url=off.url + "/v1", api_key="unused", max_retries=0, timeout=600)}


@pytest.fixture(scope="module")
def ids_of(real):
    return ids_by_text(real["vindex"])


def test_n_4_with_a_seed_gives_4_completions_identical_on_a_rerun(real):
    c = real["client"]
    kw = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 12, "temperature": 1.0, "seed": 1234, "n": 4}
    a = c.completions.create(**kw)
    assert [ch.index for ch in a.choices] == [0, 1, 2, 3]
    assert len({ch.text for ch in a.choices}) > 1  # four draws, not one copied
    b = c.completions.create(**kw)
    assert [ch.text for ch in b.choices] == [ch.text for ch in a.choices]
    assert 4 <= a.usage.completion_tokens <= 48 and a.usage.prompt_tokens == b.usage.prompt_tokens


def test_penalties_and_logit_bias_change_the_output_and_a_banned_token_never_appears(real, ids_of):
    c = real["client"]
    kw = {"model": MODEL, "prompt": "The list of colours: red, green, blue, red, green, blue,", "max_tokens": 24,
          "temperature": 0, "logprobs": 1}
    free = c.completions.create(**kw).choices[0]
    tokens = free.logprobs.tokens
    banned_texts = set(tokens[:4])
    banned = {str(i): -100 for t in banned_texts for i in ids_of[t]}
    assert 0 < len(banned) <= 300
    got = c.completions.create(**kw, logit_bias=banned).choices[0]
    assert not set(got.logprobs.tokens) & banned_texts
    # frequency_penalty: fewer repeats (measured as distinct tokens among the 24)
    pen = c.completions.create(**kw, frequency_penalty=2.0).choices[0]
    assert len(set(pen.logprobs.tokens)) > len(set(tokens)), (tokens, pen.logprobs.tokens)
    # presence and repetition penalties (greedy here, every colour is penalised alike): seeded draws change
    hot = kw | {"temperature": 1.0, "seed": 7}
    base = c.completions.create(**hot).choices[0].logprobs.tokens
    assert c.completions.create(**hot).choices[0].logprobs.tokens == base
    assert c.completions.create(**hot, presence_penalty=2.0).choices[0].logprobs.tokens != base
    assert c.completions.create(**hot, extra_body={"repetition_penalty": 2.0}).choices[0].logprobs.tokens != base


def test_a_bias_chooses_a_token_far_outside_the_heads_64_and_the_controls_equal_the_whole_row(real):
    """Greedy, Gemma 3 270M through the grid: +100 on the token the local whole-row forward pass ranks
    5000th makes it the reply (the head returns 64 candidates); a bias just above / below the gap to
    the argmax on the 300th does / does not; 8 tokens under a positive bias and a negative presence
    penalty equal greedy on the whole rows with the controls applied from their definitions."""
    from larql_edge.format.vindex import Vindex
    from larql_edge.model.forward import Transformer
    from tests.test_serve_api import reference_controls

    c = real["client"]
    prompt = [2, 818, 5279, 529, 7001, 563]  # "The capital of France is" (the golden file's ids)
    vx = Vindex.open(real["vindex"])
    local, tok = Transformer.local(vx), vx.load_tokenizer()
    row = local.next_logits(prompt).astype(np.float64)
    order = np.argsort(-row, kind="stable")

    def reply(n: int, **kw) -> str:
        return c.completions.create(model=MODEL, prompt=prompt, max_tokens=n, temperature=0, **kw).choices[0].text

    far = int(order[5000])
    assert reply(1, logit_bias={str(far): 100}) == tok.decode([far])
    mid, gap = int(order[300]), float(row[order[0]] - row[order[300]])
    assert reply(1, logit_bias={str(mid): gap + 0.5}) == tok.decode([mid])
    assert reply(1, logit_bias={str(mid): gap - 0.5}) == tok.decode([int(order[0])])
    bias = {int(order[200]): 6.0}
    want: list[int] = []
    for _ in range(8):
        z = local.next_logits(prompt + want).astype(np.float64)
        want.append(int(np.argmax(reference_controls(z, bias, 1.0, -1.5, 0.0, prompt, want))))
    got = reply(8, logit_bias={str(t): b for t, b in bias.items()}, presence_penalty=-1.5)
    assert got == tok.decode(want), (got, tok.decode(want))


def test_a_second_turn_reports_cached_tokens_and_the_tokens_of_the_uncached_server(real):
    history = ("A conversation about lighthouses between a user and a knowledgeable assistant.\n"
               "User: Tell me about the old lighthouse on the cliff.\nAssistant:")
    kw = {"model": MODEL, "max_tokens": 16, "temperature": 0, "logprobs": 1}
    first = real["client"].completions.create(prompt=history, **kw)
    history += first.choices[0].text + "\nUser: Who kept it in the winter?\nAssistant:"
    second = real["client"].completions.create(prompt=history, **kw)
    cold = real["uncached"].completions.create(prompt=history, **kw)
    assert second.usage.prompt_tokens_details.cached_tokens > 0
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    assert second.choices[0].logprobs.tokens == cold.choices[0].logprobs.tokens
    assert second.choices[0].text == cold.choices[0].text


def test_api_keys_with_the_openai_client_and_a_200_mib_body_costs_nothing(real):
    bad = openai.OpenAI(base_url=real["on"].url + "/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        bad.completions.create(model=MODEL, prompt="hi", max_tokens=1)
    assert e.value.status_code == 401 and e.value.code == "invalid_api_key" and "sk-wrong" not in str(e.value)
    assert real["client"].models.retrieve(MODEL).id == MODEL
    assert httpx.get(real["on"].url + "/v1/health").status_code == 200
    host, port = real["on"].url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n" % (200 << 20))
        reply = s.recv(65536)  # not one byte of the body was sent
    assert reply.startswith(b"HTTP/1.1 401")
    assert KEY not in real["procs"].logs() and KEY not in real["grid_procs"].logs()
