"""The built-in chat templates (larql_edge/roles/serve/chat_defaults.py) render what the families'
published templates render (copies in tests/data/chat_templates/, with where they come from), and
they are used only when a vindex has none and its tokenizer has the family's turn tokens."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from larql_edge.errors import BadRequest
from larql_edge.roles.serve.chat import ChatTemplate, load_chat_template
from larql_edge.roles.serve.chat_defaults import CHATML, GEMMA3, default_chat

DATA = Path(__file__).parent / "data" / "chat_templates"

CONVERSATIONS = [
    [{"role": "user", "content": "hi"}],
    [{"role": "user", "content": "  What is the capital of France?\n"}],
    [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "Capital of France?"}],
    [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": " 4 "}, {"role": "user", "content": "and 3+3?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
     {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": ""}],
    [{"role": "user", "content": "Ünïcödé, emoji 🙂 and {{ braces }} {% raw %}"}],
]


def published(name: str) -> ChatTemplate:
    d = json.loads((DATA / name).read_text())
    return ChatTemplate(d["chat_template"], d.get("bos_token"), None, origin=d["source"])


@pytest.mark.parametrize("builtin,name,bos", [(GEMMA3, "gemma-3-it.json", "<bos>"),
                                              (CHATML, "smollm2-instruct.json", "<|im_start|>")])
@pytest.mark.parametrize("messages", CONVERSATIONS, ids=range(len(CONVERSATIONS)))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_a_builtin_renders_what_the_family_publishes(builtin, name, bos, messages, add_generation_prompt):
    ours = ChatTemplate(builtin.source, bos, None, origin=builtin.name)
    want = published(name).render(messages, add_generation_prompt)
    assert ours.render(messages, add_generation_prompt) == want


def test_gemma_refuses_what_its_published_template_refuses():
    ours, theirs = ChatTemplate(GEMMA3.source, "<bos>"), published("gemma-3-it.json")
    for messages in ([{"role": "assistant", "content": "x"}],
                     [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]):
        for t in (ours, theirs):
            with pytest.raises(BadRequest, match="alternate"):
                t.render(messages)


def _tokenizer(*special: str):
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "hi": 1}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(list(special))
    return tok


def test_the_builtin_is_chosen_by_family_and_turn_tokens(tmp_path):
    gemma_tok = _tokenizer("<bos>", "<start_of_turn>", "<end_of_turn>")
    chatml_tok = _tokenizer("<|im_start|>", "<|im_end|>")
    assert default_chat("gemma3", gemma_tok) is GEMMA3
    assert default_chat("llama", chatml_tok) is CHATML
    assert default_chat("llama", gemma_tok) is None  # no guess across families
    assert default_chat("gemma3", _tokenizer("<bos>")) is None  # nor without the turn tokens
    # A vindex without a template gets the built-in; its own template or --chat-template wins.
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<bos>", "chat_template": None}))
    t = load_chat_template(tmp_path, None, gemma_tok, "gemma3")
    assert t is not None and t.origin == "built-in gemma3 template" and t.end_of_turn == "<end_of_turn>"
    assert t.render([{"role": "user", "content": "hi"}]) == "<bos><start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "own {{ messages[0]['content'] }}"}))
    assert load_chat_template(tmp_path, None, gemma_tok, "gemma3").render([{"role": "user", "content": "x"}]) == "own x"
    override = tmp_path / "t.jinja"
    override.write_text("file")
    assert load_chat_template(tmp_path, str(override), gemma_tok, "gemma3").render([]) == "file"


def test_the_copy_of_smollm2s_template_is_the_one_its_gguf_carries(smol_f32):
    """The test data is what the installed model package publishes, not a hand-made copy."""
    cfg = json.loads((Path(smol_f32) / "tokenizer_config.json").read_text())
    assert cfg["chat_template"] == json.loads((DATA / "smollm2-instruct.json").read_text())["chat_template"]


def test_gemma_270m_gets_the_builtin_and_stops_at_end_of_turn(gemma_f16):
    from larql_edge.format.vindex import Vindex
    from larql_edge.roles.serve.app import served_model

    vx = Vindex.open(gemma_f16)
    tok = vx.load_tokenizer()
    served = served_model(vx, tok, 512, None)
    assert served.chat_template is not None and served.chat_template.origin == "built-in gemma3 template"
    assert tok.token_to_id("<end_of_turn>") in served.eos_ids
