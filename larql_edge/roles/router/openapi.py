"""The OpenAPI description of the router, served at ``GET /openapi.json``.

The committed copy ``openapi/router.json`` is ``openapi_spec()`` (a test keeps the two equal and
checks that every route of the app is described); regenerate it with
``python -m larql_edge.roles.router.openapi > openapi/router.json``. ``openapi_spec(deployment)``
is the document of one running grid: ``{"stats": the router's /v1/stats, "shard": the /v1/stats
of its FFN member with the smallest limits, "embed": {"limits", "models"} of its embed member}``.

The router serves the FFN shards' ``/v1/walk-ffn`` (routed, split and merged) and the embed
server's routes (proxied, answers unchanged), so their descriptions are the wires' own
(`larql_edge.wire.ffn_api`, `larql_edge.wire.embed_api`); the limits of a proxied or routed request
are the members' (their ``/v1/stats``), the router adding its own (``max_body_bytes``,
``max_reply_bytes``).
"""

from __future__ import annotations

from larql_edge.wire.embed_api import EmbedApi
from larql_edge.wire.ffn_api import WalkApi
from larql_edge.wire.grid import HEARTBEAT, JOIN, LEAVE, MAX_HIDDEN, MAX_INFLIGHT, MAX_LAYERS, TOPOLOGY
from larql_edge.wire.openapi import JSON, document, err, main, ok, ops_paths, ref

NO_MEMBER = "No live member can answer (a layer without a live shard, no embed server), or every one tried failed"
GRID_KEY: list[dict[str, list[str]]] = [{"gridKey": []}]


def _walk(d: dict) -> WalkApi:
    stats, shard = d.get("stats"), d.get("shard")
    if stats is None or stats.get("num_layers") is None:
        return WalkApi(layers_text="layers of the model (0 to num_layers - 1 in /v1/stats)")
    lim = shard["limits"] if shard else {}
    return WalkApi(hidden=stats["hidden_size"], layer_max=stats["num_layers"] - 1, max_layers=stats["num_layers"],
                   max_rows=lim.get("max_rows"),
                   layers_text="layers of the model (0 to num_layers - 1 in /v1/stats)")


def _membership(op_id: str, summary: str, body: str, reply: dict, errors: dict) -> dict:
    return {"post": {
        "summary": summary,
        "operationId": op_id,
        "tags": ["grid"],
        "security": GRID_KEY,
        "description": "The grid key is checked from the headers before any byte of the body is read; the body is "
        "read only up to max_grid_body_bytes.",
        "requestBody": {"required": True, "content": {JSON: {"schema": ref(body)}}},
        "responses": {
            "200": ok("Done", reply),
            "400": err("Malformed message"),
            "401": err("No grid key, or a wrong one"),
            "413": err("Body over max_grid_body_bytes"),
            "415": err("Content-Type is not application/json"),
            **errors,
        },
    }}


