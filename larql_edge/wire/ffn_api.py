"""``POST /v1/walk-ffn`` as an OpenAPI operation: what an FFN shard serves and the router routes
(`larql_edge.roles.ffn.openapi`, `larql_edge.roles.router.openapi`). The binary wire is described
in words (`larql_edge.wire.ffn`); the JSON form exactly, and, for one deployment (`WalkApi` given
its width, layers and limits), with every width, layer and row count stated as a constraint."""

from __future__ import annotations

from dataclasses import dataclass

from larql_edge.wire import BINARY_F16 as BIN_F16
from larql_edge.wire.ffn import MAX_BATCH_LAYERS
from larql_edge.wire.openapi import BIN, JSON, binary, err, f32, ref

# Up to this many rows, a narrowed document states "seq_len equals the number of rows" exactly.
EXACT_ROWS_UP_TO = 16

BINARY_REQUEST = (
    "Single: u32 layer, u32 seq_len, u32 flags (bit0 full_output: must be 1), u32 top_k, f32[seq_len*hidden]. "
    "Batch (the same rows through every listed layer): u32 0xFFFFFFFF, u32 num_layers, u32 layers[num_layers], "
    "u32 seq_len, u32 flags, u32 top_k, f32[seq_len*hidden]. Little-endian; values finite, at most 1e12 in magnitude."
)
BINARY_REPLY = (
    "Single: u32 layer, u32 seq_len, f32 latency_ms, VAL[seq_len*hidden]. Batch: u32 0xFFFFFFFF, u32 num_results, "
    "f32 latency_ms, then per result u32 layer, u32 seq_len, u32 n, VAL[n]. VAL is f32, or f16 when Accept asks "
    "for application/x-larql-ffn-f16."
)


@dataclass(frozen=True)
class WalkApi:
    """What one deployment accepts; None: not known (the generic document says it in words)."""

    hidden: int | None = None
    layer_min: int = 0
    layer_max: int | None = None  # inclusive
    max_layers: int | None = None
    max_rows: int | None = None
    layers_text: str = "layers this shard serves (layer_start to layer_end in /v1/stats)"

    def layer(self) -> dict:
        top = self.layer_max if self.layer_max is not None else MAX_BATCH_LAYERS - 1
        return {"type": "integer", "minimum": self.layer_min, "maximum": top, "description": f"One of the {self.layers_text}"}

    def layers(self) -> dict:
        n = min(self.max_layers or MAX_BATCH_LAYERS, MAX_BATCH_LAYERS)
        return {"type": "array", "items": self.layer(), "minItems": 1, "maxItems": n, "uniqueItems": True,
                "description": "A batch: the same rows through every listed layer, each named once"}

    def _rows(self, lo: int, hi: int | None) -> dict:
        row: dict = {"type": "array", "items": f32()}
        if self.hidden is not None:
            row |= {"minItems": self.hidden, "maxItems": self.hidden}
        out = {"type": "array", "items": row, "minItems": lo, "description": "seq_len rows of hidden_size numbers"}
        if hi is not None:
            out["maxItems"] = hi
        return out

    def _flat(self, rows: int) -> dict:
        assert self.hidden is not None
        n = rows * self.hidden
        return {"type": "array", "items": f32(), "minItems": n, "maxItems": n}

    def request(self) -> dict:
        rows = self.max_rows
        flat: dict = {"type": "array", "items": f32(), "minItems": 1,
                      "description": "Flat: seq_len x hidden_size numbers (seq_len given, or the length / hidden_size)"}
        if self.hidden is not None:
            flat["minItems"] = self.hidden
            if rows is not None:
                flat["maxItems"] = rows * self.hidden
        out: dict = {
            "type": "object",
            "required": ["residual"],
            "description": 'Exactly one of "layer" (a single-layer reply) or "layers" (a batch reply), at most max_rows '
            "rows. A JSON body counts against the same max_body_bytes as a binary one (413 above it), so a JSON request "
            "may carry fewer rows: a number takes up to 26 bytes as JSON text, 4 as f32.",
            "oneOf": [{"required": ["layer"], "not": {"required": ["layers"]}},
                      {"required": ["layers"], "not": {"required": ["layer"]}}],
            "properties": {
                "layer": self.layer(),
                "layers": self.layers(),
                "residual": {"anyOf": [self._rows(1, rows), flat]},
                "seq_len": {"type": "integer", "minimum": 1, "description": "Optional (never null): the number of rows"},
                "full_output": {"type": "boolean", "const": True, "description": "Only the full output is served"},
                "top_k": {"type": "integer", "minimum": 0, "description": "Accepted and ignored"},
            },
        }
        if self.hidden is not None and rows is not None and rows <= EXACT_ROWS_UP_TO:
            # One branch per form and row count: seq_len, when given, is the number of rows, and a flat
            # residual is a whole number of rows (a flat anyOf: what a generator can draw from).
            del out["oneOf"]
            out["anyOf"] = [
                {"required": [which], "properties": {other: False, "seq_len": {"const": k},
                                                     "residual": {"anyOf": [self._rows(k, k), self._flat(k)]}}}
                for which, other in (("layer", "layers"), ("layers", "layer")) for k in range(1, rows + 1)
            ]
        return out

    def schemas(self) -> dict:
        output = {"type": "array", "items": {"type": "array", "items": {"type": "number"}}}
        item: dict = {"type": "object", "required": ["layer", "seq_len", "output"],
                "properties": {"layer": {"type": "integer"}, "seq_len": {"type": "integer"}, "output": output}}
        return {
            "WalkRequest": self.request(),
            "WalkResponse": {"oneOf": [
                {"type": "object", "required": ["layer", "seq_len", "output", "latency_ms"],
                 "properties": item["properties"] | {"latency_ms": {"type": "number"}}},
                {"type": "object", "required": ["results", "latency_ms"],
                 "properties": {"results": {"type": "array", "items": item}, "latency_ms": {"type": "number"}}},
            ]},
        }

    def operation(self, summary: str, errors: dict) -> dict:
        return {"post": {
            "summary": summary,
            "operationId": "walkFfn",
            "tags": ["ffn"],
            "parameters": [{"name": "Accept", "in": "header", "required": False,
                            "description": "Binary requests: application/x-larql-ffn-f16 asks for f16 values",
                            "schema": {"type": "string"}}],
            "requestBody": {"required": True, "content": {
                JSON: {"schema": ref("WalkRequest")},
                BIN: {"schema": binary(BINARY_REQUEST)},
            }},
            "responses": {
                "200": {"description": "The FFN output of every listed layer for every row: JSON for a JSON request, "
                        "binary for a binary one", "content": {
                            JSON: {"schema": ref("WalkResponse")},
                            BIN: {"schema": binary(BINARY_REPLY)},
                            BIN_F16: {"schema": binary(BINARY_REPLY)}}},
                "400": err("Malformed body, a layer not served or listed twice, full_output not set, a width that is not hidden_size"),
                "413": err("Body over max_body_bytes, more rows than max_rows, or a reply over max_reply_bytes"),
                "415": err("Content-Type is neither application/json nor application/x-larql-ffn"),
                **errors,
            },
        }}
