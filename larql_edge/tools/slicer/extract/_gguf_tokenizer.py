"""Build a Hugging Face ``tokenizers.Tokenizer`` from a GGUF file's tokenizer metadata.

A GGUF file ships no ``tokenizer.json``: the vocabulary, scores, token types, merges and special token
ids live in metadata keys under llama.cpp's names (``tokenizer.ggml.*``). This module rebuilds the
fast tokenizer the way Hugging Face transformers does when it loads a GGUF file
(``transformers/integrations/ggml.py``: ``GGUFLlamaConverter``, ``GGUFGemmaConverter``,
``GGUFGPTConverter``, on top of ``convert_slow_tokenizer``), so that the ``tokenizer.json`` written
next to a vindex tokenizes exactly like the reference:

* ``tokenizer.ggml.model == "llama"`` (sentencepiece BPE): a ``BPE`` model with ``byte_fallback``,
  whose merges are derived from the vocabulary (the file carries none), ordered by the merged
  piece's score -- or by its vocabulary position for Gemma, whose scores are ranks with every
  control/user-defined piece punched out at -1000.
  Gemma: normalizer ``Replace(" ", "▁")``, no prefix space, decoder ``Replace, ByteFallback, Fuse``.
  Other sentencepiece vocabularies (Llama 2, Mistral v0.1, ...): the non-legacy shape,
  ``Metaspace`` pre-tokenizer, decoder ``ByteFallback, Fuse, Replace`` (+ ``Strip`` with a prefix
  space).
* ``tokenizer.ggml.model == "gpt2"`` (byte-level BPE): the file's merges, ``ByteLevel``
  pre-tokenizer (preceded by the split ``tokenizer.ggml.pre`` names) and decoder.

Control tokens (token type 3, plus BOS/EOS/UNK/PAD when they look like markers) become special
added tokens. User-defined tokens (type 4) become ordinary added tokens matched on the raw text, as
``convert_slow_tokenizer.SpmConverter`` registers them (and as sentencepiece and llama.cpp take them
whole): Gemma's ``\n\n``, ``\t\t`` and ``<table>`` pieces; its whitespace-run pieces (``▁▁``...) are
reached through the BPE merges, exactly as in transformers. The one place this departs from
transformers' GGUF loader (which registers no user-defined tokens) is text containing those HTML-tag
pieces: ``<td>`` is one token here, ``<`` ``td`` ``>`` there.

BOS/EOS are added by a ``TemplateProcessing`` post-processor when ``tokenizer.ggml.add_bos_token`` /
``add_eos_token`` say so (sentencepiece files default to BOS, byte-level ones to none).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import gguf
from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers, processors
from tokenizers.models import BPE

__all__ = ["read_gguf_metadata", "tokenizer_from_gguf", "SUPPORTED_TOKENIZER_MODELS"]

log = logging.getLogger(__name__)

SUPPORTED_TOKENIZER_MODELS = ("gpt2", "llama")

# llama.cpp token types (llama_token_type), from gguf-py.
_TT_NORMAL = int(gguf.TokenType.NORMAL)
_TT_UNKNOWN = int(gguf.TokenType.UNKNOWN)
_TT_CONTROL = int(gguf.TokenType.CONTROL)
_TT_USER_DEFINED = int(gguf.TokenType.USER_DEFINED)

_SPIECE_UNDERLINE = "\u2581"


# --------------------------------------------------------------------------------------------------
# GGUF metadata
# --------------------------------------------------------------------------------------------------


def _field_value(field: Any) -> Any:
    """One ``gguf.ReaderField`` as a plain Python value (str, int, float, bool or list of them).

    ``ReaderField.contents()`` already does this, and does it fast (~0.2 s for all of Gemma's
    262,144-entry token, score and type arrays). It decodes strings strictly; a file holding an
    invalid UTF-8 sequence (a token that is a partial byte sequence) gets U+FFFD instead of an error.
    """
    if not field.types:
        return None
    try:
        return field.contents()
    except UnicodeDecodeError:
        import gguf  # only for the value-type enum

        if field.types[0] == gguf.GGUFValueType.STRING:
            return bytes(field.parts[-1]).decode("utf-8", errors="replace")
        return [bytes(field.parts[i]).decode("utf-8", errors="replace") for i in field.data]


def read_gguf_metadata(reader: gguf.GGUFReader, prefix: str = "") -> dict[str, Any]:
    """Metadata of a ``gguf.GGUFReader`` whose key starts with ``prefix``, as plain Python values.

    Strings are ``str``, integers ``int``, floats ``float``, booleans ``bool`` and arrays ``list``s of
    those (e.g. ``tokenizer.ggml.tokens`` -> ``list[str]``). The reader's pseudo-fields
    (``GGUF.version``, ``GGUF.tensor_count``, ``GGUF.kv_count``) are included when the prefix
    selects them.
    """
    out: dict[str, Any] = {}
    for name, field in reader.fields.items():
        if not name.startswith(prefix):
            continue
        out[name] = _field_value(field)
    return out


# --------------------------------------------------------------------------------------------------
# Helpers shared by both models
# --------------------------------------------------------------------------------------------------


def _opt_id(meta: Mapping[str, Any], key: str, n_vocab: int) -> int | None:
    value = meta.get(f"tokenizer.ggml.{key}")
    if value is None:
        return None
    value = int(value)
    if value < 0 or value >= n_vocab:  # llama.cpp writes -1 / out-of-range ids for "none"
        return None
    return value


def _post_processor(
    tokens: Sequence[str], bos_id: int | None, eos_id: int | None, add_bos: bool, add_eos: bool
) -> processors.PostProcessor | None:
    """``LlamaTokenizerFast``'s template: ``[bos] $A [eos]`` (and ``[bos] $B [eos]`` for pairs)."""
    if not ((add_bos and bos_id is not None) or (add_eos and eos_id is not None)):
        return None
    add_bos, add_eos = bool(add_bos) and bos_id is not None, bool(add_eos) and eos_id is not None
    bos = tokens[bos_id] if bos_id is not None else ""
    eos = tokens[eos_id] if eos_id is not None else ""
    single: list[str] = []
    pair: list[str] = []
    if add_bos:
        single.append(f"{bos}:0")
    single.append("$A:0")
    if add_eos:
        single.append(f"{eos}:0")
    pair = list(single)
    if add_bos:
        pair.append(f"{bos}:1")
    pair.append("$B:1")
    if add_eos:
        pair.append(f"{eos}:1")
    special: list[tuple[str, int]] = []
    if add_bos and bos_id is not None:
        special.append((bos, bos_id))
    if add_eos and eos_id is not None and (not add_bos or eos != bos):
        special.append((eos, eos_id))
    return processors.TemplateProcessing(single=" ".join(single), pair=" ".join(pair), special_tokens=special)


