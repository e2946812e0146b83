"""What the two small HTTP/1.1 clients of the hot path share (``h1_sync``, synchronous, for the
attention-only client; ``h1_async``, asyncio, for the router): their errors, the reply they return,
the bound on a reply's size, how both describe a failure in one line, and the protocol rules both
read by: the request head they write, the reply head they parse, how a reply's body is framed
(Content-Length, chunked with extensions and trailers, until close, none for HEAD/204/304/1xx)
and whether its connection may be reused. Each client only moves the bytes (a blocking socket, an
asyncio stream)."""

from __future__ import annotations

import json as jsonlib
from dataclasses import dataclass

from larql_edge.errors import ConnectFailed, ConnectionLost, MalformedReply, ReplyTooLarge, Stalled, Superseded, TimedOut, TransportError

__all__ = ["ConnectFailed", "ConnectionLost", "DEFAULT_MAX_BODY", "MAX_HEAD", "MAX_HEADERS", "MalformedReply", "PIECE",
           "Reply", "ReplyTooLarge", "Stalled", "Superseded", "TimedOut", "TransportError", "body_framing", "chunk_size",
           "describe", "error_text", "parse_head", "request_head"]

# A prefill of a few thousand tokens of a large model stays far below this (the FFN server caps a
# request body at the same size); anything bigger is a member's mistake, not something to buffer.
DEFAULT_MAX_BODY = 256 << 20
# Largest reply head (status line and headers) read; also the longest chunk size or trailer line.
MAX_HEAD = 64 << 10
MAX_HEADERS = 100  # as http.client accepts
PIECE = 64 << 10  # close-delimited bodies are read in pieces, so the size bound stops early
_HEX = b"0123456789abcdefABCDEF"
_OURS = ("host", "content-length", "connection", "transfer-encoding")  # the client writes these itself


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


def request_head(method: str, target: str, host: str, headers: dict[str, str] | None, body: bytes) -> bytes:
    """The request line and headers (``host`` as the URL's ``host[:port]``); a body always goes with
    its Content-Length, and a POST/PUT/PATCH without one says 0. Connections are kept alive
    (HTTP/1.1's default), so no Connection header."""
    head = [f"{method} {target} HTTP/1.1", f"host: {host}"]
    head += [f"{k}: {v}" for k, v in (headers or {}).items() if k.lower() not in _OURS]
    if body or method in ("POST", "PUT", "PATCH"):
        head.append(f"content-length: {len(body)}")
    return ("\r\n".join(head) + "\r\n\r\n").encode("latin-1")


def parse_head(head: bytes) -> tuple[int, str, dict[str, str]]:
    """Status, version and headers (lower-case names) of a reply head that ends with a blank line."""
    lines = head[:-4].decode("latin-1").split("\r\n")
    version, _, rest = lines[0].partition(" ")
    code = rest[:3]
    if (version not in ("HTTP/1.1", "HTTP/1.0") or len(code) != 3 or not (code.isascii() and code.isdigit())
            or rest[3:4] not in ("", " ")):
        raise MalformedReply(f"malformed status line {lines[0][:80]!r}")
    if len(lines) > MAX_HEADERS + 1:
        raise MalformedReply(f"more than {MAX_HEADERS} header lines")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, colon, value = line.partition(":")
        if not colon or not name or name != name.strip():  # also a folded (continued) line
            raise MalformedReply(f"malformed header line {line[:80]!r}")
        headers[name.lower()] = value.strip()
    return int(code), version, headers


def _tokens(value: str) -> list[str]:
    return [t.strip().lower() for t in value.split(",")]


def body_framing(method: str, status: int, version: str, headers: dict[str, str], limit: int) -> tuple[str, int, bool]:
    """How the body of a (final) reply is read: ``(kind, length, keep)``, kind ``"none"``,
    ``"length"`` (``length`` bytes), ``"chunked"`` or ``"close"`` (until the server closes: the
    connection is not reused); ``keep``: the connection may carry the next request. A Content-Length
    over ``limit`` is a `ReplyTooLarge` before any of the body is read."""
    keep = version == "HTTP/1.1" and "close" not in _tokens(headers.get("connection", ""))
    if method == "HEAD" or status in (204, 304) or 100 <= status < 200:
        return "none", 0, keep
    if "chunked" in _tokens(headers.get("transfer-encoding", "")):  # it wins over Content-Length
        return "chunked", 0, keep
    if "content-length" in headers:
        length = headers["content-length"]
        if not (length.isascii() and length.isdigit()):
            raise MalformedReply(f"invalid Content-Length {length[:40]!r}")
        n = int(length)
        if n > limit:
            raise ReplyTooLarge(f"reply of {n} bytes, more than the {limit} accepted")
        return "length", n, keep
    return "close", 0, False


def chunk_size(line: bytes) -> int:
    """The size on a chunk's size line (extensions ignored); 0 ends the body."""
    size_text = line.split(b";", 1)[0].strip()
    if not size_text or size_text.strip(_HEX) or len(size_text) > 16:
        raise MalformedReply(f"malformed chunk size line {line[:40]!r}")
    return int(size_text, 16)
