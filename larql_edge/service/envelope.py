"""Pieces every Sanic service of larql-edge shares: the JSON error envelope and its handler."""

from __future__ import annotations

import logging

from sanic import Sanic
from sanic.exceptions import SanicException
from sanic.request import Request
from sanic.response import HTTPResponse, json

from larql_edge.errors import AppError

log = logging.getLogger("larql.http")


def error_response(status: int, message: str, headers: dict[str, str] | None = None) -> HTTPResponse:
    return json({"error": message}, status=status, headers=headers)


def error_kind(exc: BaseException) -> str:
    """A short label for metrics: the AppError kind, or the Sanic status class, or 'internal'."""
    if isinstance(exc, AppError):
        return exc.kind
    if isinstance(exc, SanicException):
        return type(exc).__name__.lower()
    return "internal"


def install_error_envelope(app: Sanic) -> None:
    """Every error leaves as ``{"error": "..."}``: 4xx for the caller's mistakes, 5xx for ours."""

    async def handler(request: Request, exc: Exception) -> HTTPResponse:
        if isinstance(exc, AppError):
            return error_response(exc.status, exc.message)
        if isinstance(exc, SanicException):
            status = int(getattr(exc, "status_code", 500) or 500)
            msg = str(exc) or "error"
            if status == 404 and request is not None:
                msg = f"no route for {request.method} {request.path}"
            headers = dict(getattr(exc, "headers", None) or {})
            return error_response(status, msg, headers=headers or None)
        log.exception("unhandled error on %s %s", getattr(request, "method", "?"), getattr(request, "path", "?"))
        return error_response(500, "internal server error")

    app.error_handler.add(Exception, handler)