def _token_types(meta: Mapping[str, Any], n_vocab: int) -> list[int]:
    types = meta.get("tokenizer.ggml.token_type")
    if types is None:
        return [_TT_NORMAL] * n_vocab
    types = [int(t) for t in types]
    if len(types) != n_vocab:
        raise ValueError(
            f"tokenizer.ggml.token_type has {len(types)} entries for {n_vocab} tokens"
        )
    return types


def _marks_special(token: str, kind: int) -> bool:
    """Whether a token named as BOS/EOS/UNK/PAD is a marker (and so a special token), not a word.

    Some files point the padding id at an ordinary piece (``!``, id 0); that one must stay text.
    """
    if kind in (_TT_CONTROL, _TT_UNKNOWN):
        return True
    if kind not in (_TT_NORMAL, 0):
        return False
    return len(token) > 2 and ((token[0] == "<" and token[-1] == ">") or (token[0] == "[" and token[-1] == "]"))


def _register_added_tokens(
    tokenizer: Tokenizer,
    keys: Sequence[str],
    types: Sequence[int],
    *,
    extra_special: Sequence[int] = (),
    user_defined_ok: Any = None,
) -> None:
    """Control tokens (and ``extra_special`` ids) as special added tokens; user-defined as plain ones.

    ``keys`` are the strings the model vocabulary holds, so each added token maps onto its own id.
    """
    special_ids = {i for i, t in enumerate(types) if t == _TT_CONTROL}
    special_ids.update(i for i in extra_special if i is not None)
    special = [AddedToken(keys[i], normalized=False, special=True) for i in sorted(special_ids)]
    user = [
        AddedToken(keys[i], normalized=False, special=False)
        for i, t in enumerate(types)
        if t == _TT_USER_DEFINED and i not in special_ids and (user_defined_ok is None or user_defined_ok(keys[i]))
    ]
    if special:
        tokenizer.add_special_tokens(special)
    if user:
        tokenizer.add_tokens(user)


