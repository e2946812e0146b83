"""What the two small HTTP/1.1 clients of the hot path share (app/client/_http.py, synchronous, for
the attention-only client; app/router/h1pool.py, asyncio, for the router): their errors, the reply
they return, and how both describe a failure in one line."""

from __future__ import annotations

import json as jsonlib
from dataclasses import dataclass

from larql_edge.errors import ConnectFailed, ConnectionLost, TimedOut, TransportError

__all__ = ["ConnectFailed", "ConnectionLost", "Reply", "TimedOut", "TransportError", "describe", "error_text"]


@dataclass
class Reply:
    status_code: int
    headers: dict[str, str]  # lower-case names
    content: bytes

    def json(self):
        return jsonlib.loads(self.content)

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", "replace")


def describe(e: TransportError) -> str:
    if isinstance(e, ConnectFailed):
        return "connection refused or unreachable"
    if isinstance(e, TimedOut):
        return "timed out"
    return "connection lost"


def error_text(r: Reply, limit: int = 300) -> str:
    """The ``error`` of a JSON error envelope, else the start of the body."""
    try:
        return str(r.json().get("error", ""))[:limit]
    except (ValueError, AttributeError):
        return r.text[:limit]
