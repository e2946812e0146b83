"""Structured output and tools, fast tier: the grammar module on a real byte-level BPE tokenizer (trained
in-test), the tool plans and parsers, and the tool replies' messages and stream deltas."""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest

from larql_edge.errors import BadRequest
from larql_edge.roles.serve import tools
from larql_edge.roles.serve.structured import ANY_OBJECT, Grammars, response_format_schema
from larql_edge.testing.schemas import SCHEMAS
from larql_edge.wire.embed import allowed_tokens, mask_words


@pytest.fixture(scope="module")
def tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [json.dumps(inst) for _, _, inst in SCHEMAS] * 5 + ["hello world, the weather is fine today"] * 5
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer)
    return tok


@pytest.fixture(scope="module")
def grammars(tokenizer):
    vocab = tokenizer.get_vocab_size() + 5  # a model vocabulary larger than the tokenizer's (padding rows)
    return Grammars(tokenizer, vocab, [tokenizer.token_to_id("<eos>")])


def _greedy_walk(g: Grammars, constraint, rng: np.random.Generator, limit: int = 300) -> list[int]:
    """Draw random allowed tokens (a real mask, a real matcher) until the grammar is complete."""
    out = []
    for _ in range(limit):
        ok = np.nonzero(allowed_tokens(constraint.mask(), g.vocab))[0]
        assert ok.size and ok.max() < g.vocab
        # Prefer short tokens that close structures, so a random walk ends: the last allowed often is '}'.
        t = int(rng.choice(ok))
        if g.eos[0] in ok and rng.random() < 0.5:
            break
        constraint.accept(t)
        out.append(t)
        if constraint.complete:
            break
    return out


@pytest.mark.parametrize("name,schema,instance", SCHEMAS, ids=[s[0] for s in SCHEMAS])
def test_the_valid_instance_is_allowed_token_by_token(tokenizer, grammars, name, schema, instance):
    c = grammars.json_schema(schema, "response_format")
    for t in tokenizer.encode(json.dumps(instance)).ids:
        mask = c.mask()
        assert mask is not None and mask.shape == (mask_words(grammars.vocab),)
        assert allowed_tokens(mask, grammars.vocab)[t], (name, tokenizer.decode([t]))
        c.accept(t)
    assert allowed_tokens(c.mask(), grammars.vocab)[grammars.eos[0]] or c.complete


def test_a_mask_refuses_what_breaks_the_schema(tokenizer, grammars):
    c = grammars.json_schema(dict(SCHEMAS[1][1]), "response_format")  # {"colour": enum}
    mask = c.mask()
    assert mask is not None
    allowed = allowed_tokens(mask, grammars.vocab)
    assert not allowed[tokenizer.token_to_id("<eos>")]  # nothing yet: the end is not allowed
    assert allowed.sum() < grammars.vocab / 4
    assert not allowed[grammars.vocab - 1]  # padding rows beyond the tokenizer: never


@pytest.mark.parametrize("seed", range(6))
def test_random_walks_through_the_masks_give_valid_json(tokenizer, grammars, seed):
    rng = np.random.default_rng(seed)
    name, schema, _ = SCHEMAS[seed * 3 % len(SCHEMAS)]
    c = grammars.json_schema(schema, "response_format")
    ids = _greedy_walk(grammars, c, rng)
    text = tokenizer.decode(ids)
    if c.complete or allowed_tokens(c.mask(), grammars.vocab)[grammars.eos[0]]:
        jsonschema.validate(json.loads(text), schema)


def test_a_grammar_that_allows_nothing_more_says_so(tokenizer, grammars):
    c = grammars.json_schema({"type": "boolean"}, "x")
    for t in tokenizer.encode("true").ids:
        c.accept(t)
    assert c.complete and c.mask() is not None and c.error is None  # the end (EOS) is still allowed
    with pytest.raises(RuntimeError):
        c.accept(tokenizer.encode("z").ids[0])  # a token the mask refused: the matcher's error state
    assert c.mask() is None and c.error and "no next token" in c.error


