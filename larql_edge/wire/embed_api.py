"""The embed server's HTTP API as OpenAPI paths and schemas: what ``larql-embed`` serves and what the
router proxies (`larql_edge.roles.embed.openapi`, `larql_edge.roles.router.openapi`).

`EmbedApi(limits, models)`: ``limits`` is the embed server's ``/v1/stats`` ``limits`` (None: not
known, as for the router, whose embed members publish their own), ``models`` its ``/v1/models``
list (None: the generic document; given: the document of that one server, every id, width and
vocabulary stated as a constraint).
"""

from __future__ import annotations

from larql_edge.wire.embed import MIN_TEMPERATURE
from larql_edge.wire.openapi import BIN, JSON, binary, err, exactly, f32, ok, ref

MODEL_PATTERN = "^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"  # larql_edge.roles.embed.config.MODEL_ID
# Up to this many ids per request, a narrowed document states "seq_len equals len(token_ids)" exactly,
# one branch per length (JSON Schema cannot compare a number with an array's length otherwise).
EXACT_SEQ_LEN_UP_TO = 64

ERRORS = {
    "400": err("Malformed or invalid input"),
    "404": err("Unknown model, or no such route"),
    "413": err("Body larger than max_body_bytes, or more items than a published limit"),
    "415": err("Content-Type is neither application/json nor application/x-larql-ffn"),
    "503": err("Not loaded yet (or, at the router, no embed server could answer)"),
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
TOKEN = {
    "name": "token",
    "in": "path",
    "required": True,
    "description": "Token id in decimal (at most 10 digits), optionally followed by .json to ask for the JSON representation; "
    "an id at or beyond the vocabulary is a 404",
    "schema": {"type": "string", "pattern": "^[0-9]{1,10}(\\.json)?$"},
}


def _q(name: str, desc: str, schema: dict, required: bool = False) -> dict:
    return {"name": name, "in": "query", "required": required, "description": desc, "schema": schema}


def _body(schema: dict, binary_schema: dict | None = None) -> dict:
    content = {JSON: {"schema": schema}}
    if binary_schema:
        content[BIN] = {"schema": binary_schema}
    return {"required": True, "content": content}


class EmbedApi:
    def __init__(self, limits: dict | None, models: list[dict] | None = None):
        self.limits = limits or {}
        models = models or []
        self.ids = [m["id"] for m in models] or None
        self.shas = [m["embeddings_sha256"] for m in models if m.get("embeddings_sha256")] or None
        # Several models: the constraints every one of them accepts.
        self.vocab = min((m["vocab_size"] for m in models), default=None)
        widths = {m["hidden_size"] for m in models}
        self.hidden = widths.pop() if len(widths) == 1 else None
        self.model_id = {
            "name": "model_id",
            "in": "path",
            "required": True,
            "description": "Model id (see GET /v1/models); the unprefixed route uses X-Model-Id or the default model",
            "schema": self._model_schema(),
        }
        self.header = {
            "name": "X-Model-Id",
            "in": "header",
            "required": False,
            "description": "Model id for unprefixed routes; absent or empty: the first model given to the server",
            "schema": self._model_schema(empty=True),
        }

    # -- pieces ------------------------------------------------------------------------------------
    def _model_schema(self, empty: bool = False) -> dict:
        """A model id; ``empty``: also the empty string (an empty X-Model-Id header means the default)."""
        if self.ids:
            return {"type": "string", "enum": self.ids + [""] * empty}
        return {"type": "string", "pattern": f"^$|{MODEL_PATTERN}" if empty else MODEL_PATTERN}

    def _limit(self, name: str) -> int | None:
        return self.limits.get(name)

    def token_id(self) -> dict:
        out: dict = {"type": "integer", "minimum": 0, "description": "A token id below the model's vocab_size"}
        if self.vocab is not None:
            out["exclusiveMaximum"] = self.vocab
        return out

    def id_list(self, what: str) -> dict:
        n = self._limit("max_tokens_per_request")
        out: dict = {"type": "array", "items": self.token_id(), "description": f"{what}: at most max_tokens_per_request ids"}
        if n is not None:
            out["maxItems"] = n
        return out

    def text(self) -> dict:
        n = self._limit("max_text_chars")
        out: dict = {"type": "string", "description": "At most max_text_chars characters"}
        if n is not None:
            out["maxLength"] = n
        return out

    def both(self, path: str, ops: dict, tag: str) -> dict:
        """The unprefixed path (X-Model-Id) and its /v1/{model_id} twin."""
        plain, prefixed = {}, {}
        for method, op in ops.items():
            params = op.get("parameters", [])
            plain[method] = dict(op, tags=[tag], parameters=[self.header] + params)
            prefixed[method] = dict(op, tags=[tag], operationId=op["operationId"] + "ByModel", parameters=[self.model_id] + params)
        return {f"/v1{path}": plain, f"/v1/{{model_id}}{path}": prefixed}

    def _row_op(self, op_id: str, params: list[dict], summary: str) -> dict:
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
                    "content": {BIN: {"schema": binary("f32[hidden], little-endian, no header")}, JSON: {"schema": ref("EmbedRow")}},
                },
                "304": {"description": "If-None-Match matched", "headers": ROW_HEADERS},
                "400": ERRORS["400"],
                "404": err("Id beyond the vocabulary, unknown model or sha256"),
                "406": err("Accept allows neither representation"),
                "503": ERRORS["503"],
            },
        }

    # -- the document's parts ---------------------------------------------------------------------
    def paths(self) -> dict:
        paths: dict = {}
        paths.update(self.both("/embed", {"post": {
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
            "get": self._row_op("embedRow", [self.header], "One embedding row (CDN-cacheable)"),
            "head": self._row_op("embedRowHead", [self.header], "Headers of GET /v1/embed/{token}"),
        }
        paths["/v1/{model_id}/embed/{token}"] = {
            "get": self._row_op("embedRowByModel", [self.model_id], "One embedding row of a named model"),
            "head": self._row_op("embedRowByModelHead", [self.model_id], "Headers of the row"),
        }
        sha = {"name": "sha", "in": "path", "required": True, "description": "sha256 of the model's embeddings.bin",
               "schema": {"type": "string", "enum": self.shas} if self.shas else {"type": "string"}}
        paths["/v1/models/{sha}/embed/{token}"] = {
            "get": self._row_op("embedRowBySha", [sha], "One embedding row, content-addressed by the weights' sha256"),
            "head": self._row_op("embedRowByShaHead", [sha], "Headers of the content-addressed row"),
        }
        paths.update(self.both("/logits", {"post": {
            "summary": "Pre-final-norm residual to next-token top-k (or raw logits)",
            "operationId": "logits",
            "description": "Applies the final norm, lm_head, final softcap and temperature. Concurrent requests are "
            "batched into one matrix product. temperature 0 means greedy: order unchanged (argmax first), "
            "probabilities of temperature 1, raw logits unscaled. top_k and temperature may be given in the query "
            "(what binary requests use) and are checked there on every request; a JSON body's values win. "
            'Many rows (larql-serve\'s one request per decode step): a JSON body with "residuals" (a list of rows), '
            "or a binary body of rows x f32[hidden] with ?rows=N, answered with one top-k list per row under \"rows\" "
            "(or raw f32[rows * vocab] with the binary Accept); all rows in one lm_head product; at most max_batch rows. "
            "Structured output: with ?masked=i,j (binary, with ?rows=N) the residuals are followed by one token bitmask "
            "per listed row, u32[ceil(vocab / 32)] (bit t % 32 of word t // 32 set: token t allowed); a masked row's "
            "other tokens are -inf before its top k (so fewer than top_k may be answered), log-probabilities are over "
            "the allowed tokens. Candidates beyond the top k: with ?extra=i,j (binary, with ?rows=N) the body ends with a "
            "token-id list per listed row, u32 n then u32 ids[n] (n <= 1024); the top-k JSON answer then has \"extra\", "
            "one list per row of {token_id, logprob, logit} for those ids (ids a row's mask disallows left out).",
            "parameters": [
                _q("rows", "Binary requests: the body holds this many residuals (the many-rows form)",
                   {"type": "integer", "minimum": 1, "maximum": int(self.limits.get("max_batch", 64))}),
                _q("masked", "Binary many-rows requests: the rows (ascending, comma-separated) whose token bitmasks "
                   "follow the residuals", {"type": "string", "pattern": "^[0-9]+(,[0-9]+)*$"}),
                _q("extra", "Binary many-rows requests answered as top-k JSON: the rows (ascending, comma-separated) "
                   "whose token-id lists end the body", {"type": "string", "pattern": "^[0-9]+(,[0-9]+)*$"}),
                _q("top_k", "Binary requests (a JSON body's top_k wins)", dict(self.top_k(), default=5)),
                _q("temperature", "Binary requests (a JSON body's temperature wins)", dict(self.temperature(), default=1.0)),
            ],
            "requestBody": _body({"anyOf": [ref("LogitsRequest"), ref("LogitsRowsRequest")]},
                                 binary("f32[hidden], the residual before the final norm (rows x f32[hidden] with ?rows=N)")),
            "responses": {
                "200": ok("Top-k JSON, or raw f32[vocab] with Accept: application/x-larql-ffn",
                          {"anyOf": [ref("LogitsResponse"), ref("LogitsRowsResponse")]},
                          binary("f32[vocab] logits (divided by temperature when > 0); f32[rows * vocab] for many rows")),
                "406": err("Accept allows neither representation"),
                **ERRORS,
            },
        }}, "logits"))
        query_flag = {"type": "boolean", "description": "true/false (also 1/0, yes/no, on/off); default false"}
        enc_get = {
            "summary": "Text to token ids",
            "operationId": "encode",
            "parameters": [
                _q("text", "The text (may be empty). The URL is read up to 16 KB (the server's request head "
                   "limit); a longer text goes in the POST form's body", self.text(), required=True),
                _q("add_special_tokens", "Add the model's BOS etc. (default false)", query_flag),
            ],
            "responses": {"200": ok("Token ids", ref("EncodeResponse")), **ERRORS,
                          "414": err("The URL is over 16 KB: send the text with POST /v1/token/encode")},
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
                 "explode": False, "schema": dict(self.id_list("The ids"), minItems=1)},
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
        paths.update(self.both("/token/encode", {"get": enc_get, "post": enc_post}, "tokenizer"))
        paths.update(self.both("/token/decode", {"get": dec_get, "post": dec_post}, "tokenizer"))
        paths["/v1/models"] = {
            "get": {
                "summary": "Models served by this process",
                "operationId": "models",
                "tags": ["service"],
                "responses": {"200": ok("Models", ref("Models"))},
            }
        }
        return paths

    def top_k(self) -> dict:
        out = {"type": "integer", "minimum": 1, "description": "At most min(vocab_size, max_top_k)"}
        bounds = [b for b in (self._limit("max_top_k"), self.vocab) if b is not None]
        if bounds:
            out["maximum"] = min(bounds)
        return out

    @staticmethod
    def temperature() -> dict:
        return {"type": "number", "description": f"0 means greedy; otherwise at least {MIN_TEMPERATURE}",
                "anyOf": [{"const": 0}, {"minimum": MIN_TEMPERATURE}]}

    def embed_request(self) -> dict:
        n = self._limit("max_tokens_per_request")
        seq_len = {"type": "integer", "minimum": 1, "description": "Optional (never null); must equal len(token_ids)"}
        if n is not None:
            seq_len["maximum"] = n
        out: dict = {"type": "object", "required": ["token_ids"],
               "properties": {"token_ids": dict(self.id_list("Token ids"), minItems=1), "seq_len": seq_len}}
        if self.ids and n is not None and n <= EXACT_SEQ_LEN_UP_TO:
            out["anyOf"] = [{"not": {"required": ["seq_len"]}}] + [
                {"required": ["seq_len"], "properties": {"token_ids": {"minItems": k, "maxItems": k}, "seq_len": {"const": k}}}
                for k in range(1, n + 1)
            ]
        return out

    def schemas(self) -> dict:
        row = f32()
        number = {"type": "number"}
        hidden_row = exactly({"type": "array", "items": number}, self.hidden, "hidden_size numbers")
        return {
            "EmbedRequest": self.embed_request(),
            "EmbedResponse": {
                "type": "object",
                "required": ["residual", "seq_len", "hidden_size", "model", "latency_ms"],
                "properties": {
                    "residual": {"type": "array", "items": hidden_row},
                    "seq_len": {"type": "integer"},
                    "hidden_size": {"type": "integer"},
                    "model": {"type": "string"},
                    "latency_ms": number,
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
                    "residual": exactly({"type": "array", "items": row}, self.hidden,
                                        "hidden_size numbers: the residual before the final norm"),
                    "top_k": dict(self.top_k(), default=5),
                    "temperature": dict(self.temperature(), default=1.0),
                },
            },
            "LogitsRowsRequest": {
                "type": "object",
                "required": ["residuals"],
                "properties": {
                    "residuals": {"type": "array", "minItems": 1, "maxItems": int(self.limits.get("max_batch", 64)),
                                  "items": exactly({"type": "array", "items": row}, self.hidden, "hidden_size numbers"),
                                  "description": "Residuals before the final norm, one row per position"},
                    "top_k": dict(self.top_k(), default=5),
                    "temperature": dict(self.temperature(), default=1.0),
                },
            },
            "LogitsRowsResponse": {
                "type": "object",
                "required": ["rows", "model", "temperature", "greedy", "latency_ms"],
                "properties": {
                    "rows": {"type": "array", "items": {"type": "array", "items": {"type": "object"}},
                             "description": "Per row, its top-k list (the items of LogitsResponse's top_k)"},
                    "extra": {"type": "array", "items": {"type": "array", "items": {
                        "type": "object", "required": ["token_id", "logprob", "logit"],
                        "properties": {"token_id": {"type": "integer", "minimum": 0}, "logprob": number,
                                       "logit": number}}},
                              "description": "With ?extra=: per row, the listed ids' log-probabilities and logits "
                                             "(empty for a row not listed)"},
                    "model": {"type": "string"},
                    "temperature": number,
                    "greedy": {"type": "boolean"},
                    "latency_ms": number,
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
                            "properties": {"token_id": {"type": "integer"}, "token": {"type": "string"}, "prob": number,
                                           "logprob": number, "logit": number},
                        },
                    },
                    "model": {"type": "string"},
                    "temperature": number,
                    "greedy": {"type": "boolean"},
                    "latency_ms": number,
                },
            },
            "EncodeRequest": {
                "type": "object",
                "description": 'Give "text" or "texts" (a batch; encoded when both are given, "text" is still checked)',
                "anyOf": [{"required": ["text"]}, {"required": ["texts"]}],
                "properties": {"text": self.text(), "texts": {"type": "array", "items": self.text()},
                               "add_special_tokens": {"type": "boolean", "default": False}},
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
                    "ids": {"anyOf": [self.id_list("One list of ids"),
                                      {"type": "array", "minItems": 1, "items": self.id_list("A batch: one list per text")}]},
                    "skip_special_tokens": {"type": "boolean", "default": False},
                },
            },
            "DecodeResponse": {
                "type": "object",
                "properties": {"text": {"type": "string"}, "texts": {"type": "array", "items": {"type": "string"}},
                               "token_ids": {"type": "array", "items": {"type": "integer"}}},
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
        }
