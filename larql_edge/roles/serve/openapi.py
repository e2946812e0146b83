"""The OpenAPI description of larql-serve, served at ``GET /openapi.json``.

The committed copy ``openapi/serve.json`` is ``openapi_spec()`` (a test keeps the two equal and checks
that every route is described); regenerate it with
``python -m larql_edge.roles.serve.openapi > openapi/serve.json``. ``openapi_spec(stats)``, given a
running server's ``/v1/stats``, also bounds what depends on the deployment (token ids below the
vocabulary; prompts and messages short enough for the context, tokens being at most 4 per character),
which is what the schemathesis test runs against. The request and reply bodies are
OpenAI's (https://platform.openai.com/docs/api-reference); only what larql-serve takes is listed.
"""

from __future__ import annotations

from larql_edge.wire import JSON
from larql_edge.wire.openapi import document, main, ops_paths, ref

OPENAI_ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {"error": {"type": "object", "required": ["message", "type", "param", "code"], "properties": {
        "message": {"type": "string"}, "type": {"type": "string"},
        "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}},
}
_integer, _number, _string, _bool = {"type": "integer"}, {"type": "number"}, {"type": "string"}, {"type": "boolean"}
def _n(schema: dict) -> dict:
    """Nullable: larql-serve takes null as "not given" (the default), as the OpenAI API does."""
    if "type" in schema:
        t = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
        return dict(schema, type=[*t, "null"])
    return {"anyOf": [schema, {"type": "null"}]}


_stop_item = {"type": "string", "minLength": 1}
_stop = {"oneOf": [_stop_item, {"type": "array", "items": _stop_item, "maxItems": 4}, {"type": "null"}]}
_MAX_TOKENS = {"type": "integer", "minimum": 1, "maximum": 1 << 30,
               "description": "At most this many tokens (never beyond the context)"}
_COMMON = {
    "model": _n(_string),
    "max_tokens": _n(_MAX_TOKENS),
    "temperature": _n({"type": "number", "minimum": 0, "maximum": 2}),
    "top_p": _n({"type": "number", "minimum": 0, "maximum": 1}),
    "seed": _n({"type": "integer", "minimum": -(2**63), "maximum": 2**64 - 1}),
    "stop": _stop,
    "n": {"enum": [1, None]},
    "stream": _n(_bool),
    "stream_options": _n({"type": "object", "properties": {"include_usage": _n(_bool)}}),
}
SSE_EVENT = {"type": "object", "required": ["data"], "properties": {"data": {
    "type": "string", "description": "A chunk object as JSON (text_completion / chat.completion.chunk), or [DONE] last"}}}
USAGE = {"type": "object", "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
         "properties": {"prompt_tokens": _integer, "completion_tokens": _integer, "total_tokens": _integer}}


def _err(desc: str) -> dict:
    return {"description": desc, "content": {JSON: {"schema": ref("OpenAIError")}}}


def _op(op_id: str, summary: str, request: str, reply: str) -> dict:
    return {"post": {
        "summary": summary, "operationId": op_id, "tags": ["openai"],
        "requestBody": {"required": True, "content": {JSON: {"schema": ref(request)}}},
        "responses": {
            "200": {"description": "The completion (JSON), or with stream: true server-sent events ending data: [DONE]",
                    "content": {JSON: {"schema": ref(reply)}, "text/event-stream": {"schema": SSE_EVENT}}},
            "400": _err("A bad parameter (param names it), a prompt longer than the context, no chat template"),
            "404": _err("Unknown model"),
            "413": _err("A body over max_body_bytes"),
            "415": _err("Not application/json"),
            "429": _err("max_active sequences active and max_queue queued: retry after Retry-After seconds"),
            "502": _err("The grid could not answer"),
        },
    }}


def _prompt(stats: dict | None) -> dict:
    text: dict = {"type": "string", "minLength": 1}
    item: dict = {"type": "integer", "minimum": 0}
    ids: dict = {"type": "array", "items": item, "minItems": 1}
    if stats is not None:
        ctx = int(stats["limits"]["context"])
        text["maxLength"] = max(1, (ctx - 2) // 4)
        item["maximum"] = int(stats["vocab_size"]) - 1
        ids["maxItems"] = ctx - 1
    return {"oneOf": [text, {"type": "array", "items": text, "minItems": 1, "maxItems": 1}, ids]}


def _messages(stats: dict | None) -> dict:
    short = {"type": "string"}
    out: dict = {"type": "array", "minItems": 1, "items": {
        "type": "object", "required": ["role"], "properties": {"role": short, "content": {"type": ["string", "null"]}}}}
    if stats is not None:  # what the chat template adds is unknown here: a generous share of the context
        n = max(1, int(stats["limits"]["context"]) // 128)
        out["maxItems"] = n
        out["items"]["properties"] = {"role": {"type": "string", "maxLength": 8},
                                      "content": {"type": ["string", "null"], "maxLength": 8}}
    return out


def openapi_spec(stats: dict | None = None) -> dict:
    paths = {
        "/v1/completions": _op("completions", "Complete a prompt", "CompletionRequest", "Completion"),
        "/v1/chat/completions": _op("chatCompletions", "Answer chat messages (the model's chat template)",
                                    "ChatCompletionRequest", "ChatCompletion"),
        "/v1/models": {"get": {"summary": "The model served", "operationId": "models", "tags": ["openai"],
                               "responses": {"200": {"description": "One model",
                                                     "content": {JSON: {"schema": ref("Models")}}}}}},
    }
    paths.update(ops_paths("serve", ref("Ready"), ref("Stats"), "Loading"))
    schemas = {
        "OpenAIError": OPENAI_ERROR,
        "CompletionRequest": {"type": "object", "required": ["prompt"], "properties": _COMMON | {
            "prompt": _prompt(stats),
            "logprobs": {"type": ["integer", "null"], "minimum": 0, "maximum": 5}}},
        "ChatCompletionRequest": {"type": "object", "required": ["messages"], "properties": _COMMON | {
            "max_completion_tokens": _n(_MAX_TOKENS),
            "messages": _messages(stats),
            "logprobs": _n(_bool), "top_logprobs": _n({"type": "integer", "minimum": 0, "maximum": 20})}},
        "Completion": {"type": "object", "required": ["id", "object", "created", "model", "choices", "usage"],
                       "properties": {"id": _string, "object": {"const": "text_completion"}, "created": _integer,
                                      "model": _string, "choices": {"type": "array"}, "usage": USAGE}},
        "ChatCompletion": {"type": "object", "required": ["id", "object", "created", "model", "choices", "usage"],
                           "properties": {"id": _string, "object": {"const": "chat.completion"}, "created": _integer,
                                          "model": _string, "choices": {"type": "array"}, "usage": USAGE}},
        "Models": {"type": "object", "required": ["object", "data"],
                   "properties": {"object": {"const": "list"}, "data": {"type": "array"}}},
        "Ready": {"type": "object", "required": ["ready", "model"],
                  "properties": {"ready": {"const": True}, "model": _string}},
        "Stats": {"type": "object", "required": ["mode", "model", "active", "queued", "limits"],
                  "properties": {"mode": {"const": "serve"}, "model": _string, "active": _integer, "queued": _integer,
                                 "limits": {"type": "object", "required": [
                                     "max_active", "max_queue", "context", "kv_memory_bytes", "step_tokens"]}}},
    }
    doc = document("larql-serve", "An OpenAI-compatible API in front of a larql-edge grid, with continuous batching.",
                   paths, schemas)
    doc["info"]["description"] = (
        "An OpenAI-compatible API in front of a larql-edge grid, with continuous batching. Every error is "
        '{"error": {"message", "type", "param", "code"}} (OpenAI\'s format).')
    return doc


if __name__ == "__main__":
    main(openapi_spec)
