"""The OpenAPI description of the embed server, served at ``GET /openapi.json``.

The committed copy ``openapi/embed.json`` is ``openapi_spec()`` (a test keeps the two equal and
checks that every route of the app is described); regenerate it with
``python -m larql_edge.roles.embed.openapi > openapi/embed.json``. ``openapi_spec(deployment)``
is the same document narrowed to one running server (`larql_edge.service.openapi`): its limits
(``/v1/stats``) and its models' ids, vocabularies, widths and sha256s (``/v1/models``).
"""

from __future__ import annotations

from larql_edge.roles.embed.config import Limits
from larql_edge.service.openapi import BIN, binary, document, err, exactly, f32, main, ok, ops_paths, ref

ERRORS = {
    "400": err("Malformed or invalid input"),
    "404": err("Unknown model, or no such route"),
    "413": err("Body larger than max_body_bytes, or more items than a published limit"),
    "415": err("Content-Type is neither application/json nor application/x-larql-ffn"),
    "503": err("Not loaded yet"),
}
MODEL_PATTERN = "^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"  # larql_edge.roles.embed.config.MODEL_ID
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


class _Deployment:
    """What the document knows of one server: its limits always, its models when given."""

    def __init__(self, deployment: dict | None):
        d = deployment or {}
        self.limits = d.get("limits") or Limits().as_json()
        models = d.get("models") or []
        self.ids = [m["id"] for m in models] or None
        self.shas = [m["embeddings_sha256"] for m in models if m.get("embeddings_sha256")] or None
        # Several models: the constraints every one of them accepts.
        self.vocab = min((m["vocab_size"] for m in models), default=None)
        widths = {m["hidden_size"] for m in models}
        self.hidden = widths.pop() if len(widths) == 1 else None

    def model_schema(self, empty: bool = False) -> dict:
        """A model id; ``empty``: also the empty string (an empty X-Model-Id header means the default)."""
        if self.ids:
            return {"type": "string", "enum": self.ids + [""] * empty}
        return {"type": "string", "pattern": f"^$|{MODEL_PATTERN}" if empty else MODEL_PATTERN}

    def token_id(self) -> dict:
        out: dict = {"type": "integer", "minimum": 0, "description": "A token id below the model's vocab_size"}
        if self.vocab is not None:
            out["exclusiveMaximum"] = self.vocab
        return out

    def id_list(self, what: str) -> dict:
        n = self.limits["max_tokens_per_request"]
        return {"type": "array", "items": self.token_id(), "maxItems": n, "description": f"{what}: at most {n} ids"}


def _params(dep: _Deployment) -> tuple[dict, dict]:
    model_id = {
        "name": "model_id",
        "in": "path",
        "required": True,
        "description": "Model id (see GET /v1/models); the unprefixed route uses X-Model-Id or the default model",
        "schema": dep.model_schema(),
    }
    header = {
        "name": "X-Model-Id",
        "in": "header",
        "required": False,
        "description": "Model id for unprefixed routes; absent or empty: the first model given to the server",
        "schema": dep.model_schema(empty=True),
    }
    return model_id, header


TOKEN = {
    "name": "token",
    "in": "path",
    "required": True,
    "description": "Token id in decimal (at most 10 digits), optionally followed by .json to ask for the JSON representation; "
    "an id at or beyond the vocabulary is a 404",
    "schema": {"type": "string", "pattern": "^[0-9]{1,10}(\\.json)?$"},
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
                    BIN: {"schema": binary("f32[hidden], little-endian, no header")},
                    "application/json": {"schema": ref("EmbedRow")},
                },
            },
            "304": {"description": "If-None-Match matched", "headers": ROW_HEADERS},
            "400": ERRORS["400"],
            "404": err("Id beyond the vocabulary, unknown model or sha256"),
            "406": err("Accept allows neither representation"),
            "503": ERRORS["503"],
        },
    }


