"""``POST /v1/walk-ffn``: the FFN of the listed layers on exactly the rows sent (binary or JSON)."""

from __future__ import annotations

import time

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
    req = wire.decode_request(request.body or b"", shard.hidden)
    shard.check(req)
    f16 = wire.wants_f16(request.headers.get("accept"))

    def work() -> bytes:
        # The reply is encoded in the compute thread too: it is as large as the input.
        t0 = time.perf_counter()
        results, _ = shard.run(req.layers, req.x)
        ms = (time.perf_counter() - t0) * 1e3
        if req.batch:
            return wire.encode_batch_response(results, ms, f16)
        return wire.encode_response(results[0][0], results[0][1], ms, f16)

    if req.seq_len * len(req.layers) <= INLINE_ROWS and not compute.inflight:
        # A decode hop (a row or a few, ~0.2 ms of products): computed here, in the event loop. Handing
        # it to the compute thread and back costs two wake-ups, and on a busy machine each one waits for
        # a core longer than the product takes. Only while the compute thread is idle: never two
        # products at once.
        body = work()
    else:
        body = await compute.run(work)
    return raw(body, content_type=wire.reply_content_type(f16))
