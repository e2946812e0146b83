"""POST /v1/walk-ffn at the router: route each layer to the best live replica, split and merge batches.

A batch names several layers for one input. The router groups the layers by the member chosen
for each, sends one batch per member in parallel, and merges the replies in the order asked for.
Binary values are never decoded: each shard's result bytes are re-framed as they came, so the
router is exact by construction and costs no float work. A group whose member fails is re-routed
to other replicas; a layer that no live member serves is a 503 naming the layer, never zeros.
"""

from __future__ import annotations

import asyncio
import json as jsonlib
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import numpy as np
from sanic import Blueprint
from sanic.request import Request
from sanic.response import HTTPResponse, json, raw

from larql_edge.errors import BadRequest, PayloadTooLarge, ServiceUnavailable
from larql_edge.net.h1 import Reply
from larql_edge.roles.router.registry import Member, Registry
from larql_edge.roles.router.upstream import MemberFailed, forward_headers
from larql_edge.service import JSON_KIND, body_kind, parse_json
from larql_edge.wire import VINDEX_HEADER
from larql_edge.wire import ffn as wire
from larql_edge.wire.numbers import json_int

PATH = "/v1/walk-ffn"
MAX_ROUNDS = 4  # re-routing rounds for one request: each round excludes the members that failed


class Passthrough(Exception):
    """A member's 4xx reply: the caller's mistake, handed back unchanged."""

    def __init__(self, response: Reply):
        self.response = response


def _passthrough(r: Reply) -> HTTPResponse:
    return raw(r.content, status=r.status_code, content_type=r.headers.get("content-type", "application/json"))


def _check_request(ctx, layers: Sequence[int], value_bytes: int | None) -> None:
    """The router's own bounds, before any member is asked: layers in the model and each named once,
    and the reply the request asks for (rows x layers x hidden) within ``max_reply_bytes``."""
    registry = ctx.registry
    n = registry.num_layers
    if n is not None:
        bad = sorted({layer for layer in layers if layer >= n})
        if bad:
            raise BadRequest(f"layer {', '.join(map(str, bad[:8]))} is outside the model ({n} layers, 0-{n - 1})")
    if len(set(layers)) != len(layers):
        dup = next(layer for layer in layers if list(layers).count(layer) > 1)
        raise BadRequest(f"layer {dup} is listed more than once: a batch names each layer once")
    if value_bytes is not None and value_bytes * len(layers) > ctx.limits.max_reply_bytes:
        raise PayloadTooLarge(f"{len(layers)} layers over {value_bytes} bytes of input ask for a reply of "
                              f"{value_bytes * len(layers)} bytes; the limit is {ctx.limits.max_reply_bytes}")


def _no_shard(registry: Registry, layers: Sequence[int], reasons: list[str]) -> ServiceUnavailable:
    msg = f"no live FFN shard serves layer {', '.join(map(str, layers[:8]))}"
    holes = registry.view()["gaps"]
    if holes:
        msg += f" (layers without a live shard: {', '.join(holes)})"
    if reasons:
        msg += f"; tried {'; '.join(reasons[:4])}"
    return ServiceUnavailable(msg)


SendGroup = Callable[[Member, list[int], frozenset[str]], Awaitable[list[Any]]]


async def dispatch(registry: Registry, layers: Sequence[int], send_group: SendGroup, metrics=None) -> dict[int, Any]:
    """Run ``send_group(member, positions, excluded)`` for every member chosen; returns {position: item}.
    A member that failed (or was too slow: `MemberSlow`) is excluded from the next rounds."""
    results: dict[int, object] = {}
    pending = list(range(len(layers)))
    excluded: set[str] = set()
    reasons: list[str] = []
    for round_ in range(MAX_ROUNDS):
        groups, missing = registry.assign([layers[p] for p in pending], excluded)
        if missing:
            raise _no_shard(registry, sorted({layers[pending[i]] for i in missing}), reasons)
        jobs = [(registry.members[mid], [pending[i] for i in idxs]) for mid, idxs in groups.items()]
        if round_ and metrics is not None:
            metrics.retries.inc(len(jobs))
        outs = await asyncio.gather(*(send_group(m, pos, frozenset(excluded)) for m, pos in jobs), return_exceptions=True)
        pending = []
        for (m, pos), out in zip(jobs, outs, strict=True):
            if isinstance(out, MemberFailed):
                excluded.add(m.id)
                reasons.append(out.reason)
                pending += pos
            elif isinstance(out, BaseException):
                raise out
            else:
                results.update(zip(pos, out, strict=True))
        if not pending:
            return results
        pending.sort()
    raise _no_shard(registry, sorted({layers[p] for p in pending}), reasons)