# --------------------------------------------------------------------------------------------------
# sentencepiece BPE ("llama")
# --------------------------------------------------------------------------------------------------


def _is_gemma_vocabulary(tokens: Sequence[str]) -> bool:
    """Gemma's giveaway: runs of spaces written as spaces, where sentencepiece writes ``▁``."""
    return any(" " in t and not t.strip() for t in tokens if t)


def _spm_merges(
    keys: Sequence[str], scores: Sequence[float], types: Sequence[int], rank: Sequence[float]
) -> list[tuple[str, str]]:
    """BPE merges that reproduce sentencepiece's BPE from its vocabulary.

    sentencepiece merges, at every step, the adjacent pair whose concatenation is the best-scored
    piece in the vocabulary. As a merge list that is: every split ``piece = left + right`` of every
    vocabulary piece with both halves in the vocabulary, ordered by the merged piece's ``rank``
    (higher first), ties between splits of one piece broken by ``(score[left], score[right])``
    (higher first) and then by split position -- the order transformers' ``GGUFTokenizerSkeleton``
    produces. Only pieces sentencepiece can reach by merging take part: normal and user-defined
    ones, never control, unused or byte (``<0x41>``) pieces.

    Cost: one dict lookup per split of every piece (sum of piece lengths, ~2M for Gemma's 262k
    vocabulary) and one sort of the candidate merges -- linear-ish, not quadratic.
    """
    mergeable = {}
    for i, (key, kind) in enumerate(zip(keys, types, strict=True)):
        if kind in (_TT_NORMAL, _TT_USER_DEFINED, 0) and key:
            mergeable[key] = i  # last one wins, as in the model's vocabulary dict
    candidates: list[tuple[float, int, float, float, int, str, str]] = []
    append = candidates.append
    get = mergeable.get
    for piece, i in mergeable.items():
        n = len(piece)
        if n < 2:
            continue
        r = -rank[i]
        for cut in range(1, n):
            left = piece[:cut]
            li = get(left)
            if li is None:
                continue
            right = piece[cut:]
            ri = get(right)
            if ri is None:
                continue
            append((r, i, -scores[li], -scores[ri], cut, left, right))
    candidates.sort()
    return [(c[5], c[6]) for c in candidates]