def test_unusable_schemas_are_a_400_naming_the_field(grammars):
    with pytest.raises(BadRequest) as e:
        grammars.json_schema({"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}, "response_format.json_schema.schema")
    assert e.value.param == "response_format.json_schema.schema"  # type: ignore[attr-defined]
    with pytest.raises(BadRequest):
        grammars.json_schema({"type": "no-such-type"}, "x")


def test_a_tokenizer_the_engine_cannot_index_is_a_400_naming_the_field():
    from tokenizers import Tokenizer, models

    g = Grammars(Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]")), 2, [0])
    for param, field in (("response_format.json_schema.schema", "response_format"), ("tools", "tool_choice")):
        with pytest.raises(BadRequest) as e:
            g.json_schema({"type": "object"}, param)
        assert e.value.param == field and e.value.code == "unsupported_value"  # type: ignore[attr-defined]


def test_response_format_forms():
    assert response_format_schema(None) is None
    assert response_format_schema({"type": "text"}) is None
    assert response_format_schema({"type": "json_object"}) == ANY_OBJECT
    s = {"type": "object", "properties": {"a": {"type": "integer"}}}
    assert response_format_schema({"type": "json_schema", "json_schema": {"name": "x", "schema": s, "strict": True}}) == s
    for bad, param in [("json", "response_format"), ({"type": "yaml"}, "response_format.type"),
                       ({"type": "json_schema"}, "response_format.json_schema"),
                       ({"type": "json_schema", "json_schema": {"schema": s}}, "response_format.json_schema.name"),
                       ({"type": "json_schema", "json_schema": {"name": "x", "schema": 3}}, "response_format.json_schema.schema"),
                       ({"type": "json_schema", "json_schema": {"name": "x", "strict": "yes"}},
                        "response_format.json_schema.strict")]:
        with pytest.raises(BadRequest) as e:
            response_format_schema(bad)
        assert e.value.param == param  # type: ignore[attr-defined]


# -- tools ---------------------------------------------------------------------------------------------

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather now",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
                                                "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}}}


def test_tool_plans_and_their_errors():
    assert tools.plan(None, None) is None
    assert tools.plan([WEATHER], None).choice == "auto"  # type: ignore[union-attr]
    p = tools.plan([WEATHER, TIME], {"type": "function", "function": {"name": "get_time"}})
    assert p is not None and p.forced and p.schema() == TIME["function"]["parameters"]
    r = tools.plan([WEATHER, TIME], "required")
    assert r is not None and r.schema()["type"] == "array" and len(r.schema()["items"]["anyOf"]) == 2
    assert r.schema()["maxItems"] == tools.MAX_PARALLEL_CALLS  # type: ignore[index]
    assert tools.plan([WEATHER], "required", False).schema()["maxItems"] == 1  # type: ignore[union-attr]
    with pytest.raises(BadRequest):
        tools.plan([WEATHER], "required", "no")
    cases = [(None, "required", "tool_choice"), ([], None, "tools"), ([{"type": "x"}], None, "tools[0]"),
             ([{"type": "function", "function": {"name": "a b"}}], None, "tools[0].function.name"),
             ([WEATHER, WEATHER], None, "tools[1].function.name"),
             ([{"type": "function", "function": {"name": "f", "parameters": []}}], None, "tools[0].function.parameters"),
             ([WEATHER], "sometimes", "tool_choice"),
             ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "tool_choice.function.name")]
    for ts, choice, param in cases:
        with pytest.raises(BadRequest) as e:
            tools.plan(ts, choice)
        assert e.value.param == param, (ts, choice)  # type: ignore[attr-defined]


def test_forced_schemas_generate_valid_calls(tokenizer, grammars):
    """``required`` over two tools: random walks through the real masks parse into calls whose
    arguments validate against their own function's parameters."""
    p = tools.plan([WEATHER, TIME], "required")
    assert p is not None
    schema = p.schema()
    assert schema is not None
    rng = np.random.default_rng(3)
    done = 0
    for _ in range(8):
        c = grammars.json_schema(schema, "tools")
        text = tokenizer.decode(_greedy_walk(grammars, c, rng, limit=400))
        if not c.complete:
            continue
        calls = tools.forced_calls(p, text)
        assert calls
        for call in calls:
            params = p.parameters(call["function"]["name"])
            jsonschema.validate(json.loads(call["function"]["arguments"]), params)
            assert call["id"].startswith("call_") and call["type"] == "function"
        done += 1
    assert done >= 1


def test_a_required_reply_ends_at_its_first_repeated_call():
    """Greedy small models list the same calls until max_tokens: the reply is whole when a call repeats
    an earlier one (same name and arguments), and is the calls before the repeat."""
    p = tools.plan([WEATHER, TIME], "required")
    assert p is not None
    a = '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "c"}}'
    b = '{"name": "get_time", "parameters": {"zone": "CET"}}'
    a2 = '{"name": "get_weather", "parameters": {"city": "Rome", "unit": "c"}}'
    assert not p.repeats(f"[{a}, {b}, {a2}")  # the same function with other arguments: a call of its own
    assert not p.repeats(f"[{a}, {b}, {a[:30]}")  # not whole yet
    assert p.repeats(f"[{a}, {b}, {a}")
    assert p.repeats(f"[{a}, {b}, {a}, {{")  # the token that closed the repeat began the next call
    longer = tools.forced_calls(p, f"[{a}, {b}, {a}, {{")
    assert longer is not None and [c["function"]["name"] for c in longer] == ["get_weather", "get_time"]
    assert p.repeats(f'[{a}, {a.replace(", ", ",")}')  # equal as JSON, whatever the spacing
    calls = tools.forced_calls(p, f"[{a}, {b}, {a}")
    assert calls is not None
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Paris", "unit": "c"}), ("get_time", {"zone": "CET"})]
    assert tools.forced_calls(p, f"[{a}, {b}, {a2[:40]}") is None  # cut by max_tokens: no calls
    msg, finish = tools.ToolReply(p, None).message(f"[{a}, {b}, {a}", "stop")
    assert finish == "tool_calls" and len(msg["tool_calls"]) == 2
    named = tools.plan([WEATHER], {"type": "function", "function": {"name": "get_weather"}})
    assert named is not None and not named.repeats(f"[{a}, {a}")  # only `required` lists calls


def test_auto_parsers_per_family():
    names = {"get_weather"}
    assert tools.syntax_of("{% for t in tools %}<tool_call>{% endfor %}") == "hermes"
    assert tools.syntax_of("[TOOL_CALLS]") == "mistral"
    assert tools.syntax_of("<|python_tag|>") == "llama3_json"
    assert tools.syntax_of("{{ messages }}") is None
    content, calls = tools.parse_auto("hermes", 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
                                      "</tool_call>", names)
    assert content == "Sure." and calls[0]["function"]["name"] == "get_weather"
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo"}
    _, calls = tools.parse_auto("mistral", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "A"}}]', names)
    assert len(calls) == 1
    content, calls = tools.parse_auto("llama3_json", '{"name": "get_weather", "parameters": {"city": "B"}}', names)
    assert content is None and json.loads(calls[0]["function"]["arguments"]) == {"city": "B"}
    # not calls: unknown function, broken JSON, prose
    for syntax, text in [("hermes", '<tool_call>{"name": "rm", "arguments": {}}</tool_call>'),
                         ("hermes", "<tool_call>{oops</tool_call>"), ("llama3_json", "It is sunny."),
                         ("mistral", "[TOOL_CALLS] nope"), (None, '{"name": "get_weather", "parameters": {}}')]:
        assert tools.parse_auto(syntax, text, names) == (text, [])


