"""The OpenAPI description of the embed server, served at ``GET /openapi.json``.

The committed copy ``openapi/embed.json`` is this function's output (a test keeps the two equal and
checks that every route of the app is described); regenerate it with
``python -m larql_edge.roles.embed.openapi > openapi/embed.json``.
"""

from __future__ import annotations

import json
import sys

BIN = "application/x-larql-ffn"
JSON = "application/json"


def _ref(name: str) -> dict:
    return {"$ref": f"#/components/schemas/{name}"}


def _err(desc: str) -> dict:
    return {"description": desc, "content": {JSON: {"schema": _ref("Error")}}}


ERRORS = {
    "400": _err("Malformed or invalid input"),
    "404": _err("Unknown model, or no such route"),
    "413": _err("Body larger than max_body_bytes, or more items than a published limit"),
    "415": _err("Content-Type is neither application/json nor application/x-larql-ffn"),
    "503": _err("Not loaded yet"),
}

MODEL_ID = {
    "name": "model_id",
    "in": "path",
    "required": True,
    "description": "Model id (see GET /v1/models); the unprefixed route uses X-Model-Id or the default model",
    "schema": {"type": "string"},
}
MODEL_HEADER = {
    "name": "X-Model-Id",
    "in": "header",
    "required": False,
    "description": "Model id for unprefixed routes; default: the first model given to the server",
    "schema": {"type": "string"},
}
TOKEN = {
    "name": "token",
    "in": "path",
    "required": True,
    "description": "Token id in decimal, optionally followed by .json to ask for the JSON representation",
    "schema": {"type": "string", "pattern": "^[0-9]+(\\.json)?$"},
}
IF_NONE_MATCH = {
    "name": "If-None-Match",
    "in": "header",
    "required": False,
    "description": "Entity tags (or *): a match answers 304 with the same caching headers",
    "schema": {"type": "string"},
}

ROW_HEADERS = {
    "ETag": {"description": 'Strong: "<embeddings sha256>-<id>-<bin|json>"', "schema": {"type": "string"}},
    "Cache-Control": {"description": "public, max-age=31536000, immutable", "schema": {"type": "string"}},
    "Vary": {"description": "Accept (plus X-Model-Id on the unprefixed route of a multi-model server)", "schema": {"type": "string"}},
}


def _row_op(op_id: str, params: list[dict], summary: str) -> dict:
    return {
        "summary": summary,
        "operationId": op_id,
        "tags": ["embeddings"],
        "parameters": params + [TOKEN, IF_NONE_MATCH],
        "responses": {
            "200": {
                "description": "The row, scaled by embed_scale: binary f32[hidden] (default) or JSON "
                "(Accept: application/json, or the .json URL)",
                "headers": ROW_HEADERS,
                "content": {
                    BIN: {"schema": {"type": "string", "format": "binary", "description": "f32[hidden], little-endian, no header"}},
                    JSON: {"schema": _ref("EmbedRow")},
                },
            },
            "304": {"description": "If-None-Match matched", "headers": ROW_HEADERS},
            "400": ERRORS["400"],
            "404": _err("Id beyond the vocabulary, unknown model or sha256"),
            "406": _err("Accept allows neither representation"),
            "503": ERRORS["503"],
        },
    }


def _both(path: str, ops: dict, tag: str) -> dict:
    """The unprefixed path (X-Model-Id) and its /v1/{model_id} twin."""
    plain, prefixed = {}, {}
    for method, op in ops.items():
        a = dict(op, tags=[tag], parameters=[MODEL_HEADER] + op.get("parameters", []))
        b = dict(op, tags=[tag], operationId=op["operationId"] + "ByModel", parameters=[MODEL_ID] + op.get("parameters", []))
        plain[method], prefixed[method] = a, b
    return {f"/v1{path}": plain, f"/v1/{{model_id}}{path}": prefixed}


def _json_body(schema: dict, binary: dict | None = None, required: bool = True) -> dict:
    content = {JSON: {"schema": schema}}
    if binary:
        content[BIN] = {"schema": binary}
    return {"required": required, "content": content}


def _ok(desc: str, schema: dict, binary: dict | None = None) -> dict:
    content = {JSON: {"schema": schema}}
    if binary:
        content[BIN] = {"schema": binary}
    return {"description": desc, "content": content}