def _both(path: str, ops: dict, tag: str, model_id: dict, header: dict) -> dict:
    """The unprefixed path (X-Model-Id) and its /v1/{model_id} twin."""
    plain, prefixed = {}, {}
    for method, op in ops.items():
        a = dict(op, tags=[tag], parameters=[header] + op.get("parameters", []))
        b = dict(op, tags=[tag], operationId=op["operationId"] + "ByModel", parameters=[model_id] + op.get("parameters", []))
        plain[method], prefixed[method] = a, b
    return {f"/v1{path}": plain, f"/v1/{{model_id}}{path}": prefixed}


def _body(schema: dict, binary_schema: dict | None = None) -> dict:
    content = {"application/json": {"schema": schema}}
    if binary_schema:
        content[BIN] = {"schema": binary_schema}
    return {"required": True, "content": content}


def _q(name: str, desc: str, schema: dict, required: bool = False) -> dict:
    return {"name": name, "in": "query", "required": required, "description": desc, "schema": schema}


# Up to this many ids per request, a narrowed document states "seq_len equals len(token_ids)" exactly,
# one branch per length (JSON Schema cannot compare a number with an array's length otherwise).
EXACT_SEQ_LEN_UP_TO = 64


def _embed_request(dep: _Deployment) -> dict:
    n = dep.limits["max_tokens_per_request"]
    ids = dict(dep.id_list("Token ids"), minItems=1)
    seq_len = {"type": "integer", "minimum": 1, "maximum": n, "description": "Optional (never null); must equal len(token_ids)"}
    out = {"type": "object", "required": ["token_ids"], "properties": {"token_ids": ids, "seq_len": seq_len}}
    if dep.ids and n <= EXACT_SEQ_LEN_UP_TO:
        out["anyOf"] = [{"not": {"required": ["seq_len"]}}] + [
            {"required": ["seq_len"], "properties": {"token_ids": {"minItems": k, "maxItems": k}, "seq_len": {"const": k}}}
            for k in range(1, n + 1)
        ]
    return out


