"""The embed server's blueprints, one per concern. Each route exists unprefixed (default model or
``X-Model-Id``) and under ``/v1/{model_id}/``; `both` registers the pair."""

from __future__ import annotations

from sanic import Blueprint

from larql_edge.roles.embed.routes.embed import bp as embed_bp
from larql_edge.roles.embed.routes.logits import bp as logits_bp
from larql_edge.roles.embed.routes.service import bp as service_bp
from larql_edge.roles.embed.routes.tokens import bp as tokens_bp

BLUEPRINTS: tuple[Blueprint, ...] = (embed_bp, logits_bp, tokens_bp, service_bp)