def test_tool_reply_named_function_streams_arguments_as_openai_does():
    p = tools.plan([WEATHER], {"type": "function", "function": {"name": "get_weather"}})
    assert p is not None
    r = tools.ToolReply(p, None)
    deltas = r.delta('{"city": ') + r.delta('"Oslo", "unit": "c"}')
    rest, finish = r.close("stop")
    deltas += rest
    assert finish == "tool_calls"
    first = deltas[0]["tool_calls"][0]
    assert first["index"] == 0 and first["id"].startswith("call_") and first["type"] == "function"
    assert first["function"] == {"name": "get_weather", "arguments": ""}
    args = "".join(d["tool_calls"][0]["function"]["arguments"] for d in deltas[1:])
    assert json.loads(args) == {"city": "Oslo", "unit": "c"}
    assert all(set(d["tool_calls"][0]) == {"index", "function"} for d in deltas[1:])
    msg, fin = tools.ToolReply(p, None).message(args, "stop")
    assert fin == "tool_calls" and msg["content"] is None
    assert msg["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": args}
    # cut by max_tokens: the arguments are not whole JSON; the finish stays "length"
    cut = tools.ToolReply(p, None)
    cut.delta('{"city": "Os')
    assert cut.close("length")[1] == "length"


def test_tool_reply_required_and_auto_hold_the_text_then_send_calls():
    p = tools.plan([WEATHER, TIME], "required")
    assert p is not None
    r = tools.ToolReply(p, None)
    text = '[{"name": "get_time", "parameters": {"zone": "UTC"}}, {"name": "get_weather", "parameters": {"city": "X", "unit": "f"}}]'
    assert r.delta(text[:20]) == [] and r.delta(text[20:]) == []
    deltas, finish = r.close("stop")
    assert finish == "tool_calls" and len(deltas) == 4
    assert [d["tool_calls"][0]["index"] for d in deltas] == [0, 0, 1, 1]
    assert deltas[0]["tool_calls"][0]["function"] == {"name": "get_time", "arguments": ""}
    assert json.loads(deltas[3]["tool_calls"][0]["function"]["arguments"]) == {"city": "X", "unit": "f"}
    auto = tools.plan([WEATHER], "auto")
    assert auto is not None
    plain = tools.ToolReply(auto, None)  # a family without a syntax: text streams as always
    assert plain.delta("hi") == [{"content": "hi"}] and plain.close("stop") == ([], "stop")
    hermes = tools.ToolReply(auto, "hermes")
    assert hermes.delta("It is ") == [] and hermes.delta("sunny.") == []
    assert hermes.close("stop") == ([{"content": "It is sunny."}], "stop")
    none = tools.ToolReply(tools.plan([WEATHER], "none"), "hermes")  # type: ignore[arg-type]
    assert none.message('<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>', "stop")[1] == "stop"
