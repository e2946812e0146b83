"""Operating the server: health, readiness, stats, the model list and the OpenAPI description."""

from __future__ import annotations

import os

import psutil
from sanic import Blueprint
from sanic.response import json

from larql_edge.errors import NotFound, ServiceUnavailable

from larql_edge.roles.embed.registry import MODEL_HEADER

bp = Blueprint("service")


@bp.get("/v1/health", name="health")
async def health(request):
    """Alive: answers as soon as the process listens, loaded or not."""
    return json({"status": "ok"})


@bp.get("/v1/ready", name="ready")
async def ready(request):
    reg = request.app.ctx.registry
    if not reg.ready:
        raise ServiceUnavailable(f"not ready: {reg.error}" if reg.error else "not ready: loading")
    return json({"status": "ready", "models": list(reg.models), "pid": os.getpid()})


def _stats(request, model_id: str | None):
    app = request.app
    reg = app.ctx.registry
    mid = model_id or request.headers.get(MODEL_HEADER) or reg.default_id
    m = reg.models.get(mid)
    if m is None:
        raise NotFound(f"unknown model {mid!r} (served: {', '.join(reg.models)})")
    out = m.stats()
    out["memory_mb"] = round(psutil.Process().memory_info().rss / 2**20, 1)
    out["limits"] = app.ctx.cfg.limits.as_json()
    out["models"] = list(reg.models)
    out["worker"] = {"pid": os.getpid(), "name": os.environ.get("SANIC_WORKER_NAME", "")}
    if reg.error:
        out["error"] = reg.error
    return json(out)


@bp.get("/v1/stats", name="stats")
async def stats(request):
    return _stats(request, None)


@bp.get("/v1/<model_id:str>/stats", name="stats_by_model")
async def stats_by_model(request, model_id: str):
    return _stats(request, model_id)


@bp.get("/v1/models", name="models")
async def models(request):
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


@bp.get("/openapi.json", name="openapi")
async def openapi(request):
    return json(request.app.ctx.openapi)
