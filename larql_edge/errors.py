"""Typed errors of the running services, and the one table from error type to HTTP status.

Handlers raise these; `larql_edge.service.envelope` turns every one of them into ``{"error": "..."}`` with the status
below. Foreign exceptions are translated once, where they occur; anything that is not an `AppError`
is a bug and becomes a 500 with a generic message (the details go to the log, never to the caller).
"""

from __future__ import annotations


class AppError(Exception):
    status = 500
    kind = "internal"

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class BadRequest(AppError):
    status, kind = 400, "bad_request"


class Unauthorized(AppError):
    status, kind = 401, "unauthorized"


class NotFound(AppError):
    status, kind = 404, "not_found"


class MethodNotAllowed(AppError):
    status, kind = 405, "method_not_allowed"


class NotAcceptable(AppError):
    status, kind = 406, "not_acceptable"


class PayloadTooLarge(AppError):
    status, kind = 413, "payload_too_large"


class UnsupportedMediaType(AppError):
    status, kind = 415, "unsupported_media_type"


class BadGateway(AppError):
    """A dependency answered with an error or garbage."""

    status, kind = 502, "bad_gateway"


class ServiceUnavailable(AppError):
    """A dependency is down, or this service is not loaded yet."""

    status, kind = 503, "unavailable"


class GatewayTimeout(AppError):
    status, kind = 504, "timeout"


# The table, for documentation (README / OpenAPI) and for tests.
STATUS_BY_ERROR = {cls.__name__: cls.status for cls in AppError.__subclasses__()}
