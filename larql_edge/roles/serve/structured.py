"""Structured output: a grammar that every generated token must keep satisfiable.

The engine is llguidance (chosen by measurement: benchmarks/grammar_engines.py; on Gemma 3's 262,144-token
vocabulary it compiles the 20 test schemas in under 10 ms each where outlines-core takes seconds, and its
mask costs tens of microseconds per token; xgrammar needs torch). Per request a `Constraint` holds one
matcher; per decode step the scheduler asks it for the allowed-token bitmask, the head applies that
bitmask to the row's logits before its top k (`larql_edge.wire.embed`: ``?masked=`` on the embed
server's many-rows ``/v1/logits``), and the sampled token is then fed back to the matcher.

JSON is generated in ``json.dumps``' style (``", "`` and ``": "`` separators, no other whitespace): a
small model left free to add whitespace may emit it forever.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from larql_edge.errors import BadRequest
from larql_edge.wire.embed import mask_words

JSON_STYLE: Any = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
ANY_OBJECT: dict[str, Any] = {"type": "object"}  # response_format json_object: any JSON object


def _bad(message: str, param: str, code: str = "invalid_value") -> BadRequest:
    e = BadRequest(message)
    e.param = param  # type: ignore[attr-defined]
    e.code = code  # type: ignore[attr-defined]
    return e


class Constraint:
    """One sequence's grammar state: the mask of the next token, and the tokens taken so far."""

    def __init__(self, matcher, words: int):
        self.matcher = matcher
        self.words = words
        self.error: str | None = None  # set when the grammar allows nothing more (a bug): the sequence fails

    def mask(self) -> np.ndarray | None:
        """The allowed next tokens; None (and `error` set) when none is: that row then goes unmasked, and
        the scheduler fails its sequence alone rather than the embed server the whole step."""
        out = np.zeros(self.words, dtype=np.int32)
        if not self.matcher.is_error():
            self.matcher.unsafe_compute_mask_ptr(out.ctypes.data, out.nbytes)
        if self.matcher.is_error() or not out.any():
            self.error = f"the grammar allows no next token ({self.matcher.get_error() or 'empty mask'})"
            return None
        return out

    def copy(self) -> Constraint:
        """The same grammar at the same point, for another sequence (n > 1): compiled once."""
        return Constraint(self.matcher.deep_copy(), self.words)

    def accept(self, token: int) -> None:
        """Feed the sampled token (always one the mask allowed)."""
        if not self.matcher.consume_token(token):
            raise RuntimeError(f"grammar refused token {token}: {self.matcher.get_error()}")

    @property
    def complete(self) -> bool:
        """Nothing but the end can follow: the sequence is done."""
        return bool(self.matcher.is_stopped())


class Grammars:
    """The served model's grammar engine: the tokenizer's vocabulary indexed once (about a second for
    262,144 tokens, on the first structured request), then one matcher per request."""

    def __init__(self, tokenizer, vocab: int, eos_ids: Sequence[int]):
        self._tokenizer, self.vocab, self.eos = tokenizer, vocab, list(eos_ids)
        self._lltok: Any = None
        self._lock = threading.Lock()

    def _llg_tokenizer(self, param: str):
        with self._lock:
            if self._lltok is None:
                import llguidance

                try:
                    self._lltok = llguidance.LLTokenizer(self._tokenizer.to_str(), n_vocab=self.vocab,
                                                         eos_token=self.eos or None)
                except (ValueError, RuntimeError) as e:  # a tokenizer the engine cannot index (WordPiece...)
                    self._lltok = f"this model's tokenizer cannot carry a grammar ({e})"
            if isinstance(self._lltok, str):
                field = "response_format" if param.startswith("response_format") else "tool_choice"
                raise _bad(f"{field}: structured output is not available here: {self._lltok}", field,
                           "unsupported_value")
            return self._lltok

    def json_schema(self, schema: dict[str, Any], param: str) -> Constraint:
        """A constraint generating one JSON value valid against ``schema``; a schema the engine cannot
        compile is the caller's 400 naming ``param``."""
        import llguidance

        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=JSON_STYLE)
        except (ValueError, TypeError) as e:
            raise _bad(f"{param}: not a usable JSON schema ({e})", param) from None
        return self._matcher(grammar, param)

    def _matcher(self, grammar: str, param: str) -> Constraint:
        import llguidance

        tok = self._llg_tokenizer(param)
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, tok)
        if is_error:
            raise _bad(f"{param}: the schema cannot be enforced: {messages[0][:300]}", param)
        m = llguidance.LLMatcher(tok, grammar, log_level=0)
        if m.is_error():
            raise _bad(f"{param}: the schema cannot be enforced: {m.get_error()[:300]}", param)
        return Constraint(m, mask_words(self.vocab))


def response_format_schema(rf: Any, param: str = "response_format") -> dict[str, Any] | None:
    """OpenAI's ``response_format`` -> the JSON schema to enforce (None for plain text)."""
    if rf is None:
        return None
    if not isinstance(rf, dict):
        raise _bad(f"{param} must be an object", param)
    kind = rf.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return ANY_OBJECT
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict):
            raise _bad(f"{param}.json_schema must be an object", f"{param}.json_schema")
        name = js.get("name")
        if not isinstance(name, str) or not name:
            raise _bad(f"{param}.json_schema.name must be a non-empty string", f"{param}.json_schema.name")
        strict = js.get("strict", rf.get("strict"))
        if strict is not None and type(strict) is not bool:
            raise _bad(f"{param}.json_schema.strict must be a boolean", f"{param}.json_schema.strict")
        schema = js.get("schema", {})
        if not isinstance(schema, dict):
            raise _bad(f"{param}.json_schema.schema must be an object", f"{param}.json_schema.schema")
        return schema or {}
    raise _bad(f"{param}.type must be 'text', 'json_object' or 'json_schema'", f"{param}.type")
