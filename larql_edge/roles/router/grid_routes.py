"""The router's membership routes (join, heartbeat, leave: grid key required) and ``GET /v1/grid``."""

from __future__ import annotations

import hmac
import logging

from sanic import Blueprint
from sanic.request import Request
from sanic.response import HTTPResponse, json

from larql_edge.errors import BadRequest, NotFound, Unauthorized
from larql_edge.service import JSON_KIND, body_kind, json_body
from larql_edge.wire.grid import HEARTBEAT, JOIN, LEAVE, Announce, Load

log = logging.getLogger("larql.router")

bp = Blueprint("grid")


def _authorize(request: Request, what: str) -> None:
    auth = request.headers.get("authorization", "")
    scheme, _, token = auth.partition(" ")
    # Constant-time comparison; the key (right or wrong) is never logged or echoed.
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), request.app.ctx.grid_key):
        request.app.ctx.metrics.joins.labels(what, "refused").inc()
        log.warning("%s from %s refused: %s grid key", what, request.ip, "wrong" if token else "no")
        raise Unauthorized("grid key refused")


def _body(request: Request) -> object:
    body_kind(request, allowed=(JSON_KIND,))
    return json_body(request)


@bp.post(JOIN, name="join")
async def join(request: Request) -> HTTPResponse:
    _authorize(request, "join")
    registry = request.app.ctx.registry
    a = Announce.from_json(_body(request))
    m = registry.join(a)
    request.app.ctx.metrics.joins.labels("join", "ok").inc()
    where = f"layers {m.layers}" if m.layers is not None else "embed"
    log.info("member %s joined: %s %s at %s (model %s)", m.id, m.capability, where, m.url, m.model)
    return json({"member_id": m.id, "heartbeat_interval_s": registry.heartbeat_interval,
                 "evict_after_s": registry.evict_after})


@bp.post(HEARTBEAT, name="heartbeat")
async def heartbeat(request: Request) -> HTTPResponse:
    _authorize(request, "heartbeat")
    load = Load.from_json(_body(request))
    if request.app.ctx.registry.heartbeat(load) is None:
        raise NotFound(f"unknown member {load.member_id!r}: join again")
    return json({"ok": True})


@bp.post(LEAVE, name="leave")
async def leave(request: Request) -> HTTPResponse:
    _authorize(request, "leave")
    registry = request.app.ctx.registry
    obj = _body(request)
    mid = obj.get("member_id") if isinstance(obj, dict) else None
    if not isinstance(mid, str) or not mid:
        raise BadRequest('"member_id" must be a non-empty string')
    m = registry.members.get(mid)
    if not registry.leave(mid):
        raise NotFound(f"unknown member {mid!r}")
    log.info("member %s left: %s at %s", mid, m.capability if m else "?", m.url if m else "?")
    return json({"ok": True})


@bp.get("/v1/grid", name="grid")
async def grid(request: Request) -> HTTPResponse:
    return json(request.app.ctx.registry.view())
