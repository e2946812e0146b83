"""HTTP caching of ``GET /v1/embed/{id}`` (DESIGN.md §2).

A row is a pure function of the weights, so every representation carries a strong ETag
``"<embeddings sha256>-<id>-<bin|json>"``, ``Cache-Control: public, max-age=31536000, immutable``
and ``Vary: Accept``. When several models are served, the unprefixed URL also depends on the
``X-Model-Id`` header, so those responses say ``Vary: Accept, X-Model-Id``: a cache must never hand
one model's row to a request for another. A matching ``If-None-Match`` gets 304 with the same
headers and no body.
"""

from __future__ import annotations

import re

CACHE_CONTROL = "public, max-age=31536000, immutable"
_ETAG = re.compile(r'(?:W/)?"([^"]*)"')


def cache_headers(etag: str, vary_model: bool) -> dict[str, str]:
    return {
        "ETag": etag,
        "Cache-Control": CACHE_CONTROL,
        "Vary": "Accept, X-Model-Id" if vary_model else "Accept",
    }


def none_match(header: str | None, etag: str) -> bool:
    """True when ``If-None-Match`` matches ``etag``: ``*``, or any listed tag (weak comparison, RFC 9110)."""
    if not header:
        return False
    if header.strip() == "*":
        return True
    want = etag.strip('"')
    return any(m.group(1) == want for m in _ETAG.finditer(header))
