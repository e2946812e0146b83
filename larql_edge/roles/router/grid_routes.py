"""The router's membership routes (join, heartbeat, leave: grid key required) and GET /v1/grid."""

from __future__ import annotations

import hmac
import json as jsonlib
import logging

from sanic.request import Request
from sanic.response import HTTPResponse, json

from larql_edge.errors import BadRequest, NotFound, Unauthorized, UnsupportedMediaType
from larql_edge.wire.grid import HEARTBEAT, JOIN, LEAVE, Announce, Load, ProtocolError
from larql_edge.roles.router.registry import Registry

log = logging.getLogger("larql.router")


def install(app, registry: Registry, grid_key: str, metrics=None) -> None:
    key = grid_key.encode()

    def authorize(request: Request, what: str) -> None:
        auth = request.headers.get("authorization", "")
        scheme, _, token = auth.partition(" ")
        # Constant-time comparison; the key (right or wrong) is never logged or echoed.
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key):
            if metrics is not None:
                metrics.joins.labels(what, "refused").inc()
            log.warning("%s from %s refused: %s grid key", what, request.ip, "wrong" if token else "no")
            raise Unauthorized("grid key refused")

    def body(request: Request) -> object:
        ctype = (request.headers.get("content-type") or "").split(";")[0].strip().lower()
        if ctype != "application/json":
            raise UnsupportedMediaType("send application/json")
        try:
            return jsonlib.loads(request.body or b"")
        except (ValueError, UnicodeDecodeError):
            raise BadRequest("the body is not valid JSON") from None

    def parse(fn, obj):
        try:
            return fn(obj)
        except ProtocolError as e:
            raise BadRequest(str(e)) from None

    @app.post(JOIN)
    async def join(request: Request) -> HTTPResponse:
        authorize(request, "join")
        a = parse(Announce.from_json, body(request))
        m = registry.join(a)
        if metrics is not None:
            metrics.joins.labels("join", "ok").inc()
        where = f"layers {m.layers}" if m.layers is not None else "embed"
        log.info("member %s joined: %s %s at %s (model %s)", m.id, m.capability, where, m.url, m.model)
        return json({"member_id": m.id, "heartbeat_interval_s": registry.heartbeat_interval,
                     "evict_after_s": registry.evict_after})

    @app.post(HEARTBEAT)
    async def heartbeat(request: Request) -> HTTPResponse:
        authorize(request, "heartbeat")
        load = parse(Load.from_json, body(request))
        if registry.heartbeat(load) is None:
            raise NotFound(f"unknown member {load.member_id!r}: join again")
        return json({"ok": True})

    @app.post(LEAVE)
    async def leave(request: Request) -> HTTPResponse:
        authorize(request, "leave")
        obj = body(request)
        mid = obj.get("member_id") if isinstance(obj, dict) else None
        if not isinstance(mid, str) or not mid:
            raise BadRequest('"member_id" must be a non-empty string')
        m = registry.members.get(mid)
        if not registry.leave(mid):
            raise NotFound(f"unknown member {mid!r}")
        log.info("member %s left: %s at %s", mid, m.capability if m else "?", m.url if m else "?")
        return json({"ok": True})

    @app.get("/v1/grid")
    async def grid(request: Request) -> HTTPResponse:
        return json(registry.view())
