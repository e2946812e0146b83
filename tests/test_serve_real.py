"""larql-serve on the real models, slow tier: the unmodified `openai` client against larql-serve in front of
a real grid (router, two FFN shards, embed server, each a process), Gemma 3 270M and SmolLM2-135M-Instruct."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from tests._grid import Procs, larql

pytestmark = pytest.mark.slow


def _serve(procs: Procs, vindex: Path, router_url: str, *args: str):
    s = procs.start("serve", "larql-serve", str(vindex), "--ffn", router_url, "--blas-threads", "1", *args)
    s.wait_ready(300)
    return s


@pytest.fixture(scope="module")
def gemma(gemma_f32, real_grid_f32, tmp_path_factory):
    g = real_grid_f32("gemma3-270m", gemma_f32)  # layers 0-8 and 9-17
    with Procs(tmp_path_factory.mktemp("serve-gemma")) as procs:
        s = _serve(procs, gemma_f32, g["router"].url, "--served-model-name", "gemma3-270m", "--max-active", "8",
                   "--max-queue", "12", "--context", "512")
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=300)
        yield {"client": client, "url": s.url, "router": g["router"].url, "vindex": gemma_f32, "procs": procs}


def test_greedy_completions_are_the_golden_text_and_larql_generates_tokens(gemma, golden):
    c = gemma["client"]
    cases = [p for p in golden("gemma3-270m")["prompts"] if "greedy_ids" in p]
    assert cases
    for p in cases:
        r = c.completions.create(model="gemma3-270m", prompt=p["prompt"], max_tokens=16, temperature=0)
        assert r.choices[0].text == p["greedy_text"], p["prompt"]
        assert r.usage.prompt_tokens == len(p["input_ids"])
        assert r.usage.completion_tokens == 16 and r.usage.total_tokens == 16 + len(p["input_ids"])
        assert r.choices[0].finish_reason == "length"
    # larql generate through the same grid: the same tokens
    p = cases[0]
    out = larql("generate", "--vindex", str(gemma["vindex"]), "--ffn", gemma["router"], "--prompt", p["prompt"],
                "--max-tokens", "16", "--json", timeout=600)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["generated_ids"] == p["greedy_ids"]


def test_concurrent_greedy_completions_equal_the_golden_text(gemma, golden):
    c = gemma["client"]
    cases = [p for p in golden("gemma3-270m")["prompts"] if "greedy_ids" in p]
    prompts = (cases * 4)[:4]
    with ThreadPoolExecutor(len(prompts)) as pool:
        got = list(pool.map(lambda p: c.completions.create(model="gemma3-270m", prompt=p["prompt"], max_tokens=16,
                                                           temperature=0).choices[0].text, prompts))
    assert got == [p["greedy_text"] for p in prompts]


def test_streamed_completion_joins_to_the_text_and_stop_strings_cut_it(gemma, golden):
    c = gemma["client"]
    p = next(p for p in golden("gemma3-270m")["prompts"] if "greedy_ids" in p)
    parts = [ch.choices[0].text for ch in c.completions.create(model="gemma3-270m", prompt=p["prompt"], max_tokens=16,
                                                               temperature=0, stream=True) if ch.choices]
    assert "".join(parts) == p["greedy_text"]
    text = p["greedy_text"]
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    r = c.completions.create(model="gemma3-270m", prompt=p["prompt"], max_tokens=16, temperature=0, stop=[stop])
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == text[: text.index(stop)]
    streamed = "".join(ch.choices[0].text for ch in c.completions.create(
        model="gemma3-270m", prompt=p["prompt"], max_tokens=16, temperature=0, stop=[stop], stream=True) if ch.choices)
    assert streamed == r.choices[0].text


def test_bad_inputs_are_openai_errors_and_the_server_keeps_serving(gemma, golden):
    c = gemma["client"]
    with pytest.raises(openai.NotFoundError) as e:
        c.completions.create(model="gpt-4", prompt="hi", max_tokens=2)
    assert e.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model="gemma3-270m", prompt="word " * 600, max_tokens=2)
    assert e.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model="gemma3-270m", prompt="hi", max_tokens=2, temperature=5)
    assert e.value.param == "temperature"
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model="gemma3-270m", prompt="hi", n=100)  # n is bounded (GET /v1/stats)
    assert e.value.param == "n"
    # Gemma's packaged GGUF has no chat template: Gemma 3's built-in one renders the chat (a first
    # chat was a 400), and the reply stops at <end_of_turn>.
    from larql_edge.format.vindex import Vindex

    r = c.chat.completions.create(model="gemma3-270m", messages=[{"role": "user", "content": "hi"}], max_tokens=24,
                                  temperature=0)
    rendered = "<bos><start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n"
    want = Vindex.open(gemma["vindex"]).load_tokenizer().encode(rendered, add_special_tokens=False).ids
    assert r.usage.prompt_tokens == len(want) and r.choices[0].message.content.strip()
    assert "<end_of_turn>" not in r.choices[0].message.content
    r = httpx.post(gemma["url"] + "/v1/completions", content=b'{"prompt": ', headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    p = golden("gemma3-270m")["prompts"][0]
    r = c.completions.create(model="gemma3-270m", prompt=p["prompt"], max_tokens=4, temperature=0)
    assert r.choices[0].text == p["greedy_text"][: len(r.choices[0].text)] and r.usage.completion_tokens == 4


def test_disconnecting_10_of_20_streams_frees_them_the_others_finish_and_beyond_the_limits_is_429(gemma):
    """8 active + 12 queued: 20 streams are admitted, the 21st is a 429 (none 5xx); 10 clients go away
    mid-stream: the active count falls at once, and the other 10 get their whole, correct text."""
    url, c = gemma["url"], gemma["client"]
    prompts = [f"Count slowly from {i} to one hundred:" for i in range(20)]
    want = {i: c.completions.create(model="gemma3-270m", prompt=prompts[i], max_tokens=24, temperature=0).choices[0].text
            for i in range(10, 20)}
    release = threading.Event()
    done: dict[int, str] = {}
    statuses: list[int] = []

    def stream(i: int) -> None:
        body = {"model": "gemma3-270m", "prompt": prompts[i], "max_tokens": 24 if i >= 10 else 400, "temperature": 0,
                "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=900) as r:
            statuses.append(r.status_code)
            text = ""
            for line in r.iter_lines():
                if i < 10 and release.wait(0):
                    return  # the client goes away mid-stream
                if line.startswith("data: {"):
                    text += json.loads(line[6:])["choices"][0]["text"]
            done[i] = text

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(20)]
    for t in threads:
        t.start()
        time.sleep(0.02)  # the long ones (0-9) are admitted first and hold the slots
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        stats = httpx.get(url + "/v1/stats").json()
        if (stats["active"], stats["queued"]) == (8, 12):
            break
        time.sleep(0.05)
    assert (stats["active"], stats["queued"]) == (8, 12), stats
    r = httpx.post(url + "/v1/completions", json={"model": "gemma3-270m", "prompt": "x", "max_tokens": 2})
    assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
    assert r.json()["error"]["code"] == "rate_limit_exceeded"
    release.set()
    for t in threads[:10]:
        t.join(120)
    # the departed clients' sequences are gone: whatever is active now is of the 10 still listening
    stats = httpx.get(url + "/v1/stats").json()
    assert stats["active"] + stats["queued"] <= 10, stats
    for t in threads[10:]:
        t.join(900)
    assert done == want
    assert all(s == 200 for s in statuses) and len(statuses) == 20
    stats = httpx.get(url + "/v1/stats").json()
    assert stats["active"] == 0 and stats["queued"] == 0


@pytest.fixture(scope="module")
def smol(smol_f32, real_grid_f32, tmp_path_factory):
    """SmolLM2 with its chat template: the vindex's files plus a tokenizer_config.json from its GGUF (what the
    extractor writes; written here should this vindex predate it)."""
    import gguf
    from tokenizers import Tokenizer

    from larql_edge.tools.slicer.extract._source import _package_gguf

    vx = tmp_path_factory.mktemp("smol") / "smol.vindex"
    vx.mkdir()
    for f in smol_f32.iterdir():
        (vx / f.name).symlink_to(f)
    if not (smol_f32 / "tokenizer_config.json").is_file():
        reader = gguf.GGUFReader(str(_package_gguf("smollm2-135m")))
        field = reader.fields["tokenizer.chat_template"]
        tok = Tokenizer.from_file(str(smol_f32 / "tokenizer.json"))

        def token(key: str) -> str | None:
            f = reader.fields.get(key)
            return tok.id_to_token(int(f.parts[f.data[0]][0])) if f else None

        (vx / "tokenizer_config.json").write_text(json.dumps({
            "chat_template": bytes(field.parts[field.data[0]]).decode(),
            "bos_token": token("tokenizer.ggml.bos_token_id"), "eos_token": token("tokenizer.ggml.eos_token_id")}))
    g = real_grid_f32("smollm2-135m", smol_f32)  # layers 0-14 and 15-29
    with Procs(tmp_path_factory.mktemp("serve-smol")) as procs:
        s = _serve(procs, vx, g["router"].url, "--max-active", "2", "--context", "512")
        yield openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def test_streamed_chat_joins_to_the_non_streamed_answer(smol):
    model = smol.models.list().data[0].id
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    whole = smol.chat.completions.create(model=model, messages=msgs, max_tokens=24, temperature=0)
    text = whole.choices[0].message.content
    assert text and whole.choices[0].message.role == "assistant"
    assert "Paris" in text
    chunks = list(smol.chat.completions.create(model=model, messages=msgs, max_tokens=24, temperature=0, stream=True,
                                               stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == text
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens > 10
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason] == \
        [whole.choices[0].finish_reason]
    # logprobs: one entry per token, the greedy token the most likely
    lp = smol.chat.completions.create(model=model, messages=msgs, max_tokens=6, temperature=0, logprobs=True,
                                      top_logprobs=3)
    content = lp.choices[0].logprobs.content
    assert 1 <= len(content) <= 6
    assert all(abs(t.logprob - t.top_logprobs[0].logprob) < 1e-6 and len(t.top_logprobs) == 3 for t in content)
