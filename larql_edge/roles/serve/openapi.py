"""The OpenAPI description of larql-serve, served at ``GET /openapi.json``.

The committed copy ``openapi/serve.json`` is ``openapi_spec()`` (a test keeps the two equal and checks
that every route is described); regenerate it with
``python -m larql_edge.roles.serve.openapi > openapi/serve.json``. The request and reply bodies are
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
_stop = {"oneOf": [_string, {"type": "array", "items": _string, "maxItems": 4}, {"type": "null"}]}
_COMMON = {
    "model": _string,
    "max_tokens": {"type": "integer", "minimum": 1},
    "temperature": {"type": "number", "minimum": 0, "maximum": 2},
    "top_p": {"type": "number", "minimum": 0, "maximum": 1},
    "seed": _integer,
    "stop": _stop,
    "n": {"const": 1},
    "stream": _bool,
    "stream_options": {"type": "object", "properties": {"include_usage": _bool}},
}
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
                    "content": {JSON: {"schema": ref(reply)}, "text/event-stream": {"schema": _string}}},
            "400": _err("A bad parameter (param names it), a prompt longer than the context, no chat template"),
            "404": _err("Unknown model"),
            "413": _err("A body over max_body_bytes"),
            "415": _err("Not application/json"),
            "429": _err("max_active sequences active and max_queue queued: retry after Retry-After seconds"),
            "502": _err("The grid could not answer"),
        },
    }}


def openapi_spec() -> dict:
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
            "prompt": {"oneOf": [_string, {"type": "array", "items": _string, "minItems": 1, "maxItems": 1},
                                 {"type": "array", "items": _integer, "minItems": 1}]},
            "logprobs": {"type": ["integer", "null"], "minimum": 0, "maximum": 5}}},
        "ChatCompletionRequest": {"type": "object", "required": ["messages"], "properties": _COMMON | {
            "max_completion_tokens": {"type": "integer", "minimum": 1},
            "messages": {"type": "array", "minItems": 1, "items": {
                "type": "object", "required": ["role"],
                "properties": {"role": _string, "content": {"type": ["string", "array", "null"]}}}},
            "logprobs": _bool, "top_logprobs": {"type": "integer", "minimum": 0, "maximum": 20}}},
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