bp = Blueprint("walk")


def _json_rows(obj: dict, hidden: int | None) -> int:
    """Rows of a JSON walk request (nested rows, or a flat residual of seq_len x hidden), for the
    hop timeout only: the member validates the body itself."""
    r = obj.get("residual")
    if not isinstance(r, list) or not r:
        return 1
    if isinstance(r[0], list):
        return len(r)
    return max(1, len(r) // hidden) if hidden else 1


def _elsewhere(registry: Registry, m: Member, layers: Sequence[int], excluded: frozenset[str]) -> bool:
    """Could another live replica answer every one of ``layers``?"""
    now = registry.clock()
    return all(any(c.id != m.id and c.available(now) for c in registry.ffn_candidates(layer, excluded))
               for layer in set(layers))


async def _post(ctx, m: Member, content: bytes, headers: dict, row_layers: int, layers: Sequence[int],
                excluded: frozenset[str]) -> Reply:
    """One group to one member: its 2xx comes back, the caller's mistake (400, 413) goes back to
    the caller as it is, anything else already raised MemberFailed (`larql_edge.net.failures`).
    The deadline scales with the work asked (`Limits.hop_timeout`), including the work this router
    already has in flight to the member (a request queued behind others there waits for theirs).
    Past it, a member that still heartbeats is not failed: the group moves to another live replica
    if there is one, else the router keeps waiting (`upstream.Upstream`, DESIGN.md §10)."""
    timeout = ctx.limits.hop_timeout(row_layers + m.inflight_work)
    m.inflight_work += row_layers
    try:
        r = await ctx.upstream.send(m, "POST", PATH, content=content, headers=headers, timeout=timeout,
                                    elsewhere=_elsewhere(ctx.registry, m, layers, excluded))
    finally:
        m.inflight_work -= row_layers
    if r.status_code != 200:
        raise Passthrough(r)
    return r


@bp.post(PATH, name="walk_ffn")
async def walk_ffn(request: Request) -> HTTPResponse:
    ctx = request.app.ctx
    body = request.body or b""
    headers = forward_headers(request.headers)
    try:
        if body_kind(request) == JSON_KIND:
            return await _walk_json(ctx, body, headers)
        if wire.is_batch_body(body):
            return await _walk_batch(ctx, body, headers)
        return await _walk_single(ctx, body, headers)
    except Passthrough as p:
        return _passthrough(p.response)


async def _walk_single(ctx, body: bytes, headers: dict) -> HTTPResponse:
    registry, upstream = ctx.registry, ctx.upstream
    layer = wire.single_layer_of(body)
    _check_request(ctx, [layer], len(body) - 16)

    async def send(m: Member, pos: list[int], excluded: frozenset[str]) -> list:
        hidden = m.hidden_size or registry.hidden_size
        r = await _post(ctx, m, body, headers, (len(body) - 16) // (4 * hidden) if hidden else 0, [layer], excluded)
        if hidden:  # a reply must be for this layer and this many rows: garbage is the member's failure
            f16 = r.headers.get("content-type", "").startswith(wire.CONTENT_TYPE_F16)
            try:
                got, out, _ = wire.decode_response(r.content, hidden, f16)
            except wire.WireError as e:
                raise upstream.malformed(m, f"malformed reply ({e})") from None
            if got != layer or out.shape[0] * hidden * 4 != len(body) - 16:
                raise upstream.malformed(m, f"the reply is for layer {got} with {out.shape[0]} rows")
            if not np.isfinite(out).all():  # damaged weights: the member's failure, never the caller's
                raise upstream.malformed(m, f"non-finite values in its layer {layer} reply")
        return [r]

    r = (await dispatch(registry, [layer], send, ctx.metrics))[0]
    ident = {VINDEX_HEADER: r.headers[VINDEX_HEADER]} if VINDEX_HEADER in r.headers else None
    return raw(r.content, content_type=r.headers.get("content-type", wire.CONTENT_TYPE), headers=ident)


async def _walk_batch(ctx, body: bytes, headers: dict) -> HTTPResponse:
    registry, upstream = ctx.registry, ctx.upstream
    t0 = time.perf_counter()
    layers, tail = wire.split_batch_request(body)
    _check_request(ctx, layers, len(tail) - 12)
    f16_box: list[bool] = []
    idents: set[str] = set()

    async def send(m: Member, pos: list[int], excluded: frozenset[str]) -> list:
        mine = [layers[p] for p in pos]
        content = body if len(mine) == len(layers) else wire.batch_request_from_tail(mine, tail)
        hidden = m.hidden_size or registry.hidden_size
        rows = (len(tail) - 12) // (4 * hidden) if hidden else 0
        r = await _post(ctx, m, content, headers, rows * len(mine), mine, excluded)
        f16 = r.headers.get("content-type", "").startswith(wire.CONTENT_TYPE_F16)
        try:
            items = list(wire.iter_batch_items(r.content, f16))
        except wire.WireError as e:
            raise upstream.malformed(m, f"malformed batch reply ({e})") from None
        if [it[0] for it in items] != mine:
            raise upstream.malformed(m, f"batch reply does not answer layers {mine}")
        dtype = wire.value_dtype(f16)
        if not all(np.isfinite(np.frombuffer(it[2], dtype)).all() for it in items):
            raise upstream.malformed(m, f"non-finite values in its reply for layers {mine}")
        f16_box.append(f16)
        if VINDEX_HEADER in r.headers:
            idents.add(r.headers[VINDEX_HEADER])
        return items

    got = await dispatch(registry, layers, send, ctx.metrics)
    f16 = bool(f16_box and f16_box[0])
    merged = wire.frame_batch([got[p] for p in range(len(layers))], (time.perf_counter() - t0) * 1e3, f16)
    return raw(merged, content_type=wire.reply_content_type(f16),
               headers={VINDEX_HEADER: ",".join(sorted(idents))} if idents else None)


async def _walk_json(ctx, body: bytes, headers: dict) -> HTTPResponse:
    registry, upstream = ctx.registry, ctx.upstream
    t0 = time.perf_counter()
    obj = parse_json(body)
    if not isinstance(obj, dict) or ("layer" in obj) == ("layers" in obj):
        raise BadRequest('the JSON body must be an object with exactly one of "layer" or "layers"')
    batch = "layers" in obj
    given = obj["layers"] if batch else [obj["layer"]]
    numbers = [json_int(v) for v in given] if isinstance(given, list) else []
    if not numbers or len(numbers) > wire.MAX_BATCH_LAYERS or any(v is None or v < 0 for v in numbers):
        raise BadRequest('"layer"/"layers" must be non-negative layer numbers')
    layers = [v for v in numbers if v is not None]
    _check_request(ctx, layers, None)

    async def send(m: Member, pos: list[int], excluded: frozenset[str]) -> list:
        mine = [layers[p] for p in pos]
        sub = dict(obj, layers=mine) if batch else obj
        r = await _post(ctx, m, jsonlib.dumps(sub).encode(), headers, _json_rows(obj, m.hidden_size) * len(mine), mine,
                        excluded)
        try:
            reply = r.json()
            items = reply["results"] if batch else [reply]
            if [it["layer"] for it in items] != mine:
                raise ValueError("layers differ")
        except (ValueError, KeyError, TypeError) as e:
            raise upstream.malformed(m, f"malformed JSON reply ({e})") from None
        return items

    got = await dispatch(registry, layers, send, ctx.metrics)
    ms = round((time.perf_counter() - t0) * 1e3, 3)
    if batch:
        return json({"results": [got[p] for p in range(len(layers))], "latency_ms": ms})
    return json(got[0])
