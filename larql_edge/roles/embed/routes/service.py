"""The embed server's own operating routes: per-model stats and the model list.

``/v1/health``, ``/v1/ready``, ``/v1/stats`` and ``/openapi.json`` are the service toolkit's (they
call `ready` and `stats` below through the app's hooks).
"""

from __future__ import annotations

import os

import psutil
from sanic import Blueprint
from sanic.request import Request
from sanic.response import HTTPResponse, json

from larql_edge.errors import NotFound, ServiceUnavailable
from larql_edge.roles.embed.registry import MODEL_HEADER, ModelRegistry

bp = Blueprint("service")


def ready(registry: ModelRegistry) -> dict:
    if not registry.ready:
        raise ServiceUnavailable(f"not ready: {registry.error}" if registry.error else "not ready: loading")
    return {"status": "ready", "models": list(registry.models), "pid": os.getpid()}


def stats(request: Request, model_id: str | None = None) -> dict:
    app = request.app
    reg = app.ctx.registry
    mid = model_id or request.headers.get(MODEL_HEADER) or reg.default_id
    m = reg.models.get(mid)
    if m is None:
        raise NotFound(f"unknown model {mid!r} (served: {', '.join(reg.models)})")
    out = m.stats()
    out["memory_mb"] = round(psutil.Process().memory_info().rss / 2**20, 1)
    out["limits"] = app.ctx.cfg.limits.as_json()
    out["weights_verified"] = app.ctx.cfg.weights.get(m.id, {"verified": False, "seconds": None, "bytes": 0})
    out["models"] = list(reg.models)
    out["worker"] = {"pid": os.getpid(), "name": os.environ.get("SANIC_WORKER_NAME", "")}
    if reg.error:
        out["error"] = reg.error
    return out


@bp.get("/v1/<model_id:str>/stats", name="stats_by_model")
async def stats_by_model(request: Request, model_id: str) -> HTTPResponse:
    return json(stats(request, model_id))


@bp.get("/v1/models", name="models")
async def models(request: Request) -> HTTPResponse:
    reg = request.app.ctx.registry
    return json(
        {
            "default": reg.default_id,
            "models": [
                {
                    "id": m.id,
                    "model": m.name,
                    "family": m.spec.family.name,
                    "hidden_size": m.hidden_size,
                    "vocab_size": m.vocab_size,
                    "embeddings_sha256": m.sha256,
                    "lm_head_tied": m.tied,
                    "ready": m.ready,
                    "embed_url": f"/v1/models/{m.sha256}/embed/{{id}}" if m.sha256 else None,
                }
                for m in reg.models.values()
            ],
        }
    )