def openapi_spec(deployment: dict | None = None) -> dict:
    """The document; ``deployment`` (``{"limits": /v1/stats limits, "models": /v1/models models}``)
    narrows it to one server."""
    dep = _Deployment(deployment)
    lim = dep.limits
    model_id, header = _params(dep)
    both = lambda path, ops, tag: _both(path, ops, tag, model_id, header)  # noqa: E731
    paths: dict = {}
    paths.update(both("/embed", {"post": {
        "summary": "Token ids to scaled embedding rows",
        "operationId": "embed",
        "requestBody": _body(ref("EmbedRequest"), binary("u32 n, u32 ids[n]")),
        "responses": {
            "200": ok("Rows scaled by embed_scale; binary when the request is binary or Accept asks for it",
                      ref("EmbedResponse"), binary("u32 seq_len, u32 hidden, f32[seq_len*hidden]")),
            "406": err("Accept allows neither representation"),
            **ERRORS,
        },
    }}, "embeddings"))
    paths["/v1/embed/{token}"] = {
        "get": _row_op("embedRow", [header], "One embedding row (CDN-cacheable)"),
        "head": _row_op("embedRowHead", [header], "Headers of GET /v1/embed/{token}"),
    }
    paths["/v1/{model_id}/embed/{token}"] = {
        "get": _row_op("embedRowByModel", [model_id], "One embedding row of a named model"),
        "head": _row_op("embedRowByModelHead", [model_id], "Headers of the row"),
    }
    sha = {"name": "sha", "in": "path", "required": True, "description": "sha256 of the model's embeddings.bin",
           "schema": {"type": "string", "enum": dep.shas} if dep.shas else {"type": "string"}}
    paths["/v1/models/{sha}/embed/{token}"] = {
        "get": _row_op("embedRowBySha", [sha], "One embedding row, content-addressed by the weights' sha256"),
        "head": _row_op("embedRowByShaHead", [sha], "Headers of the content-addressed row"),
    }
    max_k = lim["max_top_k"] if dep.vocab is None else min(lim["max_top_k"], dep.vocab)
    top_k = {"type": "integer", "minimum": 1, "maximum": max_k, "description": "At most min(vocab_size, max_top_k)"}
    temperature = {"type": "number", "minimum": 0, "description": "0 means greedy"}
    paths.update(both("/logits", {"post": {
        "summary": "Pre-final-norm residual to next-token top-k (or raw logits)",
        "operationId": "logits",
        "description": "Applies the final norm, lm_head, final softcap and temperature. Concurrent requests are "
        "batched into one matrix product. temperature 0 means greedy: order unchanged (argmax first), "
        "probabilities of temperature 1, raw logits unscaled.",
        "parameters": [
            _q("top_k", "Binary requests only (JSON requests put it in the body)", dict(top_k, default=5)),
            _q("temperature", "Binary requests only", dict(temperature, default=1.0)),
        ],
        "requestBody": _body(ref("LogitsRequest"), binary("f32[hidden], the residual before the final norm")),
        "responses": {
            "200": ok("Top-k JSON, or raw f32[vocab] with Accept: application/x-larql-ffn", ref("LogitsResponse"),
                      binary("f32[vocab] logits (divided by temperature when > 0)")),
            "406": err("Accept allows neither representation"),
            **ERRORS,
        },
    }}, "logits"))
    text = {"type": "string", "maxLength": lim["max_text_chars"], "description": f"At most {lim['max_text_chars']} characters"}
    flag = {"type": "boolean", "default": False}
    query_flag = {"type": "boolean", "description": "true/false (also 1/0, yes/no, on/off); default false"}
    enc_get = {
        "summary": "Text to token ids",
        "operationId": "encode",
        "parameters": [
            _q("text", "The text (may be empty)", text, required=True),
            _q("add_special_tokens", "Add the model's BOS etc. (default false)", query_flag),
        ],
        "responses": {"200": ok("Token ids", ref("EncodeResponse")), **ERRORS},
    }
    enc_post = {
        "summary": "Text (or a batch of texts) to token ids",
        "operationId": "encodePost",
        "requestBody": _body(ref("EncodeRequest")),
        "responses": {"200": ok("Token ids (a list per text for a batch)", ref("EncodeResponse")), **ERRORS},
    }
    dec_get = {
        "summary": "Token ids to text",
        "operationId": "decode",
        "parameters": [
            {"name": "ids", "in": "query", "required": True, "description": "Comma-separated ids", "style": "form",
             "explode": False, "schema": dict(dep.id_list("The ids"), minItems=1)},
            _q("skip_special_tokens", "Drop special tokens (default false)", query_flag),
        ],
        "responses": {"200": ok("Text", ref("DecodeResponse")), **ERRORS},
    }
    dec_post = {
        "summary": "Token ids (or a batch of id lists) to text",
        "operationId": "decodePost",
        "requestBody": _body(ref("DecodeRequest")),
        "responses": {"200": ok("Text (texts for a batch)", ref("DecodeResponse")), **ERRORS},
    }
    for path, ops in (("/token/encode", {"get": enc_get, "post": enc_post}), ("/token/decode", {"get": dec_get, "post": dec_post})):
        paths.update(both(path, ops, "tokenizer"))
    ops = ops_paths("embed", ref("Ready"), ref("Stats"), "Models still loading, or draining")
    ops["/v1/stats"]["get"]["responses"]["404"] = ERRORS["404"]
    ops["/v1/stats"]["get"]["parameters"] = [header]
    paths["/v1/stats"] = ops.pop("/v1/stats")
    paths["/v1/{model_id}/stats"] = {"get": dict(paths["/v1/stats"]["get"], operationId="statsByModel", parameters=[model_id])}
    paths["/v1/models"] = {
        "get": {
            "summary": "Models served by this process",
            "operationId": "models",
            "tags": ["service"],
            "responses": {"200": ok("Models", ref("Models"))},
        }
    }
    paths.update(ops)

    row = f32()
    hidden_row = exactly({"type": "array", "items": row}, dep.hidden, "hidden_size numbers")
    schemas = {
        "EmbedRequest": _embed_request(dep),
        "EmbedResponse": {
            "type": "object",
            "required": ["residual", "seq_len", "hidden_size", "model", "latency_ms"],
            "properties": {
                "residual": {"type": "array", "items": hidden_row},
                "seq_len": {"type": "integer"},
                "hidden_size": {"type": "integer"},
                "model": {"type": "string"},
                "latency_ms": {"type": "number"},
            },
        },
        "EmbedRow": {
            "type": "object",
            "required": ["token_id", "embedding", "hidden_size"],
            "properties": {"token_id": {"type": "integer"}, "embedding": hidden_row, "hidden_size": {"type": "integer"}},
        },
        "LogitsRequest": {
            "type": "object",
            "required": ["residual"],
            "properties": {
                "residual": exactly({"type": "array", "items": row}, dep.hidden,
                                    "hidden_size finite float32 numbers: the residual before the final norm"),
                "top_k": dict(top_k, default=5),
                "temperature": dict(temperature, default=1.0),
            },
        },
        "LogitsResponse": {
            "type": "object",
            "required": ["top_k", "model", "temperature", "greedy", "latency_ms"],
            "properties": {
                "top_k": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "required": ["token_id", "token", "prob", "logprob", "logit"],
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
            "description": 'Give "text" or "texts" (a batch; used when both are given)',
            "anyOf": [{"required": ["text"]}, {"required": ["texts"]}],
            "properties": {
                "text": text,
                "texts": {"type": "array", "items": text},
                "add_special_tokens": flag,
            },
        },
        "EncodeResponse": {
            "type": "object",
            "required": ["token_ids"],
            "properties": {
                "token_ids": {"anyOf": [{"type": "array", "items": {"type": "integer"}},
                                        {"type": "array", "items": {"type": "array", "items": {"type": "integer"}}}]},
                "text": {"type": "string"},
            },
        },
        "DecodeRequest": {
            "type": "object",
            "required": ["ids"],
            "properties": {
                "ids": {"anyOf": [dep.id_list("One list of ids"),
                                  {"type": "array", "minItems": 1, "items": dep.id_list("A batch: one list per text")}]},
                "skip_special_tokens": flag,
            },
        },
        "DecodeResponse": {
            "type": "object",
            "properties": {
                "text": {"type": "string"},
                "texts": {"type": "array", "items": {"type": "string"}},
                "token_ids": {"type": "array", "items": {"type": "integer"}},
            },
        },
        "Models": {
            "type": "object",
            "required": ["default", "models"],
            "properties": {
                "default": {"type": "string"},
                "models": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "required": ["id", "hidden_size", "vocab_size", "embeddings_sha256", "ready"],
                        "properties": {
                            "id": {"type": "string"},
                            "model": {"type": "string"},
                            "family": {"type": "string"},
                            "hidden_size": {"type": "integer"},
                            "vocab_size": {"type": "integer"},
                            "embeddings_sha256": {"type": ["string", "null"]},
                            "lm_head_tied": {"type": "boolean"},
                            "ready": {"type": "boolean"},
                            "embed_url": {"type": ["string", "null"], "description": "URI template of the content-addressed rows"},
                        },
                    },
                },
            },
        },
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
                "loaded": {
                    "type": "object",
                    "properties": {k: {"type": "boolean"} for k in ("embeddings", "lm_head", "tokenizer")},
                },
                "memory_mb": {"type": "number", "description": "RSS of the worker that answered"},
                "hot_cache": {"type": "object"},
                "logits_batching": {"type": "object"},
                "models": {"type": "array", "items": {"type": "string"}},
                "limits": {
                    "type": "object",
                    "description": "Every limit this server enforces (the values above are the defaults)",
                    "required": sorted(Limits().as_json()),
                    "properties": {k: {"type": "number"} for k in Limits().as_json()},
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
