"""The router as the embed server's front door, so a client needs one URL for the whole grid.

Exactly the embed server's documented routes are proxied, unprefixed and under ``/v1/{model_id}/``:
``POST /v1/embed``, ``GET|HEAD /v1/embed/{id}``, ``GET|HEAD /v1/models/{sha}/embed/{id}``,
``GET /v1/models``, ``POST /v1/logits``, ``GET|POST /v1/token/encode|decode``. The upstream path is
rebuilt from the validated parameters (a token id, an ``.json`` suffix, a sha256, a model id), never
copied from the request, so no ``..`` or encoded segment can reach another route of a member.

Requests go to a live embed member, failing over to another when one cannot answer (5xx, no reply:
`larql_edge.net.failures`, proxied); replies come back with their status, body and caching
headers unchanged (ETag, Cache-Control, Vary), so the CDN contract of DESIGN.md §2 survives.
"""

from __future__ import annotations

import re

from sanic import Blueprint
from sanic.request import Request
from sanic.response import HTTPResponse, raw

from larql_edge.errors import BadRequest, NotFound, ServiceUnavailable
from larql_edge.roles.router.upstream import FORWARD_REQUEST_HEADERS, MemberFailed, forward_headers, reply_headers

MAX_TRIES = 3
_TOKEN = re.compile(r"^[0-9]{1,10}(\.json)?$")
_SHA = re.compile(r"^[0-9a-fA-F]{64}$")
_MODEL_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")  # larql_edge.roles.embed.config.MODEL_ID
_TOKEN_OPS = ("encode", "decode")
MODEL_HEADER = "x-model-id"  # larql_edge.roles.embed.registry.MODEL_HEADER

bp = Blueprint("embed_proxy")


async def _forward(request: Request, path: str) -> HTTPResponse:
    registry, upstream = request.app.ctx.registry, request.app.ctx.upstream
    tried: set[str] = set()
    reasons: list[str] = []
    headers = forward_headers(request.headers, FORWARD_REQUEST_HEADERS + (MODEL_HEADER,))  # the model choice too
    for _ in range(MAX_TRIES):
        cands = registry.embed_candidates(exclude=tried)
        if not cands:
            break
        m = cands[0]
        try:
            r = await upstream.send(m, request.method, path, content=request.body or None,
                                    headers=headers, params=request.query_string, proxied=True,
                                    elsewhere=len(cands) > 1 and cands[1].available(registry.clock()))
        except MemberFailed as e:
            tried.add(m.id)
            reasons.append(e.reason)
            continue
        return raw(r.content, status=r.status_code, headers=reply_headers(r),
                   content_type=r.headers.get("content-type", "application/octet-stream"))
    msg = "no live embed server is registered with this router"
    if reasons:
        msg = f"no embed server could answer; tried {'; '.join(reasons)}"
    raise ServiceUnavailable(msg)


def _prefix(model_id: str | None) -> str:
    if model_id is None:
        return "/v1"
    if not _MODEL_ID.match(model_id):
        raise NotFound(f"unknown model {model_id[:40]!r}")
    return f"/v1/{model_id}"


def _token(token: str) -> str:
    if not _TOKEN.match(token):
        raise BadRequest(f"token id {token[:40]!r} is not a non-negative integer")
    return token


async def embed_batch(request: Request, model_id: str | None = None) -> HTTPResponse:
    return await _forward(request, f"{_prefix(model_id)}/embed")


async def embed_row(request: Request, token: str, model_id: str | None = None) -> HTTPResponse:
    return await _forward(request, f"{_prefix(model_id)}/embed/{_token(token)}")


async def embed_row_by_sha(request: Request, sha: str, token: str) -> HTTPResponse:
    if not _SHA.match(sha):
        raise NotFound(f"no served model has embeddings sha256 {sha[:70]!r}")
    return await _forward(request, f"/v1/models/{sha.lower()}/embed/{_token(token)}")


async def models(request: Request) -> HTTPResponse:
    return await _forward(request, "/v1/models")


async def logits(request: Request, model_id: str | None = None) -> HTTPResponse:
    return await _forward(request, f"{_prefix(model_id)}/logits")


async def token_op(request: Request, op: str, model_id: str | None = None) -> HTTPResponse:
    if op not in _TOKEN_OPS:
        raise NotFound(f"no route for {request.method} {request.path}")
    return await _forward(request, f"{_prefix(model_id)}/token/{op}")


for prefix, tag in (("/v1", ""), ("/v1/<model_id:str>", "_by_model")):
    bp.add_route(embed_batch, f"{prefix}/embed", methods=["POST"], name=f"embed_batch{tag}")
    bp.add_route(embed_row, f"{prefix}/embed/<token:str>", methods=["GET", "HEAD"], name=f"embed_row{tag}")
    bp.add_route(logits, f"{prefix}/logits", methods=["POST"], name=f"logits{tag}")
    bp.add_route(token_op, f"{prefix}/token/<op:str>", methods=["GET", "POST"], name=f"token{tag}")
bp.add_route(embed_row_by_sha, "/v1/models/<sha:str>/embed/<token:str>", methods=["GET", "HEAD"], name="embed_row_by_sha")
bp.add_route(models, "/v1/models", methods=["GET"], name="models")  # as the embed server: no HEAD there
