"""The OpenAPI description of the FFN shard, served at ``GET /openapi.json``.

The committed copy ``openapi/ffn.json`` is ``openapi_spec()`` (a test keeps the two equal and checks
that every route of the app is described); regenerate it with
``python -m larql_edge.roles.ffn.openapi > openapi/ffn.json``. ``openapi_spec(stats)``, given a
shard's ``/v1/stats``, is the document of that one shard: its width, its layers, its limits.
"""

from __future__ import annotations

from larql_edge.roles.ffn.shard import Limits
from larql_edge.wire.ffn_api import WalkApi
from larql_edge.wire.openapi import document, main, member_paths, ops_paths, ref

LIMITS = ("max_rows", "max_layers_per_request", "repeated_layers", "max_reply_bytes", "max_rows_x_layers", "max_body_bytes")


def _api(stats: dict | None) -> WalkApi:
    if stats is None:
        return WalkApi(max_rows=Limits().max_rows)
    lim = stats["limits"]
    return WalkApi(hidden=stats["hidden_size"], layer_min=stats["layer_start"], layer_max=stats["layer_end"],
                   max_layers=lim["max_layers_per_request"], max_rows=lim["max_rows"])


def openapi_spec(stats: dict | None = None) -> dict:
    api = _api(stats)
    paths = {"/v1/walk-ffn": api.operation("The FFN of the listed layers on exactly the rows sent", {})}
    paths.update(ops_paths("ffn", ref("Ready"), ref("Stats"), "Draining: leaving the grid"))
    paths.update(member_paths())
    integer, number, string = {"type": "integer"}, {"type": "number"}, {"type": "string"}
    schemas = api.schemas() | {
        "Ready": {"type": "object", "required": ["ready", "layers"],
                  "properties": {"ready": {"const": True}, "layers": string}},
        "Stats": {
            "type": "object",
            "required": ["mode", "model", "num_layers", "hidden_size", "layer_start", "layer_end", "limits"],
            "properties": {
                "mode": {"const": "ffn-shard"},
                "model": string,
                "family": string,
                "num_layers": integer,
                "hidden_size": integer,
                "intermediate_size": integer,
                "layers": {"type": "string", "description": "The inclusive range served, e.g. 0-5"},
                "layer_start": integer,
                "layer_end": integer,
                "vindex_hash": string,
                "requests": integer,
                "inflight": integer,
                "layer_latency_ms": {"type": "object", "additionalProperties": number},
                "load_seconds": number,
                "weights_verified": {
                    "type": "object",
                    "description": "What --verify-weights did at start: checksums checked, how long it took, "
                                   "how many bytes the vindex's checksummed files hold",
                    "properties": {"verified": {"type": "boolean"}, "seconds": {"type": ["number", "null"]},
                                   "bytes": integer},
                },
                "uptime_seconds": number,
                "memory_mb": number,
                "limits": {
                    "type": "object",
                    "description": f"Every work bound (defaults: max_rows {Limits().max_rows}, max_reply_bytes "
                    f"{Limits().max_reply_bytes}; max_body_bytes follows from max_rows, the layers and the width)",
                    "required": list(LIMITS),
                    "properties": {k: {"type": "boolean"} if k == "repeated_layers" else integer for k in LIMITS},
                },
            },
        },
    }
    return document(
        "larql-edge FFN shard",
        "The feed-forward layers of a layer range of one model (LARQL's /v1/walk-ffn, binary and JSON).",
        paths,
        schemas,
    )


if __name__ == "__main__":
    main(openapi_spec)
