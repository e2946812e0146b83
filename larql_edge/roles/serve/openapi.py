"""The OpenAPI description of larql-serve, served at ``GET /openapi.json``.

The committed copy ``openapi/serve.json`` is ``openapi_spec()`` (a test keeps the two equal and checks
that every route is described); regenerate it with
``python -m larql_edge.roles.serve.openapi > openapi/serve.json``. ``openapi_spec(stats)``, given a
running server's ``/v1/stats``, also bounds what depends on the deployment (token ids below the
vocabulary, fewer than the context),
which is what the schemathesis test runs against. The request and reply bodies are
OpenAI's (https://platform.openai.com/docs/api-reference); the request schemas are generated from the
typed models that validate the requests (`larql_edge.roles.serve.api`), so the two cannot disagree.
"""

from __future__ import annotations

from larql_edge.wire import JSON
from larql_edge.wire.openapi import document, main, ops_paths, ref

from .api import request_schemas
from .auth import OPEN_PATHS

OPENAI_ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {"error": {"type": "object", "required": ["message", "type", "param", "code"], "properties": {
        "message": {"type": "string"}, "type": {"type": "string"},
        "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}},
}
_integer, _string = {"type": "integer"}, {"type": "string"}
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


def _simple(op_id: str, summary: str, request: str, reply: str) -> dict:
    return {"post": {
        "summary": summary, "operationId": op_id, "tags": ["openai"],
        "requestBody": {"required": True, "content": {JSON: {"schema": ref(request)}}},
        "responses": {"200": {"description": "Done", "content": {JSON: {"schema": ref(reply)}}},
                      "400": _err("A bad parameter (param names it)"), "404": _err("Unknown model"),
                      "413": _err("A body over max_body_bytes"), "415": _err("Not application/json")}}}


def _bounded(schemas: dict, stats: dict) -> None:
    """What depends on the deployment, as constraints: token ids below the vocabulary, fewer ids than
    the context. Text is not bounded: its length in tokens is the tokenizer's (and, for messages, the
    chat template's), so a schema-valid request may still be a 400 context_length_exceeded."""
    ctx, vocab = int(stats["limits"]["context"]), int(stats["vocab_size"])
    schemas["DetokenizeRequest"]["properties"]["tokens"]["items"]["maximum"] = vocab - 1
    for alt in schemas["CompletionRequest"]["properties"]["prompt"]["anyOf"]:
        if alt["type"] == "array" and alt["items"]["type"] == "integer":
            alt["items"]["maximum"] = vocab - 1
            alt["maxItems"] = ctx - 1


def openapi_spec(stats: dict | None = None) -> dict:
    requests = request_schemas()  # from the models that validate the requests (api.py)
    if stats is not None:
        _bounded(requests, stats)
    paths = {
        "/v1/completions": _op("completions", "Complete a prompt", "CompletionRequest", "Completion"),
        "/v1/chat/completions": _op("chatCompletions", "Answer chat messages (the model's chat template)",
                                    "ChatCompletionRequest", "ChatCompletion"),
        "/v1/models": {"get": {"summary": "The model served", "operationId": "models", "tags": ["openai"],
                               "responses": {"200": {"description": "One model",
                                                     "content": {JSON: {"schema": ref("Models")}}}}}},
    }
    paths["/v1/models/{model_id}"] = {"get": {
        "summary": "One model: its context length (max_model_len) and the grid it runs on", "operationId": "model",
        "tags": ["openai"], "parameters": [{"name": "model_id", "in": "path", "required": True,
                                            "schema": {"type": "string"}}],
        "responses": {"200": {"description": "The model", "content": {JSON: {"schema": ref("Model")}}},
                      "401": _err("No API key, or a wrong one (with --api-key)"), "404": _err("Unknown model")}}}
    paths["/tokenize"] = _simple("tokenize", "Text, or chat messages through the template, to token ids "
                                 "(llama.cpp's and vLLM's bodies)", "TokenizeRequest", "Tokenized")
    paths["/detokenize"] = _simple("detokenize", "Token ids to text (content: llama.cpp's key; prompt: vLLM's)",
                                   "DetokenizeRequest", "Detokenized")
    paths.update(ops_paths("serve", ref("Ready"), ref("Stats"), "Loading"))
    for ops in paths.values():  # every error of this server is OpenAI's envelope, the service routes' too
        for op in ops.values():
            for code, resp in op["responses"].items():
                if resp.get("content", {}).get(JSON, {}).get("schema") == ref("Error"):
                    op["responses"][code] = _err(resp["description"])
    # With --api-key, every route but these needs the key: the document says the key is optional ({}),
    # a deployment's (stats) says what that server does.
    security: list[dict] = [{"apiKey": []}] if stats and stats.get("api_keys") else [{}] if stats else [{}, {"apiKey": []}]
    for path, ops in paths.items():
        if path not in OPEN_PATHS:
            for op in ops.values():
                op["security"] = security
                op["responses"].setdefault("401", _err("No API key, or a wrong one (with --api-key)"))
    schemas = {
        "OpenAIError": OPENAI_ERROR,
        **requests,
        "Completion": {"type": "object", "required": ["id", "object", "created", "model", "choices", "usage"],
                       "properties": {"id": _string, "object": {"const": "text_completion"}, "created": _integer,
                                      "model": _string, "choices": {"type": "array"}, "usage": USAGE}},
        "ChatCompletion": {"type": "object", "required": ["id", "object", "created", "model", "choices", "usage"],
                           "properties": {"id": _string, "object": {"const": "chat.completion"}, "created": _integer,
                                          "model": _string, "choices": {"type": "array"}, "usage": USAGE}},
        "Model": {"type": "object", "required": ["id", "object", "created", "owned_by", "max_model_len", "grid"],
                  "properties": {"id": _string, "object": {"const": "model"}, "created": _integer,
                                 "owned_by": _string, "max_model_len": _integer, "context_length": _integer,
                                 "vocab_size": _integer, "aliases": {"type": "array", "items": _string},
                                 "grid": {"type": "object"}}},
        "Tokenized": {"type": "object", "required": ["tokens", "count", "max_model_len"], "properties": {
            "tokens": {"type": "array", "items": {"anyOf": [_integer, {
                "type": "object", "required": ["id", "piece"], "properties": {"id": _integer, "piece": _string}}]}},
            "count": _integer, "max_model_len": _integer,
            "token_strs": {"type": "array", "items": {"type": ["string", "null"]}}}},
        "Detokenized": {"type": "object", "required": ["content", "prompt"],
                        "properties": {"content": _string, "prompt": _string}},
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
    doc["components"]["securitySchemes"]["apiKey"] = {
        "type": "http", "scheme": "bearer",
        "description": "With --api-key: one of its keys (a 401 otherwise, before the body is read)"}
    return doc


if __name__ == "__main__":
    main(openapi_spec)
