"""The error envelope every larql-edge server answers with: ``{"error": "message"}``.

One table maps error types to statuses: each `LarqlError` class declares its own ``status``
(`larql_edge.errors`). Sanic's own errors (unknown route, wrong method, body over the size limit,
malformed HTTP) keep their status and headers; a 405 always carries ``Allow`` (RFC 9110 §15.5.6), also
on a path with parameters, where Sanic's router does not name the methods. Anything else is a bug: a
500 with a generic message, the traceback in the log, never to the caller.

A role whose API has its own error format (larql-serve: OpenAI's ``{"error": {"message", "type",
"param", "code"}}``) passes ``error_body(status, message, exc)`` to `make_app`: the statuses and
headers stay the toolkit's, only the body's shape is the role's.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any

from sanic import Sanic
from sanic.constants import HTTP_METHODS
from sanic.exceptions import MethodNotAllowed, SanicException
from sanic.request import Request
from sanic.response import HTTPResponse, json

from larql_edge.errors import LarqlError, TooManyRequests

log = logging.getLogger("larql.http")


ErrorBody = Callable[[int, str, BaseException], Any]


def error_response(status: int, message: str, headers: dict[str, str] | None = None,
                   body: ErrorBody | None = None, exc: BaseException | None = None) -> HTTPResponse:
    if body is not None:
        return json(body(status, message, exc if exc is not None else Exception(message)), status=status, headers=headers)
    return json({"error": message}, status=status, headers=headers)


def error_kind(exc: BaseException) -> str:
    """A short label for metrics: the LarqlError kind, or the Sanic error class, or 'internal'."""
    if isinstance(exc, LarqlError):
        return exc.kind
    if isinstance(exc, SanicException):
        return type(exc).__name__.lower()
    return "internal"


def allowed_methods(request: Request) -> str:
    """The methods the app routes for this request's path (what a 405's ``Allow`` lists)."""
    allowed = []
    for method in HTTP_METHODS:
        try:
            request.app.router.get(request.path, method, None)
        except SanicException:
            continue
        allowed.append(method)
    return ", ".join(allowed)


def response_for(exc: BaseException, request: Request | None, body: ErrorBody | None = None) -> HTTPResponse:
    if isinstance(exc, LarqlError):
        headers = None
        if isinstance(exc, TooManyRequests):
            headers = {"Retry-After": str(max(1, math.ceil(exc.retry_after)))}
        return error_response(exc.status, exc.message, headers, body, exc)
    if isinstance(exc, SanicException):
        status = int(getattr(exc, "status_code", 500) or 500)
        msg = str(exc) or "error"
        if status == 404 and request is not None:
            msg = f"no route for {request.method} {request.path}"
        headers = dict(getattr(exc, "headers", None) or {})
        if isinstance(exc, MethodNotAllowed) and request is not None and not any(k.lower() == "allow" for k in headers):
            headers["Allow"] = allowed_methods(request)
        return error_response(status, msg, headers or None, body, exc)
    log.exception("unhandled error on %s %s", getattr(request, "method", "?"), getattr(request, "path", "?"))
    return error_response(500, "internal server error", None, body, exc)


def install_error_envelope(app: Sanic, body: ErrorBody | None = None) -> None:
    async def handler(request: Request, exc: Exception) -> HTTPResponse:
        return response_for(exc, request, body)

    app.error_handler.add(Exception, handler)
