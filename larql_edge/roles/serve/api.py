"""The OpenAI request bodies as typed models (pydantic), and the error envelope OpenAI clients expect.

The models are the one description of what larql-serve takes: they validate every request and they
generate the request schemas of the OpenAPI document (`larql_edge.roles.serve.openapi`). Every bad input
is a 4xx with ``{"error": {"message", "type", "param", "code"}}``; ``param`` names the parameter at
fault (``messages[0].content``). Types are strict (a JSON ``true`` is not an integer, ``"0.5"`` is not a
number; an integer may be written ``3.0``, as JSON Schema's integer).

Every field of OpenAI's own request types (the ``openai`` package's ``completion_create_params``) is
one of: implemented; on `IGNORED` (accepted and without effect, as OpenAI's ``user``: published in the
document's descriptions and in docs/DESIGN.md); or `refused` (typed ``None``: any other value is a 400
naming it, code ``unsupported_parameter``). A field no OpenAI type has is a 400 naming it too
(``unknown_parameter``): a misspelt ``temprature`` is never silently dropped.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, ValidationInfo, WithJsonSchema
from pydantic_core import PydanticCustomError

from larql_edge.errors import BadRequest, LarqlError, NotFound
from larql_edge.wire.numbers import json_int

MAX_STOP = 4  # OpenAI's limit on stop sequences
MAX_LOGPROBS_COMPLETIONS = 5
MAX_TOP_LOGPROBS_CHAT = 20
MAX_TOKENS_LIMIT = 1 << 30
MAX_N = 8  # choices per request (and never more than --max-active: the n are stepped together)
MAX_LOGIT_BIAS = 300  # OpenAI's limit on logit_bias entries
MAX_TOP_K = 1024  # candidates the head returns for one row at most
MAX_PROMPTS = 16  # prompts in one completions request (times n: choices)

# Accepted and without effect here: bookkeeping for OpenAI's platform (user, metadata, store...), and
# prompt-cache hints (larql-serve's prefix cache needs none).
IGNORED = ("user", "metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key",
           "prompt_cache_retention", "prompt_cache_options")


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
    elif status == 401:  # OpenAI's own 401: an invalid_request_error with code invalid_api_key
        kind, code = "invalid_request_error", "invalid_api_key"
    else:
        kind, code = "invalid_request_error", None
        if status == 404:
            code = "not_found"
    return {"error": {"message": message, "type": kind, "param": getattr(exc, "param", None),
                      "code": getattr(exc, "code", None) or code}}


# -- field types ------------------------------------------------------------------------------------
def _integer(v: Any) -> Any:
    i = json_int(v)
    return v if i is None else i  # a non-integer goes on to the strict int check and fails there


def _refuse(v: Any, info: ValidationInfo) -> None:
    if v is not None:
        raise PydanticCustomError("unsupported_parameter", f"{info.field_name} is not supported by larql-serve")
    return None


# A documented OpenAI field larql-serve does not implement: null (or absent), else a 400 naming it.
Refused = Annotated[None, BeforeValidator(_refuse),
                    WithJsonSchema({"type": "null", "description": "Not supported: any value but null is a 400"})]


MaxTokens = Annotated[int, Field(ge=1, le=MAX_TOKENS_LIMIT), BeforeValidator(_integer)]
Seed = Annotated[int, Field(ge=-(2**63), le=2**64 - 1), BeforeValidator(_integer)]
N = Annotated[int, Field(ge=1, le=MAX_N), BeforeValidator(_integer)]
TopK = Annotated[int, Field(ge=-1, le=MAX_TOP_K), BeforeValidator(_integer)]
Penalty = Annotated[float, Field(ge=-2, le=2, allow_inf_nan=False)]
RepetitionPenalty = Annotated[float, Field(gt=0, le=10, allow_inf_nan=False)]
CompletionLogprobs = Annotated[int, Field(ge=0, le=MAX_LOGPROBS_COMPLETIONS), BeforeValidator(_integer)]
TopLogprobs = Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS_CHAT), BeforeValidator(_integer)]
Temperature = Annotated[float, Field(ge=0, le=2, allow_inf_nan=False)]
Probability = Annotated[float, Field(ge=0, le=1, allow_inf_nan=False)]


def rng_seed(seed: int | None) -> int | None:
    """numpy takes non-negative seeds: a negative one goes above 2**64, so x and -x differ."""
    return seed if seed is None or seed >= 0 else (1 << 64) - seed


def ignored(what: str) -> Any:
    return Field(None, description=f"Accepted and ignored ({what})")


def _stop(v: Any) -> tuple[str, ...]:
    if v is None:
        return ()
    stops = (v,) if isinstance(v, str) else v
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise PydanticCustomError("invalid_type", "stop must be a string or a list of strings")
    if len(stops) > MAX_STOP or any(not s for s in stops):
        raise PydanticCustomError("invalid_value", f"stop: at most {MAX_STOP} non-empty strings")
    return tuple(stops)


def _logit_bias(v: Any) -> dict[int, float]:
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise PydanticCustomError("invalid_type", "logit_bias must be an object of token id: bias")
    if len(v) > MAX_LOGIT_BIAS:
        raise PydanticCustomError("invalid_value", f"logit_bias: at most {MAX_LOGIT_BIAS} entries")
    out = {}
    for key, bias in v.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit()) or len(key) > 9:
            raise PydanticCustomError("invalid_value", f"logit_bias: the key {key[:20]!r} is not a token id")
        if type(bias) not in (int, float) or not -100 <= bias <= 100:
            raise PydanticCustomError("invalid_value", "logit_bias: every bias is a number in [-100, 100]")
        out[int(key)] = float(bias)
    return out


LogitBias = Annotated[dict[int, float], BeforeValidator(_logit_bias), WithJsonSchema(
    {"anyOf": [{"type": "object", "maxProperties": MAX_LOGIT_BIAS, "propertyNames": {"pattern": "^[0-9]{1,9}$"},
                "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100}}, {"type": "null"}],
     "description": "Token id (as a string) to a bias added to its logit; -100 bans it (it never appears). "
                    "Acts as on the whole logits row: a biased token is scored whatever its rank"})]

_STOP_ITEM = {"type": "string", "minLength": 1}
Stop = Annotated[tuple[str, ...], BeforeValidator(_stop), WithJsonSchema(
    {"anyOf": [_STOP_ITEM, {"type": "array", "items": _STOP_ITEM, "maxItems": MAX_STOP}, {"type": "null"}],
     "description": f"Up to {MAX_STOP} strings: the text ends before the first of them"})]


def _one_prompt(v: Any) -> str | list[int] | None:
    if isinstance(v, str):
        if not v:
            raise PydanticCustomError("invalid_value", "prompt is empty")
        return v
    if isinstance(v, list) and v and all(json_int(t) is not None for t in v):
        return [int(t) for t in v]
    return None


def _prompts(v: Any) -> list[str | list[int]]:
    """A string, token ids, or a list of either (a batch: one choice, or n, per prompt)."""
    one = _one_prompt(v)
    if one is not None:
        return [one]
    if isinstance(v, list) and v and all(isinstance(p, (str, list)) for p in v):
        if len(v) > MAX_PROMPTS:
            raise PydanticCustomError("invalid_value", f"prompt: at most {MAX_PROMPTS} prompts in one request")
        out = [_one_prompt(p) for p in v]
        if all(p is not None for p in out):
            return out  # type: ignore[return-value]
    raise PydanticCustomError("invalid_type", "prompt must be a string, token ids, or a list of strings or of "
                              "token-id lists")


_TEXT = {"type": "string", "minLength": 1}
_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}
Prompts = Annotated[list[str | list[int]], BeforeValidator(_prompts), WithJsonSchema(
    {"anyOf": [_TEXT, _IDS, {"type": "array", "items": _TEXT, "minItems": 1, "maxItems": MAX_PROMPTS},
               {"type": "array", "items": _IDS, "minItems": 1, "maxItems": MAX_PROMPTS}],
     "description": f"A string, token ids, or up to {MAX_PROMPTS} of either (choices: n per prompt, in order)"})]


def _content(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, str):
        return v
    if isinstance(v, list):  # [{"type": "text", "text": ...}, ...]
        parts = []
        for p in v:
            if not isinstance(p, dict) or p.get("type") != "text" or not isinstance(p.get("text"), str):
                raise PydanticCustomError("invalid_type", "content: only text parts are supported")
            parts.append(p["text"])
        return "".join(parts)
    raise PydanticCustomError("invalid_type", "content must be a string or a list of text parts")


_TEXT_PART = {"type": "object", "required": ["type", "text"],
              "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}
Content = Annotated[str, BeforeValidator(_content), WithJsonSchema(
    {"anyOf": [{"type": "string"}, {"type": "array", "items": _TEXT_PART}, {"type": "null"}]})]


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)


class Message(_Strict):
    role: str
    content: Content = ""
    name: str | None = None  # given to the chat template, as transformers does
    # A tool-calling turn of the history, given to the chat template as transformers does.
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    function_call: Refused = None
    refusal: Refused = None
    audio: Refused = None

    def for_template(self) -> dict[str, Any]:
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_calls is not None:
            out["tool_calls"] = self.tool_calls
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


class StreamOptions(_Strict):
    include_usage: bool | None = None
    include_obfuscation: bool | None = ignored("OpenAI's stream padding")


class _Common(_Strict):
    """What completions and chat share."""
    model: str | None = None
    max_tokens: MaxTokens | None = Field(
        None, description="At most this many tokens (never beyond the context)")
    temperature: Temperature | None = None
    top_p: Probability | None = None
    seed: Seed | None = None
    stop: Stop = ()
    n: N | None = Field(None, description=f"Choices, at most {MAX_N} (and at most max_active): one prefill for all")
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    logit_bias: LogitBias = Field(default_factory=dict)
    # The common extras of vLLM and llama.cpp, in the body.
    top_k: TopK | None = Field(None, description=f"Draw among the k most likely (0 or -1: off; at most {MAX_TOP_K})")
    min_p: Probability | None = Field(None, description="Drop candidates below min_p x the best one's probability")
    repetition_penalty: RepetitionPenalty | None = Field(
        None, description="vLLM's and llama.cpp's: the logit of every token seen in the prompt or output is "
        "divided by it if positive, multiplied if negative (1: off; below 1 favours them)")
    user: str | None = ignored("OpenAI's end-user id")
    # Structured output (`structured.response_format_schema` checks the inside, naming the field at
    # fault); on completions as vLLM takes it.
    response_format: dict[str, Any] | None = Field(
        None, description='{"type": "text" | "json_object" | "json_schema", "json_schema": {"name", "schema", "strict"}}: '
        "the reply is generated to match (llguidance)")


class CompletionRequest(_Common):
    prompt: Prompts
    max_tokens: MaxTokens | None = Field(
        None, description="At most this many tokens (never beyond the context); default 16, as OpenAI")
    logprobs: CompletionLogprobs | None = None
    echo: bool | None = None
    suffix: Refused = None
    best_of: N | None = Field(None, description="Only n (no server-side ranking): the n completions are n draws")


class ChatCompletionRequest(_Common):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: MaxTokens | None = Field(
        None, description="At most this many tokens (never beyond the context); wins over max_tokens")
    logprobs: bool | None = None
    top_logprobs: TopLogprobs | None = None
    modalities: list[Literal["text"]] | None = None
    # Tools (`tools.plan` checks them, naming the field at fault).
    tools: list[dict[str, Any]] | None = Field(
        None, description='[{"type": "function", "function": {"name", "description", "parameters"}}], given to the chat '
        "template")
    tool_choice: str | dict[str, Any] | None = Field(
        None, description='"none", "auto" (the default with tools), "required" or {"type": "function", "function": {"name"}}: '
        "required and a named function are enforced with the grammar engine")
    parallel_tool_calls: bool | None = Field(None, description="false: required makes exactly one call")
    functions: Refused = None
    function_call: Refused = None
    audio: Refused = None
    prediction: Refused = None
    web_search_options: Refused = None
    reasoning_effort: Refused = None
    verbosity: Refused = None
    moderation: Refused = None
    metadata: dict[str, str] | None = ignored("OpenAI's stored-completion tags")
    store: bool | None = ignored("nothing is stored")
    service_tier: str | None = ignored("one tier")
    safety_identifier: str | None = ignored("OpenAI's end-user id")
    prompt_cache_key: str | None = ignored("the prefix cache needs no key")
    prompt_cache_retention: str | None = ignored("the prefix cache is bounded by the KV memory")
    prompt_cache_options: dict[str, Any] | None = ignored("the prefix cache is bounded by the KV memory")


# -- validation -------------------------------------------------------------------------------------
def _param(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _as_api_error(e: ValidationError) -> LarqlError:
    err = e.errors(include_url=False)[0]
    param = _param(err["loc"]) or None
    kind = err["type"]
    if kind == "missing":
        return bad(f"{param} is required", param, "missing_required_parameter")
    if kind == "extra_forbidden":
        return bad(f"unrecognized request argument supplied: {param}", param, "unknown_parameter")
    if kind in ("unsupported_parameter", "invalid_type", "invalid_value"):  # our own messages name the field
        msg = err["msg"] if param is None or err["msg"].startswith(param.rsplit(".", 1)[-1]) else f"{param}: {err['msg']}"
        return bad(msg, param, kind)
    if kind == "model_type":
        return bad(f"{param or 'the body'} must be an object", param, "invalid_type")
    code = "invalid_type" if kind.endswith("_type") else "invalid_value"
    return bad(f"{param}: {err['msg']}" if param else err["msg"], param, code)


def parse(cls: Any, body: dict, model_id: str, names: frozenset[str] = frozenset()) -> Any:
    try:
        req = cls.model_validate(body)
    except ValidationError as e:
        raise _as_api_error(e) from None
    if req.model is not None and req.model != model_id and req.model not in names:
        raise api_error(NotFound, f"the model {req.model[:80]!r} does not exist: this server serves {model_id!r}",
                        "model", "model_not_found")
    return req


def completion_request(body: dict, model_id: str, names: frozenset[str] = frozenset()) -> CompletionRequest:
    return parse(CompletionRequest, body, model_id, names)


def chat_request(body: dict, model_id: str, names: frozenset[str] = frozenset()) -> ChatCompletionRequest:
    return parse(ChatCompletionRequest, body, model_id, names)


def request_schemas() -> dict[str, dict]:
    """The request bodies' JSON Schemas (OpenAPI 3.1's dialect), with their sub-models, by name."""
    from pydantic.json_schema import models_json_schema

    _, top = models_json_schema([(m, "validation") for m in (CompletionRequest, ChatCompletionRequest,
                                                             TokenizeRequest, DetokenizeRequest)],
                                ref_template="#/components/schemas/{model}")
    return _untitled(top["$defs"])


def _untitled(schema: Any) -> Any:
    """Without pydantic's generated titles ("Max Tokens"): the property names say it."""
    if isinstance(schema, dict):
        return {k: _untitled(v) for k, v in schema.items() if not (k == "title" and isinstance(v, str))}
    if isinstance(schema, list):
        return [_untitled(v) for v in schema]
    return schema


