"""Reading request bodies, the same way in every server.

One content-type rule: ``application/json`` is JSON; ``application/x-larql-ffn``,
``application/octet-stream`` and a missing Content-Type (which HTTP says a recipient may treat as
``application/octet-stream``, RFC 9110 §8.3) are binary; anything else is a 415 naming what the
route takes. Parameters (``; charset=...``) are ignored, as LARQL does.

JSON bodies are parsed with bounded nesting (``MAX_JSON_DEPTH``; deeper is a 400, never a
RecursionError and a 500) and without the non-standard ``NaN``/``Infinity`` constants.
"""

from __future__ import annotations

import json
import re
from typing import Any

from larql_edge.errors import BadRequest, PayloadTooLarge, UnsupportedMediaType
from larql_edge.wire import BINARY, JSON

BINARY_TYPES = frozenset({BINARY, "application/octet-stream", ""})
MAX_JSON_DEPTH = 32

JSON_KIND, BINARY_KIND = "json", "binary"
_LONE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")  # any escaped surrogate: only then are strings checked


def content_type(request) -> str:
    return (request.headers.get("content-type") or "").split(";", 1)[0].strip().lower()


def body_kind(request, allowed: tuple[str, ...] = (JSON_KIND, BINARY_KIND)) -> str:
    """``"json"`` or ``"binary"`` from the Content-Type; a kind the route does not take is a 415."""
    ctype = content_type(request)
    kind = JSON_KIND if ctype == JSON else BINARY_KIND if ctype in BINARY_TYPES else None
    if kind is None or kind not in allowed:
        takes = " or ".join(JSON if k == JSON_KIND else BINARY for k in allowed)
        raise UnsupportedMediaType(f"Content-Type {ctype or 'none'!r}: {request.method} {request.path} takes {takes}")
    return kind


def _refuse_constant(name: str) -> Any:
    raise BadRequest(f"malformed JSON body: {name} is not a JSON number")


def _check_depth(obj: Any, limit: int) -> None:
    stack = [(obj, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > limit:
            raise BadRequest(f"the JSON body is nested more than {limit} levels deep")
        if isinstance(node, dict):
            stack.extend((v, depth + 1) for v in node.values() if isinstance(v, (dict, list)))
        elif isinstance(node, list):
            stack.extend((v, depth + 1) for v in node if isinstance(v, (dict, list)))


def _check_surrogates(obj: Any) -> None:
    stack = [obj]
    while stack:
        node = stack.pop()
        if isinstance(node, str):
            try:
                node.encode("utf-8")
            except UnicodeEncodeError:
                raise BadRequest(f"the JSON body has a lone surrogate ({node[:40]!r}...): "
                                 "a string must be Unicode text") from None
        elif isinstance(node, dict):
            stack.extend(node)
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)


def parse_json(raw: bytes | str, max_depth: int = MAX_JSON_DEPTH) -> Any:
    try:
        # RFC 8259 §8.1: JSON between systems is UTF-8 (json.loads would guess UTF-16 and UTF-32 too).
        text = raw.decode("utf-8") if isinstance(raw, (bytes, bytearray)) else raw
        obj = json.loads(text or "", parse_constant=_refuse_constant)
    except RecursionError:
        raise BadRequest(f"the JSON body is nested more than {max_depth} levels deep") from None
    except UnicodeDecodeError as e:
        raise BadRequest(f"the JSON body is not UTF-8 ({e})") from None
    except ValueError as e:
        raise BadRequest(f"malformed JSON body ({e})") from None
    _check_depth(obj, max_depth)
    # An escaped lone surrogate ("\ud800") parses to a str no tokenizer, encoder or reply can take.
    if "\\u" in text and _LONE_ESCAPE.search(text):
        _check_surrogates(obj)
    return obj


def json_body(request, max_depth: int = MAX_JSON_DEPTH) -> Any:
    return parse_json(request.body, max_depth)


def json_object(request, max_depth: int = MAX_JSON_DEPTH) -> dict:
    obj = json_body(request, max_depth)
    if not isinstance(obj, dict):
        raise BadRequest("the JSON body must be an object")
    return obj


async def read_body(request, limit: int) -> bytes:
    """The body of a streaming route (``stream=True``), read only up to ``limit`` bytes: a route that
    checks credentials from the headers first never waits for, or buffers, a large body."""
    length = request.headers.get("content-length")
    if length is not None and (not length.isdigit() or int(length) > limit):
        raise PayloadTooLarge(f"a body of {length[:20]} bytes; this route takes at most {limit}")
    body = bytearray()
    while (chunk := await request.stream.read()) is not None:
        body += chunk
        if len(body) > limit:
            raise PayloadTooLarge(f"a body over {limit} bytes; this route takes at most {limit}")
    return bytes(body)
