"""The request log: one `RecordedRequest` per HTTP request the server answered (or cut)."""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass, field
from typing import Iterator

REDACTED = "<redacted>"


@dataclass(frozen=True)
class RecordedRequest:
    """One request as the server saw it. The Authorization header's value is never kept."""

    method: str
    path: str  # percent-decoded path, without the query string
    raw_path: str  # the path exactly as sent (percent-encoded), without the query string
    query: dict[str, list[str]]
    headers: dict[str, str]  # lower-cased names; `authorization` is "<redacted>" when it was sent
    body_size: int  # request body bytes received
    status: int  # status sent (0 if the handler died before answering)
    response_size: int  # response body bytes actually written (less than announced when a download was cut)
    auth: str  # "none" (no token), "valid", "invalid"
    fault: str | None = None  # "status" (forced status), "cut" (download cut), "corrupt" (a flipped byte), or None
    timestamp: float = field(default=0.0, compare=False)

    def header(self, name: str, default: str | None = None) -> str | None:
        return self.headers.get(name.lower(), default)

    def __str__(self) -> str:  # handy in assertion messages
        query = "&".join(f"{k}={v}" for k, vs in self.query.items() for v in vs)
        return f"{self.method} {self.path}{'?' + query if query else ''} -> {self.status}"


class RequestLog:
    """Thread-safe log. Readers first wait (briefly) for requests still being handled: the client can see a
    response before the handler thread has logged it."""

    SETTLE_TIMEOUT = 5.0

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._items: list[RecordedRequest] = []
        self._in_flight = 0

    def begin(self) -> None:
        with self._cond:
            self._in_flight += 1

    def end(self, item: RecordedRequest) -> None:
        with self._cond:
            self._items.append(item)
            self._in_flight -= 1
            self._cond.notify_all()

    def snapshot(self) -> list[RecordedRequest]:
        with self._cond:
            self._cond.wait_for(lambda: self._in_flight == 0, timeout=self.SETTLE_TIMEOUT)
            return list(self._items)

    def __len__(self) -> int:
        return len(self.snapshot())

    def __iter__(self) -> Iterator[RecordedRequest]:
        return iter(self.snapshot())

    def clear(self) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self._in_flight == 0, timeout=self.SETTLE_TIMEOUT)
            self._items.clear()

    def matching(
        self, method: str | None = None, path_regex: str | None = None, *, status: int | None = None
    ) -> list[RecordedRequest]:
        return filter_requests(self.snapshot(), method, path_regex, status=status)


def filter_requests(
    items: list[RecordedRequest],
    method: str | None = None,
    path_regex: str | None = None,
    *,
    status: int | None = None,
) -> list[RecordedRequest]:
    """Keep requests with this method (None/"*" = any), a decoded path matching `path_regex` (re.search), status."""
    pattern = re.compile(path_regex) if path_regex is not None else None
    return [
        r
        for r in items
        if (method in (None, "*") or r.method == method.upper())
        and (pattern is None or pattern.search(r.path))
        and (status is None or r.status == status)
    ]
