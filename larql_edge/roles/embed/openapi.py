"""The OpenAPI description of the embed server, served at ``GET /openapi.json``.

The committed copy ``openapi/embed.json`` is ``openapi_spec()`` (a test keeps the two equal and
checks that every route of the app is described); regenerate it with
``python -m larql_edge.roles.embed.openapi > openapi/embed.json``. ``openapi_spec(deployment)``
is the same document narrowed to one running server (`larql_edge.wire.openapi`): its limits
(``/v1/stats`` ``limits``) and its models' ids, vocabularies, widths and sha256s (``/v1/models``).
"""

from __future__ import annotations

from larql_edge.roles.embed.config import Limits
from larql_edge.wire.embed_api import ERRORS, EmbedApi
from larql_edge.wire.openapi import document, main, member_paths, ops_paths, ref


def openapi_spec(deployment: dict | None = None) -> dict:
    """The document; ``deployment`` (``{"limits": ..., "models": [...]}``) narrows it to one server."""
    d = deployment or {}
    api = EmbedApi(d.get("limits") or Limits().as_json(), d.get("models"))
    paths = api.paths()
    ops = ops_paths("embed", ref("Ready"), ref("Stats"), "Models still loading, or draining")
    stats = ops.pop("/v1/stats")["get"]
    stats["responses"]["404"] = ERRORS["404"]
    paths["/v1/stats"] = {"get": dict(stats, parameters=[api.header])}
    paths["/v1/{model_id}/stats"] = {"get": dict(stats, operationId="statsByModel", parameters=[api.model_id])}
    paths.update(ops)
    paths.update(member_paths())
    limit_names = sorted(Limits().as_json())
    schemas = api.schemas() | {
        "Ready": {
            "type": "object",
            "required": ["status", "models"],
            "properties": {"status": {"const": "ready"}, "models": {"type": "array", "items": {"type": "string"}},
                           "pid": {"type": "integer"}},
        },
        "Stats": {
            "type": "object",
            "required": ["model", "hidden_size", "vocab_size", "mode", "limits"],
            "properties": {
                "model": {"type": "string"},
                "model_id": {"type": "string"},
                "hidden_size": {"type": "integer"},
                "vocab_size": {"type": "integer"},
                "embed_size_gb": {"type": "number"},
                "lm_head_tied": {"type": "boolean"},
                "mode": {"type": "string", "enum": ["embed-service"]},
                "loaded": {"type": "object", "properties": {k: {"type": "boolean"} for k in ("embeddings", "lm_head", "tokenizer")}},
                "memory_mb": {"type": "number", "description": "RSS of the worker that answered"},
                "weights_verified": {"type": "object", "description": "What --verify-weights did at start",
                                     "properties": {"verified": {"type": "boolean"},
                                                    "seconds": {"type": ["number", "null"]},
                                                    "bytes": {"type": "integer"}}},
                "hot_cache": {"type": "object"},
                "logits_batching": {"type": "object"},
                "models": {"type": "array", "items": {"type": "string"}},
                "limits": {
                    "type": "object",
                    "description": "Every limit this server enforces (the document's own figures are the defaults)",
                    "required": limit_names,
                    "properties": {k: {"type": "number"} for k in limit_names},
                },
            },
        },
    }
    return document(
        "larql-edge embed server",
        "Embeddings, lm_head and tokenizer of one or more models (ADR-0008). Binary bodies use "
        "application/x-larql-ffn, little-endian.",
        paths,
        schemas,
    )


if __name__ == "__main__":
    main(openapi_spec)
