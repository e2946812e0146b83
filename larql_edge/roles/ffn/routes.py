"""``POST /v1/walk-ffn``: the FFN of the listed layers on exactly the rows sent (binary or JSON)."""

from __future__ import annotations

import time
from typing import cast

from sanic import Blueprint
from sanic.request import Request
from sanic.response import HTTPResponse, json, raw

from larql_edge.service import JSON_KIND, body_kind, json_body
from larql_edge.wire import ffn as wire

bp = Blueprint("walk_ffn")
INLINE_ROWS = 4  # rows x layers up to which a binary request is computed in the event loop


@bp.post("/v1/walk-ffn", name="walk_ffn")
async def walk_ffn(request: Request) -> HTTPResponse:
    app = request.app
    shard, compute = app.ctx.shard, app.ctx.compute
    shard.requests += 1
    if body_kind(request) == JSON_KIND:
        req = wire.request_from_json(json_body(request), shard.hidden)
        shard.check(req)
        results, ms = await compute.run(shard.run, req.layers, req.x)
        return json(wire.response_to_json(results, ms, req.batch))
    f16 = wire.wants_f16(request.headers.get("accept"))
    body = request.body or b""
    req = wire.decode_request(body, shard.hidden)
    shard.check(req)
    if req.seq_len * len(req.layers) <= INLINE_ROWS and not compute.inflight:
        # A decode hop (a row or a few, ~0.2 ms of products): computed here, in the event loop. Handing
        # it to the compute thread and back costs two wake-ups, and on a busy machine each one waits for
        # a core longer than the product takes. Only while the compute thread is idle: never two
        # products at once.
        reply = _reply(shard, req, f16)
    else:
        reply = await compute.run(_reply, shard, req, f16)
    # a bytearray is sent as it is (Sanic writes any bytes-like body; its annotation says bytes/str)
    return raw(cast(bytes, reply), content_type=wire.reply_content_type(f16))


def _reply(shard, req: wire.FfnRequest, f16: bool) -> bytearray:
    # Each layer is computed straight into its place in the reply (encoded in the compute thread
    # too when the request went there: the reply is as large as the input).
    buf, views = wire.reply_buffer(req.layers, req.seq_len, shard.hidden, req.batch, f16)
    t0 = time.perf_counter()
    shard.run_into(req.layers, req.x, views)
    wire.set_latency(buf, (time.perf_counter() - t0) * 1e3)
    return buf


def answer(shard, body: bytes, f16: bool) -> bytearray:
    """A binary request's whole work, as the route does it (benchmarks/ffn_profile.py times it)."""
    req = wire.decode_request(body, shard.hidden)
    shard.check(req)
    return _reply(shard, req, f16)