def _spm_tokenizer(meta: Mapping[str, Any]) -> Tokenizer:
    raw_tokens = list(meta["tokenizer.ggml.tokens"])
    n = len(raw_tokens)
    types = _token_types(meta, n)
    scores_in = meta.get("tokenizer.ggml.scores")
    gemma = _is_gemma_vocabulary(raw_tokens)

    if gemma:
        # llama.cpp writes Gemma's whitespace-run pieces with real spaces; the sentencepiece model
        # (and the normalized text the BPE sees) spell them with ``▁``.
        keys = [_SPIECE_UNDERLINE * len(t) if (t and " " in t and not t.strip()) else t for t in raw_tokens]
    else:
        keys = raw_tokens

    if scores_in is None:
        # No scores: the vocabulary order is the merge order.
        scores = [float(-i) for i in range(n)]
    else:
        scores = [float(s) for s in scores_in]
        if len(scores) != n:
            raise ValueError(f"tokenizer.ggml.scores has {len(scores)} entries for {n} tokens")

    merges_in = meta.get("tokenizer.ggml.merges")
    if merges_in:
        merges = [_split_merge(m) for m in merges_in]
    else:
        # Gemma's scores are merge ranks (-index) with every control/user-defined piece at -1000, so
        # its vocabulary position is the rank; elsewhere the scores are sentencepiece log-probs.
        rank = [float(-i) for i in range(n)] if gemma else scores
        merges = _spm_merges(keys, scores, types, rank)

    unk_id = _opt_id(meta, "unknown_token_id", n)
    bos_id = _opt_id(meta, "bos_token_id", n)
    eos_id = _opt_id(meta, "eos_token_id", n)
    pad_id = _opt_id(meta, "padding_token_id", n)
    if unk_id is None:
        unk_id = next((i for i, t in enumerate(types) if t == _TT_UNKNOWN), None)

    vocab = {key: i for i, key in enumerate(keys)}
    tokenizer = Tokenizer(
        BPE(
            vocab,
            merges,
            unk_token=keys[unk_id] if unk_id is not None else None,
            fuse_unk=True,
            byte_fallback=True,
        )
    )

    add_prefix_space = bool(meta.get("tokenizer.ggml.add_space_prefix", not gemma))
    if gemma:
        # GemmaConverter: spaces become ``▁`` in the normalizer; its ``Split(" ")`` pre-tokenizer
        # is a no-op after that and is left out; no prefix space.
        tokenizer.normalizer = normalizers.Replace(" ", _SPIECE_UNDERLINE)
        dec = [decoders.Replace(_SPIECE_UNDERLINE, " "), decoders.ByteFallback(), decoders.Fuse()]
    else:
        # LlamaConverter, non-legacy: no normalizer, a Metaspace pre-tokenizer.
        tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(
            replacement=_SPIECE_UNDERLINE, prepend_scheme="first" if add_prefix_space else "never", split=False
        )
        dec = [decoders.ByteFallback(), decoders.Fuse(), decoders.Replace(_SPIECE_UNDERLINE, " ")]
    if add_prefix_space:
        dec.append(decoders.Strip(content=" ", left=1, right=0))
    tokenizer.decoder = decoders.Sequence(dec)

    # As SpmConverter registers them: matched on the raw text (normalized=False). Gemma's ``▁▁``...
    # pieces therefore never match spaces -- runs of spaces are merged by the BPE, as transformers
    # does -- while ``\n\n``, ``\t`` and ``<table>`` are taken whole.
    extra = [i for i in (unk_id, bos_id, eos_id, pad_id) if i is not None and _marks_special(keys[i], types[i])]
    _register_added_tokens(tokenizer, keys, types, extra_special=extra)

    post = _post_processor(
        keys,
        bos_id,
        eos_id,
        bool(meta.get("tokenizer.ggml.add_bos_token", True)),
        bool(meta.get("tokenizer.ggml.add_eos_token", False)),
    )
    if post is not None:
        tokenizer.post_processor = post
    return tokenizer


def _split_merge(merge: str) -> tuple[str, str]:
    left, sep, right = merge.partition(" ")
    if not sep or not left or not right or " " in right:
        raise ValueError(f"malformed merge {merge!r} in tokenizer.ggml.merges")
    return left, right


# --------------------------------------------------------------------------------------------------
# byte-level BPE ("gpt2")
# --------------------------------------------------------------------------------------------------


_BYTE_ENCODER: dict[int, str] = gguf.bytes_to_unicode()  # the reversible byte -> character map of GPT-2
_BYTE_LEVEL_ALPHABET = frozenset(_BYTE_ENCODER.values())

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# ``tokenizer.ggml.pre`` -> regex applied before a (regex-free) ByteLevel. Names llama.cpp gives
# tokenizers whose split differs from GPT-2's.
_PRE_SPLITS = {
    **dict.fromkeys(
        ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "dbrx", "smaug-bpe", "lfm2"),
        _LLAMA3_SPLIT,
    ),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez"), _QWEN2_SPLIT),
    **dict.fromkeys(("gpt-4o", "llama4"), _GPT4O_SPLIT),
    "tekken": _TEKKEN_SPLIT,
}
# GPT-2's split with every digit on its own (llama.cpp's "\p{N}" + GPT-2 regex; Hugging Face's
# ``Digits(individual_digits=True)`` + ``ByteLevel``).
_PRE_DIGITS = frozenset(("smollm", "starcoder", "refact", "codeshell", "exaone", "minerva"))
# llama.cpp names whose split is GPT-2's own (``default``: what transformers applies to any file).
_PRE_GPT2 = frozenset(("", "default", "gpt2", "gpt-2", "mpt", "olmo", "jais", "trillion"))


