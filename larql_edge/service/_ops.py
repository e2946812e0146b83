"""The routes every server has: ``/v1/health``, ``/v1/ready``, ``/v1/stats`` and ``/openapi.json``.

Each role says what they answer through `Hooks` kept on ``app.ctx.hooks``:

- ``/v1/health``: 200 while the process serves at all (a liveness probe);
- ``/v1/ready``: the role's readiness body, or 503 while it loads (the hook raises
  `ServiceUnavailable`) or drains (leaving the grid before it stops);
- ``/v1/stats``: the role's figures and every limit it enforces;
- ``/openapi.json``: the role's OpenAPI document, when it has one.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from sanic import Blueprint
from sanic.request import Request
from sanic.response import HTTPResponse, json

from larql_edge.errors import NotFound, ServiceUnavailable


@dataclass
class Hooks:
    ready: Callable[[], dict[str, Any]]
    stats: Callable[[Request], dict[str, Any]]
    inflight: Callable[[], int] = lambda: 0
    openapi: dict[str, Any] | None = None
    # On SIGTERM: finish (or end cleanly) what is in flight within the given seconds (`make_app`).
    drain: Callable[[float], Awaitable[None]] | None = None


bp = Blueprint("ops")


@bp.get("/v1/health", name="health")
async def health(request: Request) -> HTTPResponse:
    """Alive: answers as soon as the process listens, loaded or not; 503 once the role has failed for
    good (``app.ctx.failed``, e.g. its model cannot load), so a supervisor restarts it."""
    failed = getattr(request.app.ctx, "failed", None)
    if failed:
        raise ServiceUnavailable(failed)
    return json({"status": "ok"})


@bp.get("/v1/ready", name="ready")
async def ready(request: Request) -> HTTPResponse:
    if getattr(request.app.ctx, "draining", False):
        raise ServiceUnavailable("draining: this server is leaving the grid")
    return json(request.app.ctx.hooks.ready())


@bp.get("/v1/stats", name="stats")
async def stats(request: Request) -> HTTPResponse:
    body = request.app.ctx.hooks.stats(request)
    if isinstance(body, dict) and "kernels" not in body:
        body = {**body, "kernels": _kernels()}
    return json(body)


def _kernels() -> dict:
    """The compute backend of this process (ggml's version and CPU features for ``compact``)."""
    from larql_edge.model.backend import backend_info

    try:
        return backend_info()
    except Exception as e:  # noqa: BLE001 - a stats page reports a broken backend, it does not fail
        return {"error": str(e)}


@bp.get("/openapi.json", name="openapi")
async def openapi(request: Request) -> HTTPResponse:
    doc = request.app.ctx.hooks.openapi
    if doc is None:
        raise NotFound("this server publishes no OpenAPI document")
    return json(doc)
