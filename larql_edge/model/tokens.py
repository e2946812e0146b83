"""Tokenizing text in a server without stalling it.

`tokenizers`' ``Tokenizer.encode`` holds the GIL for the whole call (a 3.9 MB prompt: seconds in which
the event loop answers nothing, not even ``/v1/health``), while ``encode_batch`` releases it: `encode`
goes through the batch call with one text. `TextBound` refuses, before any tokenizing, a text so long
that it cannot fit a token budget whatever it encodes to.
"""

from __future__ import annotations

from typing import Any

# A normalizer may compose characters before the model sees them (NFC: e + U+0301 -> é, Hangul jamo
# L+V+T -> one syllable), so one token may stand for a few more input characters than its piece has.
_COMPOSITION = 4


def encode(tokenizer: Any, text: str, add_special_tokens: bool = True) -> list[int]:
    """``tokenizer.encode(text).ids``, with the GIL released while the tokenizer works."""
    return tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids


class TextBound:
    """The most input characters ``n`` tokens can stand for: the longest piece of the vocabulary (added
    tokens included) times the composition margin. A text longer than that is more than ``n`` tokens."""

    def __init__(self, tokenizer: Any):
        vocab = tokenizer.get_vocab(with_added_tokens=True)
        self.chars_per_token = _COMPOSITION * max((len(p) for p in vocab), default=1)

    def chars(self, tokens: int) -> int:
        return tokens * self.chars_per_token

    def exceeds(self, text: str, tokens: int) -> bool:
        return len(text) > self.chars(tokens)