def openapi_spec() -> dict:
    paths: dict = {}
    paths.update(
        _both(
            "/embed",
            {
                "post": {
                    "summary": "Token ids to scaled embedding rows",
                    "operationId": "embed",
                    "requestBody": _json_body(
                        _ref("EmbedRequest"),
                        {"type": "string", "format": "binary", "description": "u32 n, u32 ids[n]"},
                    ),
                    "responses": {
                        "200": _ok(
                            "Rows scaled by embed_scale; binary when the request is binary or Accept asks for it",
                            _ref("EmbedResponse"),
                            {"type": "string", "format": "binary", "description": "u32 seq_len, u32 hidden, f32[seq_len*hidden]"},
                        ),
                        **ERRORS,
                    },
                }
            },
            "embeddings",
        )
    )
    paths["/v1/embed/{token}"] = {
        "get": _row_op("embedRow", [MODEL_HEADER], "One embedding row (CDN-cacheable)"),
        "head": _row_op("embedRowHead", [MODEL_HEADER], "Headers of GET /v1/embed/{token}"),
    }
    paths["/v1/{model_id}/embed/{token}"] = {
        "get": _row_op("embedRowByModel", [MODEL_ID], "One embedding row of a named model"),
        "head": _row_op("embedRowByModelHead", [MODEL_ID], "Headers of the row"),
    }
    sha = {"name": "sha", "in": "path", "required": True, "description": "sha256 of the model's embeddings.bin",
           "schema": {"type": "string"}}
    paths["/v1/models/{sha}/embed/{token}"] = {
        "get": _row_op("embedRowBySha", [sha], "One embedding row, content-addressed by the weights' sha256"),
        "head": _row_op("embedRowByShaHead", [sha], "Headers of the content-addressed row"),
    }
    q = lambda name, desc, schema: {"name": name, "in": "query", "required": False, "description": desc, "schema": schema}  # noqa: E731
    paths.update(
        _both(
            "/logits",
            {
                "post": {
                    "summary": "Pre-final-norm residual to next-token top-k (or raw logits)",
                    "operationId": "logits",
                    "description": "Applies the final norm, lm_head, final softcap and temperature. Concurrent requests are "
                    "batched into one matrix product. temperature 0 means greedy: order unchanged (argmax first), "
                    "probabilities of temperature 1, raw logits unscaled.",
                    "parameters": [
                        q("top_k", "Binary requests only (JSON requests put it in the body)", {"type": "integer", "minimum": 1}),
                        q("temperature", "Binary requests only", {"type": "number", "minimum": 0}),
                    ],
                    "requestBody": _json_body(
                        _ref("LogitsRequest"),
                        {"type": "string", "format": "binary", "description": "f32[hidden], the residual before the final norm"},
                    ),
                    "responses": {
                        "200": _ok(
                            "Top-k JSON, or raw f32[vocab] with Accept: application/x-larql-ffn",
                            _ref("LogitsResponse"),
                            {"type": "string", "format": "binary", "description": "f32[vocab] logits (divided by temperature when > 0)"},
                        ),
                        **ERRORS,
                    },
                }
            },
            "logits",
        )
    )
    enc_get = {
        "summary": "Text to token ids",
        "operationId": "encode",
        "parameters": [
            {"name": "text", "in": "query", "required": True, "schema": {"type": "string"}},
            q("add_special_tokens", "Add the model's BOS etc. (default false)", {"type": "boolean"}),
        ],
        "responses": {"200": _ok("Token ids", _ref("EncodeResponse")), **ERRORS},
    }
    enc_post = {
        "summary": "Text (or a batch of texts) to token ids",
        "operationId": "encodePost",
        "requestBody": _json_body(_ref("EncodeRequest")),
        "responses": {"200": _ok("Token ids (a list per text for a batch)", _ref("EncodeResponse")), **ERRORS},
    }
    dec_get = {
        "summary": "Token ids to text",
        "operationId": "decode",
        "parameters": [
            {"name": "ids", "in": "query", "required": True, "description": "Comma-separated ids", "schema": {"type": "string"}},
            q("skip_special_tokens", "Drop special tokens (default false)", {"type": "boolean"}),
        ],
        "responses": {"200": _ok("Text", _ref("DecodeResponse")), **ERRORS},
    }
    dec_post = {
        "summary": "Token ids (or a batch of id lists) to text",
        "operationId": "decodePost",
        "requestBody": _json_body(_ref("DecodeRequest")),
        "responses": {"200": _ok("Text (texts for a batch)", _ref("DecodeResponse")), **ERRORS},
    }
    for path, ops in (("/token/encode", {"get": enc_get, "post": enc_post}), ("/token/decode", {"get": dec_get, "post": dec_post})):
        paths.update(_both(path, ops, "tokenizer"))
    stats_op = {
        "summary": "Model, memory, hot cache, batching and every enforced limit",
        "operationId": "stats",
        "responses": {"200": _ok("Stats", _ref("Stats")), "404": ERRORS["404"]},
    }
    paths.update(_both("/stats", {"get": stats_op}, "service"))
    paths["/v1/models"] = {
        "get": {
            "summary": "Models served by this process",
            "operationId": "models",
            "tags": ["service"],
            "responses": {"200": _ok("Models", {"type": "object"})},
        }
    }
    paths["/v1/health"] = {
        "get": {"summary": "Alive", "operationId": "health", "tags": ["service"], "responses": {"200": _ok("Alive", {"type": "object"})}}
    }
    paths["/v1/ready"] = {
        "get": {
            "summary": "Loaded and serving",
            "operationId": "ready",
            "tags": ["service"],
            "responses": {"200": _ok("Ready", {"type": "object"}), "503": ERRORS["503"]},
        }
    }
    paths["/metrics"] = {
        "get": {
            "summary": "Prometheus metrics (prefix larql_embed_), aggregated over all workers",
            "operationId": "metrics",
            "tags": ["service"],
            "responses": {"200": {"description": "Prometheus text format", "content": {"text/plain": {"schema": {"type": "string"}}}}},
        }
    }
    paths["/openapi.json"] = {
        "get": {
            "summary": "This description",
            "operationId": "openapi",
            "tags": ["service"],
            "responses": {"200": _ok("OpenAPI 3.1 document", {"type": "object"})},
        }
    }
    num_list = {"type": "array", "items": {"type": "number"}}
    schemas = {
        "Error": {"type": "object", "required": ["error"], "properties": {"error": {"type": "string"}}},
        "EmbedRequest": {
            "type": "object",
            "required": ["token_ids"],
            "properties": {
                "token_ids": {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1},
                "seq_len": {"type": "integer", "description": "Optional; must equal len(token_ids)"},
            },
        },
        "EmbedResponse": {
            "type": "object",
            "properties": {
                "residual": {"type": "array", "items": num_list},
                "seq_len": {"type": "integer"},
                "hidden_size": {"type": "integer"},
                "model": {"type": "string"},
                "latency_ms": {"type": "number"},
            },
        },
        "EmbedRow": {
            "type": "object",
            "properties": {"token_id": {"type": "integer"}, "embedding": num_list, "hidden_size": {"type": "integer"}},
        },
        "LogitsRequest": {
            "type": "object",
            "required": ["residual"],
            "properties": {
                "residual": dict(num_list, description="hidden_size finite numbers: the residual before the final norm"),
                "top_k": {"type": "integer", "minimum": 1, "default": 5, "description": "At most min(vocab_size, max_top_k)"},
                "temperature": {"type": "number", "minimum": 0, "default": 1.0, "description": "0 means greedy"},
            },
        },
        "LogitsResponse": {
            "type": "object",
            "properties": {
                "top_k": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {
                            "token_id": {"type": "integer"},
                            "token": {"type": "string"},
                            "prob": {"type": "number"},
                            "logprob": {"type": "number"},
                            "logit": {"type": "number"},
                        },
                    },
                },
                "model": {"type": "string"},
                "temperature": {"type": "number"},
                "greedy": {"type": "boolean"},
                "latency_ms": {"type": "number"},
            },
        },
        "EncodeRequest": {
            "type": "object",
            "properties": {
                "text": {"type": "string"},
                "texts": {"type": "array", "items": {"type": "string"}},
                "add_special_tokens": {"type": "boolean", "default": False},
            },
        },
        "EncodeResponse": {
            "type": "object",
            "properties": {"token_ids": {"type": "array"}, "text": {"type": "string"}},
        },
        "DecodeRequest": {
            "type": "object",
            "required": ["ids"],
            "properties": {"ids": {"type": "array"}, "skip_special_tokens": {"type": "boolean", "default": False}},
        },
        "DecodeResponse": {
            "type": "object",
            "properties": {"text": {"type": "string"}, "texts": {"type": "array", "items": {"type": "string"}}},
        },
        "Stats": {
            "type": "object",
            "properties": {
                "model": {"type": "string"},
                "hidden_size": {"type": "integer"},
                "vocab_size": {"type": "integer"},
                "embed_size_gb": {"type": "number"},
                "lm_head_tied": {"type": "boolean"},
                "mode": {"type": "string", "enum": ["embed-service"]},
                "loaded": {
                    "type": "object",
                    "properties": {k: {"type": "boolean"} for k in ("embeddings", "lm_head", "tokenizer")},
                },
                "memory_mb": {"type": "number", "description": "RSS of the worker that answered"},
                "hot_cache": {"type": "object"},
                "logits_batching": {"type": "object"},
                "limits": {
                    "type": "object",
                    "properties": {
                        k: {"type": "number"}
                        for k in ("max_tokens_per_request", "max_body_bytes", "max_top_k", "max_text_chars", "batch_wait_ms", "max_batch")
                    },
                },
            },
        },
    }
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "larql-edge embed server",
            "version": "1",
            "description": "Embeddings, lm_head and tokenizer of one or more models (ADR-0008). Every error is "
            '{"error": "message"}. Binary bodies use application/x-larql-ffn, little-endian.',
        },
        "paths": paths,
        "components": {"schemas": schemas},
    }


def main() -> None:
    json.dump(openapi_spec(), sys.stdout, indent=2, sort_keys=True)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
