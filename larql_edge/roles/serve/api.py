"""The OpenAI request bodies, checked, and the error envelope OpenAI clients expect.

Every bad input is a 4xx with ``{"error": {"message", "type", "param", "code"}}``; the parameter named
in ``param`` is the one at fault. Types are strict (a JSON ``true`` is not an integer, ``"0.5"`` is not a
number): what the OpenAI API itself rejects.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from larql_edge.errors import BadRequest, LarqlError, NotFound
from larql_edge.wire.numbers import json_int

MAX_STOP = 4  # OpenAI's limit on stop sequences
MAX_LOGPROBS_COMPLETIONS = 5
MAX_TOP_LOGPROBS_CHAT = 20


def api_error(cls: type[LarqlError], message: str, param: str | None = None, code: str | None = None) -> LarqlError:
    e = cls(message)
    e.param = param  # type: ignore[attr-defined]
    e.code = code  # type: ignore[attr-defined]
    return e


def bad(message: str, param: str | None = None, code: str | None = "invalid_value") -> LarqlError:
    return api_error(BadRequest, message, param, code)


def openai_error_body(status: int, message: str, exc: BaseException) -> dict:
    """The body of every error larql-serve answers (the toolkit's envelope, OpenAI's shape)."""
    if status == 429:
        kind, code = "rate_limit_error", "rate_limit_exceeded"
    elif status >= 500:
        kind, code = "server_error", None
    else:
        kind, code = "invalid_request_error", None
        if status == 404:
            code = "not_found"
    return {"error": {"message": message, "type": kind, "param": getattr(exc, "param", None),
                      "code": getattr(exc, "code", None) or code}}


def _number(body: dict, name: str, default: float, lo: float, hi: float) -> float:
    v = body.get(name)
    if v is None:
        return default
    if type(v) not in (int, float):
        raise bad(f"{name} must be a number", name, "invalid_type")
    try:
        f = float(v)
    except OverflowError:
        raise bad(f"{name} is beyond float range", name) from None
    if not math.isfinite(f) or not lo <= f <= hi:
        raise bad(f"{name}={v} is out of range [{lo}, {hi}]", name)
    return f


def _int(body: dict, name: str, default: int | None, lo: int, hi: int) -> int | None:
    raw = body.get(name)
    if raw is None:
        return default
    v = json_int(raw)  # 3 or 3.0, as JSON Schema's integer; never a boolean or a string
    if v is None:
        raise bad(f"{name} must be an integer", name, "invalid_type")
    if not lo <= v <= hi:
        raise bad(f"{name}={v} is out of range [{lo}, {hi}]", name)
    return v


def _bool(body: dict, name: str) -> bool:
    v = body.get(name, False)
    if v is None:
        return False
    if type(v) is not bool:
        raise bad(f"{name} must be a boolean", name, "invalid_type")
    return v


def _rng_seed(seed: int | None) -> int | None:
    """numpy takes non-negative seeds: a negative one goes above 2**64, so x and -x differ."""
    return seed if seed is None or seed >= 0 else (1 << 64) - seed


@dataclass
class Common:
    model: str
    max_tokens: int | None
    temperature: float
    top_p: float
    seed: int | None
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    logprobs: int | None


def common(body: dict, model_id: str, max_tokens_name: str = "max_tokens", names: frozenset[str] = frozenset()) -> Common:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad("model must be a string", "model", "invalid_type")
    if model is not None and model != model_id and model not in names:
        raise api_error(NotFound, f"the model {str(model)[:80]!r} does not exist: this server serves {model_id!r}",
                        "model", "model_not_found")
    n = _int(body, "n", 1, 1, 128)
    if n != 1:
        raise bad("n must be 1: one choice per request", "n")
    max_tokens = _int(body, max_tokens_name, None, 1, 1 << 30)
    if max_tokens_name != "max_tokens":  # chat: max_completion_tokens wins; max_tokens is still checked
        legacy = _int(body, "max_tokens", None, 1, 1 << 30)
        max_tokens = legacy if max_tokens is None else max_tokens
    stop = body.get("stop")
    if stop is None:
        stops: tuple[str, ...] = ()
    elif isinstance(stop, str):
        stops = (stop,)
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stops = tuple(stop)
    else:
        raise bad("stop must be a string or a list of strings", "stop", "invalid_type")
    if len(stops) > MAX_STOP or any(not s for s in stops):
        raise bad(f"stop: at most {MAX_STOP} non-empty strings", "stop")
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise bad("stream_options must be an object", "stream_options", "invalid_type")
    stream = _bool(body, "stream")
    include_usage = bool(opts and _bool(opts, "include_usage")) and stream  # without a stream: no usage chunk
    seed = body.get("seed")
    if seed is not None:
        seed = json_int(seed)
        if seed is None or not -(2**63) <= seed < 2**64:
            raise bad("seed must be an integer in [-2**63, 2**64)", "seed", "invalid_type")
    return Common(model_id, max_tokens, _number(body, "temperature", 1.0, 0.0, 2.0),
                  _number(body, "top_p", 1.0, 0.0, 1.0) or 1e-9, _rng_seed(seed), stops, stream,
                  include_usage, None)


def completion_request(body: dict, model_id: str, names: frozenset[str] = frozenset()) -> tuple[Common, Any]:
    c = common(body, model_id, names=names)
    if c.max_tokens is None:
        c.max_tokens = 16  # OpenAI's default for /v1/completions
    lp = _int(body, "logprobs", None, 0, MAX_LOGPROBS_COMPLETIONS)
    c.logprobs = lp
    if _bool(body, "echo"):
        raise bad("echo is not supported", "echo", "unsupported_value")
    if body.get("suffix") is not None:
        raise bad("suffix is not supported", "suffix", "unsupported_value")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise bad("prompt is empty", "prompt")
        return c, prompt
    if isinstance(prompt, list) and prompt and all(json_int(t) is not None for t in prompt):
        return c, [int(t) for t in prompt]
    if prompt is None:
        raise bad("prompt is required", "prompt", "missing_required_parameter")
    raise bad("prompt must be a string, a list of one string, or a list of token ids", "prompt", "invalid_type")


def chat_request(body: dict, model_id: str, names: frozenset[str] = frozenset()) -> tuple[Common, list[dict]]:
    c = common(body, model_id, "max_completion_tokens", names)
    top = _int(body, "top_logprobs", 0, 0, MAX_TOP_LOGPROBS_CHAT)  # checked always; used with logprobs: true
    if _bool(body, "logprobs"):
        c.logprobs = top
    msgs = body.get("messages")
    if msgs is None:
        raise bad("messages is required", "messages", "missing_required_parameter")
    if not isinstance(msgs, list) or not msgs:
        raise bad("messages must be a non-empty list", "messages", "invalid_type")
    out = []
    for i, m in enumerate(msgs):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise bad(f"{where} must be an object with a string role", where, "invalid_type")
        content = m.get("content")
        if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
            parts = []
            for p in content:
                if not isinstance(p, dict) or p.get("type") != "text" or not isinstance(p.get("text"), str):
                    raise bad(f"{where}.content: only text parts are supported", f"{where}.content", "invalid_type")
                parts.append(p["text"])
            content = "".join(parts)
        elif content is None:
            content = ""
        elif not isinstance(content, str):
            raise bad(f"{where}.content must be a string or a list of text parts", f"{where}.content", "invalid_type")
        out.append({"role": m["role"], "content": content})
    return c, out
