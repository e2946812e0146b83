"""The FFN shard's HTTP app: POST /v1/walk-ffn plus stats, health, readiness and metrics."""

from __future__ import annotations

import json as jsonlib
import time

from sanic import Sanic
from sanic.request import Request
from sanic.response import HTTPResponse, json, raw

from larql_edge.errors import BadRequest, UnsupportedMediaType
from larql_edge.service.identity import rss_bytes
from larql_edge.service.envelope import install_error_envelope
from larql_edge.service.metrics import Metrics
from larql_edge.wire import ffn as wire
from larql_edge.roles.ffn.shard import Shard

# A prefill of a few thousand tokens of a large model stays far below this; anything bigger is a mistake.
MAX_BODY = 256 << 20
BINARY_TYPES = ("", wire.CONTENT_TYPE, "application/octet-stream")


def create_app(shard: Shard, name: str = "larql_ffn") -> Sanic:
    app = Sanic(name)
    app.config.REQUEST_MAX_SIZE = MAX_BODY
    app.config.KEEP_ALIVE_TIMEOUT = 75  # clients hold one connection for a whole generation
    app.ctx.shard = shard
    install_error_envelope(app)
    metrics = Metrics("ffn")  # larql_ffn_*
    metrics.install(app)
    layer_seconds = metrics.histogram("layer_duration_seconds", "FFN compute time per layer", ["layer"])
    metrics.gauge("layers_served", "layers this shard serves").set(len(shard.range))
    started = time.time()

    def run(req: wire.FfnRequest) -> tuple[list, float]:
        if not req.full_output:
            raise BadRequest("only full_output=1 is served: the reply is the FFN output for every position")
        shard.check_layers(req.layers)
        t0 = time.perf_counter()
        results = []
        for layer in req.layers:
            t1 = time.perf_counter()
            results.append((layer, shard.compute(layer, req.x)))
            layer_seconds.labels(str(layer)).observe(time.perf_counter() - t1)
        return results, (time.perf_counter() - t0) * 1e3

    @app.post("/v1/walk-ffn")
    async def walk_ffn(request: Request) -> HTTPResponse:
        ctype = (request.headers.get("content-type") or "").split(";")[0].strip().lower()
        shard.inflight += 1
        shard.requests += 1
        try:
            if ctype == "application/json":
                try:
                    obj = jsonlib.loads(request.body or b"")
                except (ValueError, UnicodeDecodeError):
                    raise BadRequest("the body is not valid JSON") from None
                req = _parse(lambda: wire.request_from_json(obj, shard.hidden))
                results, ms = run(req)
                return json(wire.response_to_json(results, ms, req.batch))
            if ctype not in BINARY_TYPES:
                raise UnsupportedMediaType(f"send {wire.CONTENT_TYPE} (binary) or application/json, not {ctype!r}")
            req = _parse(lambda: wire.decode_request(request.body or b"", shard.hidden))
            results, ms = run(req)
            f16 = wire.wants_f16(request.headers.get("accept"))
            if req.batch:
                body = wire.encode_batch_response(results, ms, f16)
            else:
                body = wire.encode_response(results[0][0], results[0][1], ms, f16)
            return raw(body, content_type=wire.reply_content_type(f16))
        finally:
            shard.inflight -= 1

    @app.get("/v1/stats")
    async def stats(request: Request) -> HTTPResponse:
        return json({
            "mode": "ffn-shard",
            "model": shard.model,
            "family": shard.spec.family.name,
            "num_layers": shard.spec.num_layers,
            "hidden_size": shard.hidden,
            "intermediate_size": shard.spec.intermediate_size,
            "layers": str(shard.range),
            "layer_start": shard.range.start,
            "layer_end": shard.range.end,
            "vindex_hash": shard.vindex_hash,
            "requests": shard.requests,
            "inflight": shard.inflight,
            "layer_latency_ms": {str(k): round(v, 3) for k, v in sorted(shard.latency_ms.items())},
            "load_seconds": round(shard.load_seconds, 3),
            "uptime_seconds": round(time.time() - started, 1),
            "memory_mb": round(rss_bytes() / 2**20, 1),
        })

    @app.get("/v1/health")
    async def health(request: Request) -> HTTPResponse:
        return json({"status": "ok"})

    @app.get("/v1/ready")
    async def ready(request: Request) -> HTTPResponse:
        # The weights are loaded before the server listens, so listening means ready.
        return json({"ready": True, "layers": str(shard.range)})

    return app


def _parse(fn):
    try:
        return fn()
    except wire.WireError as e:
        raise BadRequest(str(e)) from None
