"""What the two small HTTP/1.1 clients of the hot path share (``h1_sync``, synchronous, for the
attention-only client; ``h1_async``, asyncio, for the router): their errors, the reply they return,
the bound on a reply's size, and how both describe a failure in one line."""

from __future__ import annotations

import json as jsonlib
from dataclasses import dataclass


class TransportError(Exception):
    """No reply: the server could not be reached, the connection broke, or it timed out."""


class ConnectFailed(TransportError):
    pass


class TimedOut(TransportError):
    pass


class ConnectionLost(TransportError):
    """The connection broke before the whole reply arrived (reset, or closed mid-reply)."""


class ProtocolError(TransportError):
    """The reply is not HTTP/1.1 we can read: a malformed status line, header or chunk framing,
    an invalid Content-Length, or a head larger than the clients accept."""


class ReplyTooLarge(ProtocolError):
    """The reply's body is larger than the client's ``max_body``; nothing past the bound was read."""


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
    if isinstance(e, TimedOut):
        return "timed out"
    if isinstance(e, ReplyTooLarge):
        return "reply too large"
    if isinstance(e, ProtocolError):
        return "malformed reply"
    return "connection lost"


def error_text(r: Reply, limit: int = 300) -> str:
    """The ``error`` of a JSON error envelope, else the start of the body."""
    try:
        return str(r.json().get("error", ""))[:limit]
    except (ValueError, AttributeError):
        return r.text[:limit]