# -- /tokenize and /detokenize: llama.cpp's and vLLM's bodies -----------------------------------------
MAX_TOKENIZE_IDS = 1 << 20

TokenId = Annotated[int, Field(ge=0), BeforeValidator(_integer)]


_ONE_OF = ("content", "prompt", "messages")


class TokenizeRequest(_Strict):
    """llama.cpp's ``{"content", "add_special", "with_pieces"}`` or vLLM's ``{"prompt" | "messages",
    "add_special_tokens", "add_generation_prompt"}``: exactly one of content, prompt, messages."""
    model_config = ConfigDict(strict=True, extra="forbid", frozen=True, json_schema_extra={
        "oneOf": [{"required": [k]} for k in _ONE_OF]})
    model: str | None = None
    content: Annotated[str | None, WithJsonSchema({"type": "string"})] = None
    prompt: Annotated[str | None, WithJsonSchema({"type": "string"})] = None
    messages: Annotated[list[Message] | None, WithJsonSchema(
        {"type": "array", "items": {"$ref": "#/components/schemas/Message"}, "minItems": 1})] = Field(None, min_length=1)
    add_special: bool | None = Field(None, description="llama.cpp's name (default false)")
    add_special_tokens: bool | None = Field(None, description="vLLM's name (default true)")
    with_pieces: bool | None = Field(None, description="tokens as {id, piece} objects (llama.cpp)")
    add_generation_prompt: bool | None = Field(None, description="with messages: the template's assistant turn "
                                                                 "(default true)")
    return_token_strs: bool | None = Field(None, description="token_strs beside the ids (vLLM)")


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[TokenId] = Field(max_length=MAX_TOKENIZE_IDS)


def tokenize_request(body: dict, model_id: str, names: frozenset[str] = frozenset()) -> TokenizeRequest:
    req = parse(TokenizeRequest, body, model_id, names)
    given = [k for k in _ONE_OF if k in body]
    if len(given) != 1:
        raise bad("give exactly one of content (llama.cpp), prompt or messages (vLLM)", (given or ["content"])[-1],
                  "missing_required_parameter" if not given else "invalid_value")
    if body[given[0]] is None:
        raise bad(f"{given[0]} must not be null", given[0], "invalid_type")
    return req


def detokenize_request(body: dict, model_id: str, names: frozenset[str] = frozenset()) -> DetokenizeRequest:
    return parse(DetokenizeRequest, body, model_id, names)