def _byte_level_pre_tokenizer(pre: str | None) -> pre_tokenizers.PreTokenizer:
    pre = (pre or "").lower()
    split = _PRE_SPLITS.get(pre)
    if split is not None:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
            ]
        )
    if pre in _PRE_DIGITS:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    if pre not in _PRE_GPT2:
        log.warning("tokenizer.ggml.pre %r is not known here; using GPT-2's pre-tokenizer split", pre)
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _byte_level_tokenizer(meta: Mapping[str, Any]) -> Tokenizer:
    raw_tokens = list(meta["tokenizer.ggml.tokens"])
    n = len(raw_tokens)
    types = _token_types(meta, n)
    merges_in = meta.get("tokenizer.ggml.merges")
    if not merges_in:
        raise ValueError("a 'gpt2' GGUF tokenizer needs tokenizer.ggml.merges")
    merges = [_split_merge(m) for m in merges_in]

    # llama.cpp writes the vocabulary in GPT-2's byte-level spelling, except tokens it could not
    # map (and user-defined ones), which come raw: respell those so the merges can name them.
    def spelled(token: str) -> str:
        if set(token) <= _BYTE_LEVEL_ALPHABET:
            return token
        return "".join(_BYTE_ENCODER[b] for b in token.encode("utf-8"))

    keys = [spelled(t) for t in raw_tokens]
    vocab = {key: i for i, key in enumerate(keys)}
    tokenizer = Tokenizer(
        BPE(vocab, merges, dropout=None, continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False)
    )
    tokenizer.pre_tokenizer = _byte_level_pre_tokenizer(meta.get("tokenizer.ggml.pre"))
    tokenizer.decoder = decoders.ByteLevel()

    bos_id = _opt_id(meta, "bos_token_id", n)
    eos_id = _opt_id(meta, "eos_token_id", n)
    # A token llama.cpp respelled is a byte sequence, not a marker: registering it as an added token
    # would give it a second id, so only tokens already in byte-level spelling are registered.
    raw_ok = {k for k, t in zip(keys, raw_tokens, strict=True) if k == t}
    control_types = [
        t if (t != _TT_CONTROL or keys[i] in raw_ok) else _TT_NORMAL for i, t in enumerate(types)
    ]
    extra = [
        i
        for i in (bos_id, eos_id, _opt_id(meta, "unknown_token_id", n), _opt_id(meta, "padding_token_id", n))
        if i is not None and keys[i] in raw_ok and _marks_special(keys[i], types[i])
    ]
    _register_added_tokens(
        tokenizer, keys, control_types, extra_special=extra, user_defined_ok=lambda k: k in raw_ok
    )

    post = _post_processor(
        keys,
        bos_id,
        eos_id,
        bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        bool(meta.get("tokenizer.ggml.add_eos_token", False)),
    )
    # GPT2Converter: without BOS a ByteLevel post-processor (trim_offsets=False: offsets only).
    tokenizer.post_processor = post if post is not None else processors.ByteLevel(trim_offsets=False)
    return tokenizer


# --------------------------------------------------------------------------------------------------
# Entry point
# --------------------------------------------------------------------------------------------------


def tokenizer_from_gguf(meta: Mapping[str, Any]) -> Tokenizer:
    """The fast tokenizer a GGUF file's ``tokenizer.ggml.*`` metadata describes.

    ``meta`` maps GGUF metadata keys to plain Python values (see :func:`read_gguf_metadata`).
    Supported ``tokenizer.ggml.model`` values: ``"llama"`` (sentencepiece BPE, Gemma included) and
    ``"gpt2"`` (byte-level BPE). Anything else is a ``ValueError`` naming it.
    """
    model = meta.get("tokenizer.ggml.model")
    if model not in SUPPORTED_TOKENIZER_MODELS:
        raise ValueError(
            f"unsupported GGUF tokenizer model {model!r} (tokenizer.ggml.model); "
            f"supported: {', '.join(SUPPORTED_TOKENIZER_MODELS)}"
        )
    if not meta.get("tokenizer.ggml.tokens"):
        raise ValueError("GGUF metadata has no tokenizer.ggml.tokens")
    if model == "llama":
        return _spm_tokenizer(meta)
    return _byte_level_tokenizer(meta)
