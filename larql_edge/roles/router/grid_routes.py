"""The router's membership routes (join, heartbeat, leave: grid key required) and ``GET /v1/grid``.

The membership routes are streaming routes: the grid key is checked from the headers before any
byte of the body is read, and the body is read only up to a small bound (``max_grid_body``), so an
unauthenticated caller can make the router neither wait for nor buffer a large body. A join is
checked against the grid (model, width, a URL nobody else has) and then against the member itself:
the router probes the announced URL and refuses a member that is not what it announces.
"""

from __future__ import annotations

import hmac
import logging

from sanic import Blueprint
from sanic.request import Request
from sanic.response import HTTPResponse, json

from larql_edge.errors import BadRequest, Conflict, NotFound, TransportError, Unauthorized
from larql_edge.service import JSON_KIND, body_kind, parse_json, read_body
from larql_edge.wire.grid import HEARTBEAT, JOIN, LEAVE, TOPOLOGY, Announce, Load

from .registry import model_facts

log = logging.getLogger("larql.router")

bp = Blueprint("grid")
PROBE_TIMEOUT_S = 5.0  # per request: a member 0.75 s away needs 3 s for a new connection's first reply


def _authorize(request: Request, what: str) -> None:
    auth = request.headers.get("authorization", "")
    scheme, _, token = auth.partition(" ")
    # Constant-time comparison; the key (right or wrong) is never logged or echoed.
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), request.app.ctx.grid_key):
        request.app.ctx.metrics.joins.labels(what, "refused").inc()
        log.warning("%s from %s refused: %s grid key", what, request.ip, "wrong" if token else "no")
        raise Unauthorized("grid key refused")


async def _body(request: Request, what: str) -> object:
    _authorize(request, what)
    body_kind(request, allowed=(JSON_KIND,))
    return parse_json(await read_body(request, request.app.ctx.limits.max_grid_body))


async def _probe(request: Request, a: Announce) -> dict[str, str | int]:
    """The announced URL must answer as the member it announces (model, width, layers); returns the
    model facts its stats report (`registry.MODEL_FACTS`)."""
    pool = request.app.ctx.upstream.pool
    try:
        health = await pool.request("GET", a.public_url + "/v1/health", timeout=PROBE_TIMEOUT_S, max_body=64 << 10)
        stats = await pool.request("GET", a.public_url + "/v1/stats", timeout=PROBE_TIMEOUT_S, max_body=1 << 20)
    except TransportError as e:
        raise BadRequest(f"the router cannot reach {a.public_url} ({type(e).__name__}): "
                         "--public-url must be where the router reaches this member") from None
    try:
        s = stats.json() if health.status_code == 200 and stats.status_code == 200 else None
    except ValueError:
        s = None
    if not isinstance(s, dict):
        raise BadRequest(f"{a.public_url} does not answer as a larql-edge server (/v1/health {health.status_code}, "
                         f"/v1/stats {stats.status_code}): --public-url points at something else")
    claims = {"model": a.model, "hidden_size": a.hidden_size}
    if a.capability == "ffn":
        claims |= {"layer_start": a.layer_start, "layer_end": a.layer_end, "num_layers": a.num_layers}
    wrong = [f"{k} {s.get(k)!r} (announced {v!r})" for k, v in claims.items() if v is not None and s.get(k) != v]
    if wrong:
        raise Conflict(f"{a.public_url} is not the member announced: it reports {', '.join(wrong)}")
    return model_facts(s)


@bp.post(JOIN, name="join", stream=True)
async def join(request: Request) -> HTTPResponse:
    registry = request.app.ctx.registry
    a = Announce.from_json(await _body(request, "join"))
    registry.check_join(a)  # cheap refusals before the probe
    facts = await _probe(request, a)
    m, token = registry.join(a, facts)
    request.app.ctx.metrics.joins.labels("join", "ok").inc()
    where = f"layers {m.layers}" if m.layers is not None else "embed"
    log.info("member %s joined: %s %s at %s (model %s)", m.id, m.capability, where, m.url, m.model)
    return json({"member_id": m.id, "member_token": token, "heartbeat_interval_s": registry.heartbeat_interval,
                 "evict_after_s": registry.evict_after})


@bp.post(HEARTBEAT, name="heartbeat", stream=True)
async def heartbeat(request: Request) -> HTTPResponse:
    load = Load.from_json(await _body(request, "heartbeat"))
    if request.app.ctx.registry.heartbeat(load) is None:
        raise NotFound(f"unknown member {load.member_id!r}: join again")
    return json({"ok": True})


@bp.post(LEAVE, name="leave", stream=True)
async def leave(request: Request) -> HTTPResponse:
    obj = await _body(request, "leave")
    mid = obj.get("member_id") if isinstance(obj, dict) else None
    token = obj.get("member_token", "") if isinstance(obj, dict) else ""
    if not isinstance(mid, str) or not mid or len(mid) > 64 or not isinstance(token, str):
        raise BadRequest('"member_id" must be a non-empty string (and "member_token" a string)')
    m = request.app.ctx.registry.leave(mid, token)
    if m is None:
        raise NotFound(f"unknown member {mid!r}")
    log.info("member %s left: %s at %s", mid, m.capability, m.url)
    return json({"ok": True})


@bp.get("/v1/grid", name="grid")
async def grid(request: Request) -> HTTPResponse:
    return json(request.app.ctx.registry.view())


@bp.get(TOPOLOGY, name="topology")
async def topology(request: Request) -> HTTPResponse:
    """Which live shard serves which layers: the direct data path's map (the router stays its fallback)."""
    return json(request.app.ctx.registry.topology().to_json())
