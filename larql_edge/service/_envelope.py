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


# Sanic's cap on a request's head (request line and headers), at its most: 16 KB. A GET's query string
# lives there, so a long ``?text=`` cannot be read whatever a route's own limit; that route's POST form
# takes it in the body.
MAX_HEAD_BYTES = 16384
_HEAD_TOO_LARGE = "Request header exceeds the size limit"  # Sanic's message (http1_request_header)


def head_too_large(request: Request | None, limit: int) -> tuple[int, str]:
    """The status and message for a request head over ``limit`` bytes: 414 when the request line
    (the URL) alone is over it, else 431 (RFC 9110 §15.5.15, RFC 6585 §5), naming the POST form of
    the route when it has one. Sanic raised this before the request was parsed: the start of the
    request line is still in the connection's buffer."""
    buf = bytes(getattr(getattr(request, "stream", None), "recv_buffer", b"") or b"")
    line = buf.split(b"\r\n", 1)
    uri_too_long = len(line) == 1 or len(line[0]) >= limit
    parts = line[0][:2048].split(b" ")
    method = parts[0].decode("latin-1") if parts and parts[0].isalpha() else ""
    path = parts[1].split(b"?", 1)[0].decode("latin-1", "replace") if len(parts) > 1 else ""
    what = "request line (the URL)" if uri_too_long else "request head (request line and headers)"
    msg = f"the {what} is over {limit} bytes, more than this server reads"
    post = False
    if request is not None and path.startswith("/") and method != "POST":
        try:
            request.app.router.get(path, "POST", None)
            post = True
        except SanicException:
            pass
    if post:
        msg += f": send it as POST {path[:200]} with a JSON body (the route's published limits apply there)"
    elif uri_too_long:
        msg += ": shorten the query string"
    return (414 if uri_too_long else 431), msg


def response_for(exc: BaseException, request: Request | None, body: ErrorBody | None = None) -> HTTPResponse:
    if isinstance(exc, SanicException) and getattr(exc, "status_code", None) == 413 and str(exc) == _HEAD_TOO_LARGE:
        # Sanic's effective bound (a class attribute: the least of the head size and the body limit)
        limit = int(getattr(getattr(request, "stream", None), "HEADER_MAX_SIZE", 0) or MAX_HEAD_BYTES)
        status, msg = head_too_large(request, limit)
        return error_response(status, msg, None, body, exc)
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
