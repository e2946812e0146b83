"""larql-serve's API keys: ``Authorization: Bearer KEY`` on every route but health, readiness,
metrics and the OpenAPI document.

Checked when the route is known and BEFORE the body is read (the POST routes take their body as a
stream, read only once the key is checked): a caller without a key costs the server a header parse,
whatever the body it announces (Sanic then drops the connection rather than read a body over
max_body_bytes).
Every key is compared, each as a SHA-256 digest with `hmac.compare_digest`, so the time taken says
nothing about which key, or which prefix of one, came close. No key appears in a log or an error.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence

from sanic import Sanic
from sanic.request import Request

from larql_edge.errors import Unauthorized

from .api import api_error

OPEN_PATHS = frozenset({"/v1/health", "/v1/ready", "/metrics", "/openapi.json"})


def parse_keys(raw: str | None) -> tuple[str, ...]:
    """``--api-key`` (its env twin or its file): several keys, separated by commas or newlines."""
    if not raw:
        return ()
    return tuple(dict.fromkeys(k.strip() for k in raw.replace("\n", ",").split(",") if k.strip()))


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8", "surrogateescape")).digest()


def require_api_keys(app: Sanic, keys: Sequence[str]) -> None:
    digests = [_digest(k) for k in keys]
    if not digests:
        return

    # A request middleware runs before the body is read for the routes that take one as a stream (the
    # POST routes of larql-serve: `routes.body` reads it after). Not a signal: Sanic compiles signal
    # dispatch into the class's handle_request, which would reach every other app of the process.
    @app.on_request
    async def _check(request: Request) -> None:
        if request.path in OPEN_PATHS:
            return
        scheme, _, token = (request.headers.get("authorization") or "").partition(" ")
        presented = _digest(token.strip())
        ok = False
        for d in digests:  # every key, always: no early exit
            ok |= hmac.compare_digest(presented, d)
        if not ok or scheme.lower() != "bearer":
            raise api_error(Unauthorized, "no API key, or a wrong one: send Authorization: Bearer KEY"
                            if token else "an API key is required: send Authorization: Bearer KEY",
                            None, "invalid_api_key")