def openapi_spec(deployment: dict | None = None) -> dict:
    d = deployment or {}
    walk = _walk(d)
    embed = d.get("embed") or {}
    api = EmbedApi(embed.get("limits"), embed.get("models"))
    paths: dict = {"/v1/walk-ffn": walk.operation(
        "Route each layer to the best live replica; a batch is split by member and merged in order",
        {"503": err(NO_MEMBER)})}
    proxied = api.paths()
    for item in proxied.values():
        for op in item.values():
            op["responses"] = dict(op["responses"], **{"503": err(NO_MEMBER)})
    paths.update(proxied)
    ok_reply = {"type": "object", "required": ["ok"], "properties": {"ok": {"const": True}}}
    paths[JOIN] = _membership("join", "Join the grid (the router first probes the announced URL)", "Announce",
                              ref("Joined"), {"409": err("The member does not fit the grid, is not what it announces, "
                                                         "or a live member has its URL")})
    paths[HEARTBEAT] = _membership("heartbeat", "A member's heartbeat and load", "Load", ok_reply,
                                   {"403": err("Not this member's token"), "404": err("Unknown member: join again")})
    paths[LEAVE] = _membership("leave", "Leave the grid (a clean shutdown)", "Leave", ok_reply,
                               {"403": err("Not this member's token"), "404": err("Unknown member")})
    paths["/v1/grid"] = {"get": {"summary": "Members, coverage and gaps", "operationId": "grid", "tags": ["grid"],
                                 "responses": {"200": ok("The grid", ref("Grid"))}}}
    paths[TOPOLOGY] = {"get": {"summary": "Live FFN shards, their layers, and live embed servers (the direct data path's map)",
                               "operationId": "topology", "tags": ["grid"],
                               "responses": {"200": ok("The topology", ref("Topology"))}}}
    paths.update(ops_paths("router", ref("Ready"), ref("Stats"), "Draining"))
    integer, number, string = {"type": "integer"}, {"type": "number"}, {"type": "string"}
    opt_int = {"type": ["integer", "null"]}
    layer_ms = {"type": "object", "additionalProperties": number, "propertyNames": {"pattern": "^[0-9]+$"}}
    member_str = lambda n: {"type": ["string", "null"], "minLength": 1, "maxLength": n}  # noqa: E731
    schemas = walk.schemas() | api.schemas() | {
        "Announce": {
            "type": "object",
            "required": ["capability", "public_url", "model"],
            "description": "FFN members also give num_layers, layer_start and layer_end (inclusive); null is as absent",
            "properties": {
                "capability": {"enum": ["ffn", "embed"]},
                "public_url": {"type": "string", "maxLength": 2048, "pattern": "^https?://",
                               "description": "Where the router reaches the member (no query or fragment)"},
                "model": {"type": "string", "minLength": 1, "maxLength": 512},
                "num_layers": {"type": ["integer", "null"], "minimum": 1, "maximum": MAX_LAYERS},
                "hidden_size": {"type": ["integer", "null"], "minimum": 1, "maximum": MAX_HIDDEN},
                "layer_start": {"type": ["integer", "null"], "minimum": 0, "maximum": MAX_LAYERS - 1},
                "layer_end": {"type": ["integer", "null"], "minimum": 0, "maximum": MAX_LAYERS - 1},
                "vindex_hash": member_str(128),
            },
        },
        "Joined": {
            "type": "object",
            "required": ["member_id", "member_token", "heartbeat_interval_s", "evict_after_s"],
            "properties": {"member_id": string, "member_token": string, "heartbeat_interval_s": number, "evict_after_s": number},
        },
        "Load": {
            "type": "object",
            "required": ["member_id"],
            "properties": {
                "member_id": {"type": "string", "minLength": 1, "maxLength": 64},
                "member_token": member_str(128),
                "inflight": {"type": ["integer", "null"], "minimum": 0, "maximum": MAX_INFLIGHT},
                "rss_bytes": {"type": ["integer", "null"], "minimum": 0, "maximum": 1 << 40},
                "layer_latency_ms": {"type": ["object", "null"], "maxProperties": MAX_LAYERS,
                                     "propertyNames": {"pattern": "^[0-9]{1,4}$"},
                                     "additionalProperties": {"type": "number", "minimum": 0, "exclusiveMaximum": 1e9}},
            },
        },
        "Leave": {
            "type": "object",
            "required": ["member_id"],
            "properties": {"member_id": {"type": "string", "minLength": 1, "maxLength": 64}, "member_token": string},
        },
        "Topology": {
            "type": "object",
            "required": ["version", "refresh_s", "shards"],
            "properties": {
                "version": {"type": "string", "description": "Changes whenever a shard or its range changes"},
                "refresh_s": {"type": "number", "description": "How often a client should ask again"},
                "shards": {"type": "array", "items": {
                    "type": "object", "required": ["url", "layers"],
                    "properties": {"url": string, "layers": {"type": "string", "description": "A-B (inclusive) or all"}}}},
                "embed": {"type": "array", "items": string, "description": "Live embed servers"},
            },
        },
        "Grid": {
            "type": "object",
            "required": ["model", "num_layers", "hidden_size", "members", "coverage", "gaps", "embed", "complete"],
            "properties": {
                "model": {"type": ["string", "array", "null"], "description": "null before any member; a list if members disagree"},
                "num_layers": opt_int,
                "hidden_size": opt_int,
                "members": {"type": "array", "items": {"type": "object", "required": ["id", "capability", "url", "live"],
                                                       "properties": {"id": string, "capability": {"enum": ["ffn", "embed"]},
                                                                      "url": string, "live": {"type": "boolean"},
                                                                      "layer_latency_ms": layer_ms}}},
                "coverage": {"type": "array", "items": {"type": "object", "properties": {"layers": string, "replicas": integer}}},
                "gaps": {"type": "array", "items": string},
                "embed": integer,
                "complete": {"type": "boolean"},
                "heartbeat_interval_s": number,
                "evict_after_s": number,
            },
        },
        "Ready": {"type": "object", "required": ["ready", "complete", "gaps", "embed"],
                  "properties": {"ready": {"const": True}, "complete": {"type": "boolean"},
                                 "gaps": {"type": "array", "items": string}, "embed": integer}},
        "Stats": {
            "type": "object",
            "required": ["mode", "model", "num_layers", "hidden_size", "members", "gaps", "complete", "limits"],
            "properties": {
                "mode": {"const": "router"},
                "model": {"type": ["string", "array", "null"]},
                "num_layers": opt_int,
                "hidden_size": opt_int,
                "members": integer,
                "gaps": {"type": "array", "items": string},
                "complete": {"type": "boolean"},
                "inflight": integer,
                "slow_replies": {**integer, "description": "replies later than their deadline from members still "
                                 "heartbeating: moved to another replica or waited for, never counted as failures"},
                "memory_mb": number,
                "limits": {
                    "type": "object",
                    "description": "The router's own bounds; a routed or proxied request also meets its members' (their /v1/stats)",
                    "required": ["max_body_bytes", "max_reply_bytes", "max_layers_per_request", "max_grid_body_bytes",
                                 "upstream_timeout_s"],
                    "properties": {"max_body_bytes": integer, "max_reply_bytes": integer, "max_layers_per_request": string,
                                   "max_grid_body_bytes": integer, "upstream_timeout_s": number,
                                   "upstream_ms_per_row_layer": number, "upstream_max_wait_s": number},
                },
            },
        },
    }
    return document(
        "larql-edge router",
        "The grid's one URL: FFN routing over layer-sharded members, the embed server's routes proxied, and grid "
        "membership (members join with the grid key as a bearer token).",
        paths,
        schemas,
    )


if __name__ == "__main__":
    main(openapi_spec)
