"""The router as the embed server's front door: /v1/embed*, /v1/logits, /v1/token/*, /v1/models/*.

So a client needs one URL for the whole grid. Requests go to a live embed member (failing over to
another one when a member cannot answer); replies come back with their status, body and caching
headers unchanged (ETag, Cache-Control, Vary), so the CDN contract of DESIGN.md §2 survives.
"""

from __future__ import annotations

from sanic import Blueprint
from sanic.request import Request
from sanic.response import HTTPResponse, raw

from larql_edge.errors import ServiceUnavailable
from larql_edge.roles.router.upstream import MemberFailed, forward_headers, reply_headers

MAX_TRIES = 3

bp = Blueprint("embed_proxy")


async def proxy(request: Request, **_path: str) -> HTTPResponse:
    registry, upstream = request.app.ctx.registry, request.app.ctx.upstream
    tried: set[str] = set()
    reasons: list[str] = []
    for _ in range(MAX_TRIES):
        cands = registry.embed_candidates(exclude=tried)
        if not cands:
            break
        m = cands[0]
        try:
            r = await upstream.send(m, request.method, request.path, content=request.body or None,
                                    headers=forward_headers(request.headers), params=request.query_string)
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


bp.add_route(proxy, "/v1/embed", methods=["POST"], name="embed_batch")
bp.add_route(proxy, "/v1/embed/<rest:path>", methods=["GET", "HEAD"], name="embed_row")
bp.add_route(proxy, "/v1/logits", methods=["POST"], name="logits")
bp.add_route(proxy, "/v1/token/<rest:path>", methods=["GET"], name="token")
bp.add_route(proxy, "/v1/models/<rest:path>", methods=["GET", "HEAD"], name="models")
