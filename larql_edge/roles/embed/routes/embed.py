"""Embedding lookups: ``POST /v1/embed`` (many ids) and the cacheable ``GET /v1/embed/{id}``."""

from __future__ import annotations

import time

import numpy as np
from sanic import Blueprint
from sanic.response import HTTPResponse, json

from larql_edge.errors import BadRequest, NotFound
from larql_edge.roles.embed import requests as rq
from larql_edge.roles.embed.caching import cache_headers, none_match
from larql_edge.roles.embed.routes._common import both, model_of
from larql_edge.service import BINARY_KIND, body_kind, json_object
from larql_edge.wire import BINARY
from larql_edge.wire import embed as wire
from larql_edge.wire.numbers import json_int

bp = Blueprint("embed")


@both(bp, "/embed", ["POST"], "embed")
async def embed(request, model_id: str | None = None):
    t0 = time.perf_counter()
    m = model_of(request, model_id)
    kind = body_kind(request)
    if kind == BINARY_KIND:
        ids = wire.decode_embed_request(request.body)
    else:
        obj = json_object(request)
        if "token_ids" not in obj:
            raise BadRequest('missing "token_ids" (a list of token ids)')
        ids = rq.json_ids(obj["token_ids"])
        if "seq_len" in obj and json_int(obj["seq_len"]) != ids.size:  # optional, but never null
            raise BadRequest(f"seq_len {obj['seq_len']!r} disagrees with {ids.size} token_ids")
    ids = rq.check_ids(ids, m.vocab_size, request.app.ctx.cfg.limits.max_tokens)
    parts = m.store.rows_bytes(ids)
    n, hidden = int(ids.size), m.hidden_size
    if rq.wants_binary(request, default_binary=kind == BINARY_KIND):
        body = wire.encode_embed_response_parts(n, hidden, [parts] if isinstance(parts, bytes) else parts)
        return HTTPResponse(body, content_type=BINARY)

    def as_json() -> HTTPResponse:  # 4,096 rows make ~50 MB of JSON: built in the compute thread, not on the loop
        raw = parts if isinstance(parts, bytes) else b"".join(parts)
        rows = np.frombuffer(raw, dtype="<f4").reshape(n, hidden)
        return json({"residual": rows.tolist(), "seq_len": n, "hidden_size": hidden, "model": m.id,
                     "latency_ms": round((time.perf_counter() - t0) * 1e3, 4)})

    return await request.app.ctx.compute.run(as_json)


def _row(request, m, token: str, vary_model: bool) -> HTTPResponse:
    # The hot path of the server (a decode step's lookup, a CDN miss): kept free of extra work.
    if token.endswith(".json"):
        token, rep = token[:-5], "json"
    else:
        rep = "bin" if rq.wants_binary(request, default_binary=True) else "json"
    tid = rq.path_id(token)
    if tid >= m.vocab_size:
        raise NotFound(f"token id {tid} is out of range [0, {m.vocab_size})")
    etag = m.etag(tid, rep)
    headers = cache_headers(etag, vary_model)
    if none_match(request.headers.get("if-none-match"), etag):
        return HTTPResponse(status=304, headers=headers)
    row = m.store.row_bytes(tid)
    if rep == "bin":
        return HTTPResponse(row, headers=headers, content_type=BINARY)
    payload = {"token_id": tid, "embedding": np.frombuffer(row, dtype="<f4").tolist(), "hidden_size": m.hidden_size}
    return json(payload, headers=headers)


@bp.route("/v1/embed/<token:str>", methods=["GET", "HEAD"], name="embed_row")
async def embed_row(request, token: str):
    reg = request.app.ctx.registry
    return _row(request, model_of(request), token, vary_model=reg.multi)


@bp.route("/v1/<model_id:str>/embed/<token:str>", methods=["GET", "HEAD"], name="embed_row_by_model")
async def embed_row_by_model(request, model_id: str, token: str):
    return _row(request, model_of(request, model_id), token, vary_model=False)


@bp.route("/v1/models/<sha:str>/embed/<token:str>", methods=["GET", "HEAD"], name="embed_row_by_sha")
async def embed_row_by_sha(request, sha: str, token: str):
    return _row(request, request.app.ctx.registry.by_sha(sha), token, vary_model=False)
