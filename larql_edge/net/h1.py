"""What the two small HTTP/1.1 clients of the hot path share (``h1_sync``, synchronous, for the
attention-only client; ``h1_async``, asyncio, for the router): their errors, the reply they return,
the bound on a reply's size, and how both describe a failure in one line."""

from __future__ import annotations

import json as jsonlib
from dataclasses import dataclass

from larql_edge.errors import ConnectFailed, ConnectionLost, MalformedReply, ReplyTooLarge, Stalled, Superseded, TimedOut, TransportError

__all__ = ["ConnectFailed", "ConnectionLost", "DEFAULT_MAX_BODY", "MalformedReply", "Reply", "ReplyTooLarge", "Stalled",
           "Superseded", "TimedOut", "TransportError", "describe", "error_text"]

# A prefill of a few thousand tokens of a large model stays far below this (the FFN server caps a
# request body at the same size); anything bigger is a member's mistake, not something to buffer.
DEFAULT_MAX_BODY = 256 << 20


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
    if isinstance(e, Stalled):
        return "stalled (no reply within the bound learned from recent hops)"
    if isinstance(e, TimedOut):
        return "timed out"
    if isinstance(e, Superseded):
        return "superseded by its hedge"
    if isinstance(e, ReplyTooLarge):
        return "reply too large"
    if isinstance(e, MalformedReply):
        return "malformed reply"
    return "connection lost"


def error_text(r: Reply, limit: int = 300) -> str:
    """The ``error`` of a JSON error envelope, else the start of the body."""
    try:
        return str(r.json().get("error", ""))[:limit]
    except (ValueError, AttributeError):
        return r.text[:limit]
