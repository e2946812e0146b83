"""Structured output and tools on the real models, slow tier: the unmodified `openai` client against larql-serve
in front of a real grid of processes (router, two FFN shards, embed server), Gemma 3 270M and SmolLM2-135M.

Every reply of a ``json_schema`` request is validated with `jsonschema` against its own schema (20 varied
schemas, each streamed on one model and whole on the other); forced tool calls' arguments against their function's parameters."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import openai
import pytest

from larql_edge.testing.schemas import PROMPTS, SCHEMAS
from tests._grid import Procs

# A 20-schema round is minutes of decoding on a shared 2-core machine: beyond the suite's 900 s default.
pytestmark = [pytest.mark.real_model, pytest.mark.multiprocess, pytest.mark.timeout(3600)]

# Gemma 3's instruction format (its packaged GGUF carries no chat template); tools are listed the way a
# template that knows no tool syntax would see them: not at all (they still constrain the forced calls).
GEMMA_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% set role = 'model' if m['role'] == 'assistant' else 'user' %}"
                  "<start_of_turn>{{ role }}\n{{ m['content'] | trim }}<end_of_turn>\n{% endfor %}"
                  "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
MAX_TOKENS = 200


@pytest.fixture(scope="module", params=["gemma3-270m", "smollm2-135m"])
def served(request, tmp_path_factory, real_grid_f32):
    alias = request.param
    vindex = request.getfixturevalue("gemma_f32" if alias.startswith("gemma") else "smol_f32")
    root = tmp_path_factory.mktemp(f"structured-{alias}")
    extra: list[str] = []
    if alias.startswith("gemma"):
        (root / "gemma.jinja").write_text(GEMMA_TEMPLATE)
        extra = ["--chat-template", str(root / "gemma.jinja")]
    g = real_grid_f32(alias, vindex)  # its layers in 2 even ranges
    with Procs(root) as procs:
        s = procs.start("serve", "larql-serve", str(vindex), "--ffn", g["router"].url, "--blas-threads", "1",
                        "--served-model-name", alias, "--max-active", "8", "--context", "1024", *extra)
        s.wait_ready(300)
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=600)
        yield {"client": client, "url": s.url, "model": alias}


def _fmt(name: str, schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


def _chat(c: openai.OpenAI, model: str, prompt: str, stream: bool, max_tokens: int = MAX_TOKENS, **kw):
    """(content, finish_reason, tool_calls) of one chat reply; a stream's deltas joined."""
    msgs = [{"role": "user", "content": prompt}]
    if not stream:
        r = c.chat.completions.create(model=model, messages=msgs, max_tokens=max_tokens, temperature=0, **kw)
        ch = r.choices[0]
        calls = [{"id": t.id, "name": t.function.name, "arguments": t.function.arguments} for t in ch.message.tool_calls or []]
        return ch.message.content, ch.finish_reason, calls
    text, finish, calls = [], None, {}
    for chunk in c.chat.completions.create(model=model, messages=msgs, max_tokens=max_tokens, temperature=0,
                                           stream=True, **kw):
        if not chunk.choices:
            continue
        d = chunk.choices[0].delta
        if d.content:
            text.append(d.content)
        for tc in d.tool_calls or []:
            entry = calls.setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
            if tc.id:
                assert entry["id"] is None  # the id comes once, in the call's first delta
                entry["id"] = tc.id
            if tc.function and tc.function.name:
                entry["name"] = tc.function.name
            if tc.function and tc.function.arguments:
                entry["arguments"] += tc.function.arguments
        finish = chunk.choices[0].finish_reason or finish
    return "".join(text) or None, finish, [calls[i] for i in sorted(calls)]


def test_json_schema_strict_replies_validate_on_20_schemas(served):
    """Half the schemas streamed, half whole, the other halves on the other model: every schema both
    ways across the two models, in one round of 20 replies per model (two rounds took ~2 min more)."""
    c, model = served["client"], served["model"]
    first_streamed = 0 if model.startswith("gemma") else 1

    def one(item):
        i, (name, schema, _) = item
        stream = i % 2 == first_streamed
        content, finish, calls = _chat(c, model, PROMPTS[name] + " Answer in JSON.", stream,
                                       response_format=_fmt(name, schema))
        return name, stream, schema, content, finish, calls

    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(one, enumerate(SCHEMAS)))
    assert len(got) == 20 and sum(g[1] for g in got) == 10
    for name, stream, schema, content, finish, calls in got:
        assert finish == "stop" and not calls, (name, stream, finish, content)
        jsonschema.validate(json.loads(content), schema)


def test_json_object_and_completions_take_response_format(served):
    c, model = served["client"], served["model"]
    cat = "Describe a cat as a JSON object with the keys name and age."
    content, finish, _ = _chat(c, model, cat, False, response_format={"type": "json_object"})
    assert finish == "stop" and isinstance(json.loads(content), dict)
    content, finish, _ = _chat(c, model, cat, True, response_format={"type": "json_object"})
    assert finish == "stop" and isinstance(json.loads(content), dict)
    name, schema, _ = SCHEMAS[7]  # order: nested objects in an array, bounded integers
    r = c.completions.create(model=model, prompt="A shop order as JSON: ", max_tokens=MAX_TOKENS, temperature=0,
                             extra_body={"response_format": _fmt(name, schema)})
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].text), schema)
    # a schema the engine cannot enforce, and a malformed response_format: 400s naming the field
    for rf, param in [({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}},
                       "response_format.json_schema.schema"),
                      ({"type": "xml"}, "response_format.type")]:
        r2 = httpx.post(served["url"] + "/v1/chat/completions", timeout=60,
                        json={"model": model, "messages": [{"role": "user", "content": "x"}], "response_format": rf})
        assert r2.status_code == 400 and r2.json()["error"]["param"] == param, r2.text


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a time zone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 30}},
                   "required": ["zone"], "additionalProperties": False}}}
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, CLOCK)}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("choice", ["named", "required", "required-one"])
def test_a_forced_tool_call_has_arguments_that_validate(served, stream, choice):
    c, model = served["client"], served["model"]
    tool_choice = {"type": "function", "function": {"name": "get_weather"}} if choice == "named" else "required"
    # `required` with parallel calls allowed: greedy Gemma 3 270M lists the same two calls over and over;
    # the reply ends at the first repeat (tools.ToolPlan.repeats), with distinct calls only.
    extra = {"parallel_tool_calls": False} if choice == "required-one" else {}
    content, finish, calls = _chat(c, model, "What is the weather in Paris?", stream, tools=[WEATHER, CLOCK],
                                   tool_choice=tool_choice, **extra)
    assert finish == "tool_calls" and calls and content is None, (finish, content, calls)
    assert choice != "required-one" or len(calls) == 1, calls
    assert len({(call["name"], json.dumps(json.loads(call["arguments"]), sort_keys=True)) for call in calls}) == len(calls)
    for call in calls:
        assert call["id"].startswith("call_")
        if choice == "named":
            assert call["name"] == "get_weather"
        jsonschema.validate(json.loads(call["arguments"]), PARAMS[call["name"]])


def test_auto_without_a_family_syntax_answers_text_and_none_never_calls(served):
    c, model = served["client"], served["model"]
    for choice in ("auto", "none"):
        content, finish, calls = _chat(c, model, "Say hello.", False, tools=[WEATHER], tool_choice=choice, max_tokens=8)
        assert content and not calls and finish in ("stop", "length")
