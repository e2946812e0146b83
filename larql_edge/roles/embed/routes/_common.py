"""What every route module shares: picking the model and registering a route with its model prefix."""

from __future__ import annotations

from sanic import Blueprint

from larql_edge.roles.embed.model import ServedModel
from larql_edge.roles.embed.registry import MODEL_HEADER


def model_of(request, model_id: str | None = None) -> ServedModel:
    return request.app.ctx.registry.pick(model_id, request.headers.get(MODEL_HEADER))


def both(bp: Blueprint, path: str, methods: list[str], name: str):
    """Register the decorated handler at ``/v1{path}`` and ``/v1/<model_id>{path}``."""

    def deco(handler):
        bp.add_route(handler, f"/v1{path}", methods=methods, name=name)
        bp.add_route(handler, f"/v1/<model_id:str>{path}", methods=methods, name=f"{name}_by_model")
        return handler

    return deco
