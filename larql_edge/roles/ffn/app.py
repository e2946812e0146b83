"""The FFN shard's app: ``POST /v1/walk-ffn`` on the service toolkit (health, ready, stats, metrics)."""

from __future__ import annotations

import time

from sanic import Sanic
from sanic.request import Request

from larql_edge.service import Hooks, make_app
from larql_edge.service.identity import rss_bytes

from .openapi import openapi_spec
from .routes import bp as walk_bp
from .shard import Shard


def create_app(shard: Shard, name: str = "larql_ffn") -> Sanic:
    def stats(request: Request) -> dict:
        return {
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
            "inflight": app.ctx.compute.inflight,
            "layer_latency_ms": {str(k): round(v, 3) for k, v in sorted(shard.latency_ms.items())},
            "load_seconds": round(shard.load_seconds, 3),
            "weights_verified": shard.weights.as_json(),
            "uptime_seconds": round(time.time() - shard.started, 1),
            "memory_mb": round(rss_bytes() / 2**20, 1),
            "limits": shard.limits.as_json(shard),
        }

    hooks = Hooks(
        # The weights are loaded before the server listens, so listening means ready.
        ready=lambda: {"ready": True, "layers": str(shard.range)},
        stats=stats,
        inflight=lambda: app.ctx.compute.inflight,
        openapi=openapi_spec(),
    )
    app = make_app(name, "ffn", hooks, max_body=shard.max_body, identity=lambda: shard.vindex_hash)
    app.ctx.shard = shard
    app.blueprint(walk_bp)
    metrics = app.ctx.metrics
    metrics.gauge("layers_served", "layers this shard serves").set(len(shard.range))
    layer_seconds = metrics.histogram("layer_duration_seconds", "FFN compute time per layer", ["layer"])
    observers = {layer: metrics.batched(layer_seconds, str(layer)) for layer in shard.range}
    shard.on_layer = lambda layer, seconds: observers[layer].observe(seconds)
    return app
