"""Embedding lookups: ``POST /v1/embed`` (many ids) and the cacheable ``GET /v1/embed/{id}``."""

from __future__ import annotations

import time

import numpy as np
from sanic import Blueprint
from sanic.response import HTTPResponse, json

from larql_edge.errors import BadRequest, NotFound, ServiceUnavailable
from larql_edge.roles.embed import requests as rq
from larql_edge.roles.embed.caching import cache_headers, none_match
from larql_edge.roles.embed.routes._common import both, model_of
from larql_edge.service import BINARY_KIND, body_kind, json_object
from larql_edge.wire import BINARY
from larql_edge.wire import embed as wire
from larql_edge.wire.numbers import json_int

bp = Blueprint("embed")


def _check_finite(raw: bytes | memoryview, what: str) -> None:
    """Damaged weights are this server's failure (a 503: the router tries another embed member), and a
    row with NaN must never go out under the good file's content-addressed, immutable URL."""
    if not np.isfinite(np.frombuffer(raw, dtype="<f4")).all():
        raise ServiceUnavailable(f"{what}: non-finite values in the stored embeddings (damaged weights); "
                                 "run larql-slicer verify on the vindex")


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
    n, hidden = int(ids.size), m.hidden_size
    binary = rq.wants_binary(request, default_binary=kind == BINARY_KIND)
    store = m.store

    def checked(parts: list[bytes] | bytes) -> list[bytes] | bytes:
        for part in [parts] if isinstance(parts, bytes) else parts:
            _check_finite(part, "the rows asked for")
        return parts

    def as_binary(parts: list[bytes] | bytes) -> HTTPResponse:
        body = wire.encode_embed_response_parts(n, hidden, [parts] if isinstance(parts, bytes) else parts)
        return HTTPResponse(body, content_type=BINARY)

    if n > store.VECTOR_THRESHOLD:
        # 4,096 rows are 4,096 reads, a finiteness check and 10 MB to build: in the compute thread, so
        # eight such requests do not hold the loop's health checks for seconds (issue #19). The hot
        # cache's counts stay on the loop, which owns the cache.
        store.cache.count_many(ids)
        if binary:
            return await request.app.ctx.compute.run(lambda: as_binary(checked(store.gather(ids))))
        parts = await request.app.ctx.compute.run(lambda: checked(store.gather(ids)))
    else:
        parts = checked(store.rows_bytes(ids))
    if binary:
        return as_binary(parts)

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
    _check_finite(row, f"token id {tid}")
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
