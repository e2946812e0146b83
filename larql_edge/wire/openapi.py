"""What the OpenAPI documents of every server share: the error envelope, the ops routes, numbers.

The wires' own parts are beside their codecs (`larql_edge.wire.embed_api`, `larql_edge.wire.ffn_api`:
the router serves both). Each role builds its document in code (``larql_edge.roles.<role>.openapi``), committed as
``openapi/<role>.json`` and served at ``GET /openapi.json``. A document takes an optional
*deployment* (what one running server publishes in ``/v1/stats``: its limits, and the dimensions
of its model): without it, the document states the default limits and describes what depends on
the model in words; with it, the same document also states those values as schema constraints
(the exact width of a residual, the vocabulary of token ids, the layers served), which is what
the schemathesis tests run against.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable

from larql_edge.wire import BINARY as BIN
from larql_edge.wire import JSON
from larql_edge.wire.numbers import MAX_ABS_VALUE

ENVELOPE = (
    'Every error is {"error": "message"} (application/json). A method a path does not list is '
    "405 with an Allow header naming the methods it has; a body over max_body_bytes is 413; JSON "
    "bodies are nested at most 32 levels deep and take no NaN or Infinity; numbers must be JSON "
    "numbers (no strings, booleans or null), an integer may be written as 3 or 3.0, and a residual "
    "value is at most 1e12 in magnitude (JSON and binary alike)."
)


def ref(name: str) -> dict:
    return {"$ref": f"#/components/schemas/{name}"}


def err(desc: str) -> dict:
    return {"description": desc, "content": {JSON: {"schema": ref("Error")}}}


def ok(desc: str, schema: dict, binary: dict | None = None, binary_type: str = BIN) -> dict:
    content = {JSON: {"schema": schema}}
    if binary:
        content[binary_type] = {"schema": binary}
    return {"description": desc, "content": content}


def binary(description: str) -> dict:
    return {"type": "string", "format": "binary", "description": description}


def f32(description: str | None = None) -> dict:
    """A residual value: a JSON number of magnitude at most MAX_ABS_VALUE (`larql_edge.wire.numbers`)."""
    out: dict = {"type": "number", "minimum": -MAX_ABS_VALUE, "maximum": MAX_ABS_VALUE}
    if description:
        out["description"] = description
    return out


def exactly(schema: dict, n: int | None, description: str) -> dict:
    """An array of exactly ``n`` items when the deployment is known, else described in words."""
    out = dict(schema, description=description)
    if n is not None:
        out |= {"minItems": n, "maxItems": n}
    return out


ERROR_SCHEMA = {
    "type": "object",
    "required": ["error"],
    "properties": {"error": {"type": "string"}},
}
OBJECT = {"type": "object"}


def ops_paths(role: str, ready: dict, stats: dict, ready_503: str) -> dict:
    """``/v1/health``, ``/v1/ready``, ``/v1/stats``, ``/metrics`` and ``/openapi.json``."""

    def op(op_id: str, summary: str, responses: dict) -> dict:
        return {"get": {"summary": summary, "operationId": op_id, "tags": ["service"], "responses": responses}}

    return {
        "/v1/health": op(
            "health",
            "Alive: answers as soon as the process listens",
            {"200": ok("Alive", {"type": "object", "required": ["status"], "properties": {"status": {"const": "ok"}}})},
        ),
        "/v1/ready": op("ready", "Ready to serve", {"200": ok("Ready", ready), "503": err(ready_503)}),
        "/v1/stats": op("stats", "Figures and every enforced limit", {"200": ok("Stats", stats)}),
        "/metrics": op(
            "metrics",
            f"Prometheus metrics (prefix larql_{role}_)",
            {"200": {"description": "Prometheus text format", "content": {"text/plain": {"schema": {"type": "string"}}}}},
        ),
        "/openapi.json": op("openapi", "This description", {"200": ok("OpenAPI 3.1 document", OBJECT)}),
    }


def member_paths() -> dict:
    """``POST /v1/membership/leave`` of a grid member (`larql_edge.service.membership.LEAVE_PATH`)."""
    reply = {"type": "object", "required": ["left", "draining"],
             "properties": {"left": {"type": "integer"}, "draining": {"const": True}}}
    return {"/v1/membership/leave": {"post": {
        "summary": "Leave every router and drain (what a Kubernetes preStop hook calls)",
        "operationId": "membershipLeave",
        "tags": ["grid"],
        "description": "Present when the server joined a grid (--join); 404 otherwise.",
        "security": [{"gridKey": []}],
        "responses": {"200": ok("Left: /v1/ready answers 503 from now on", reply),
                      "401": err("No grid key, or a wrong one"), "404": err("Not a grid member")},
    }}}


def document(title: str, description: str, paths: dict, schemas: dict) -> dict:
    return {
        "openapi": "3.1.0",
        "info": {"title": title, "version": "1", "description": f"{description} {ENVELOPE}"},
        "paths": paths,
        "components": {
            "schemas": {"Error": ERROR_SCHEMA, **schemas},
            "securitySchemes": {"gridKey": {"type": "http", "scheme": "bearer", "description": "The grid key"}},
        },
    }


def main(spec: Callable[[], dict]) -> None:
    """Print the default document (what ``openapi/<role>.json`` holds)."""
    json.dump(spec(), sys.stdout, indent=2, sort_keys=True)
    sys.stdout.write("\n")
