"""HTTP plumbing shared by every route: dispatch, authorization, faults, bodies, responses, logging.

The API handlers themselves live in the `_api_*` mixins; `HubRequestHandler` (in `_server.py`) combines them.
Connections are HTTP/1.1 keep-alive (the client pools them), so every request body is always consumed, and
every response carries a Content-Length.
"""

from __future__ import annotations

import json
import time
import traceback
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator
from urllib.parse import parse_qs, unquote, urlsplit

from ._errors import HubError, repo_not_found
from ._recording import REDACTED, RecordedRequest
from ._routes import PRESIGNED, READ, TOKEN, WRITE, NoRoute, Route, resolve_route

if TYPE_CHECKING:
    from ._state import HubState
    from ._storage import Repo

INVALID_CREDENTIALS = "Invalid credentials in Authorization header"  # the Hub's wording; the client keys on it
_CHUNK = 1 << 20


class BaseHubHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "hubserver/1.0"
    # A reply's head and body are separate writes: with Nagle's algorithm the second waits for the
    # client's delayed ACK of the first (~40 ms a request on loopback), as the Hub's servers do not.
    disable_nagle_algorithm = True

    # ------------------------------------------------------------------ per-request state
    def _reset(self) -> None:
        self.status_sent = 0
        self.response_size = 0
        self.body_size = 0
        self.body_consumed = False
        self.body_cache: bytes | None = None
        self.fault_kind: str | None = None
        self.auth_state = "none"
        self.user: str | None = None
        self.query: dict[str, list[str]] = {}
        self.raw_path = ""
        self.decoded_path = ""

    @property
    def hub(self) -> "HubState":
        return self.server.hub  # type: ignore[attr-defined]

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - silence the default stderr logging
        pass

    # every verb goes through one dispatcher
    def do_GET(self) -> None:
        self._dispatch()

    do_HEAD = do_POST = do_PUT = do_PATCH = do_DELETE = do_GET

    def _dispatch(self) -> None:
        self._reset()
        started = time.time()
        self.hub.log.begin()  # matched by log.end() in _record, whatever happens
        try:
            split = urlsplit(self.path)
            self.raw_path = split.path
            self.decoded_path = unquote(split.path)
            self.query = parse_qs(split.query, keep_blank_values=True)
            self.auth_state, self.user = self._authenticate()
            fault = self.hub.faults.take_status(self.command, self.decoded_path)
            if fault is not None:
                self.fault_kind = "status"
                raise HubError(fault.status, fault.message, code=fault.code, headers=fault.headers)
            route = resolve_route(self.command, self.raw_path)
            self._authorize(route)
            getattr(self, f"h_{route.name}")(**route.params)
        except HubError as err:
            self.drain_body()
            self.send_error_json(err)
        except NoRoute as err:
            self.drain_body()
            self.send_error_json(HubError(err.status, str(err)))
        except (ConnectionError, TimeoutError):
            self.close_connection = True
        except Exception as err:  # a bug in the test server: answer 500 with the traceback, keep serving
            self.drain_body()
            message = f"hubserver internal error: {err!r}\n{traceback.format_exc()}"
            if not self.status_sent:
                self.send_error_json(HubError(500, message))
            else:
                self.close_connection = True
        finally:
            try:
                if not self.body_consumed:
                    self.drain_body()  # keep the kept-alive connection in sync for the next request
            finally:
                self._record(started)

    def _record(self, started: float) -> None:
        headers = {k.lower(): v for k, v in self.headers.items()}
        if "authorization" in headers:
            headers["authorization"] = REDACTED
        self.hub.log.end(
            RecordedRequest(
                method=self.command,
                path=self.decoded_path,
                raw_path=self.raw_path,
                query={k: list(v) for k, v in self.query.items()},
                headers=headers,
                body_size=self.body_size,
                status=self.status_sent,
                response_size=self.response_size,
                auth=self.auth_state,
                fault=self.fault_kind,
                timestamp=started,
            )
        )

    # ------------------------------------------------------------------ authorization
    def _authenticate(self) -> tuple[str, str | None]:
        header = self.headers.get("Authorization")
        if not header:
            return "none", None
        scheme, _, token = header.partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            return "invalid", None
        if not self.hub.auth_enabled:
            return "valid", self.hub.default_user
        user = self.hub.tokens.get(token)
        return ("valid", user) if user is not None else ("invalid", None)

    def _authorize(self, route: Route) -> None:
        if route.auth == PRESIGNED:
            return
        if self.auth_state == "invalid":
            raise HubError(401, INVALID_CREDENTIALS)
        if not self.hub.auth_enabled:
            return
        needs_token = route.auth in (WRITE, TOKEN) or (route.auth == READ and self.hub.require_token_for_reads)
        if needs_token and self.auth_state != "valid":
            raise HubError(401, "Authorization required: send a valid 'Authorization: Bearer <token>' header")

    @property
    def acting_user(self) -> str:
        return self.user or self.hub.default_user

    def visible_repo(self, repo_type: str, repo_id: str) -> "Repo":
        """The repo, or RepoNotFound (also for a private repo requested without a valid token, as on the Hub)."""
        repo = self.hub.storage.get_repo(repo_type, repo_id)
        if repo.private and self.auth_state != "valid":
            raise repo_not_found(repo_type, repo_id)
        return repo

    # ------------------------------------------------------------------ request bodies
    def iter_body(self) -> Iterator[bytes]:
        """Yield the request body (Content-Length or chunked) once; later calls yield nothing."""
        if self.body_consumed:
            return
        self.body_consumed = True
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            while True:
                line = self.rfile.readline(65537)
                if not line:
                    raise ConnectionError("client closed the connection mid-body")
                size = int(line.split(b";", 1)[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline(65537) not in (b"\r\n", b"\n", b""):
                        pass  # trailers
                    return
                remaining = size
                while remaining:
                    chunk = self.rfile.read(min(remaining, _CHUNK))
                    if not chunk:
                        raise ConnectionError("client closed the connection mid-chunk")
                    remaining -= len(chunk)
                    self.body_size += len(chunk)
                    yield chunk
                self.rfile.readline()  # CRLF after the chunk
        else:
            remaining = int(self.headers.get("Content-Length") or 0)
            while remaining:
                chunk = self.rfile.read(min(remaining, _CHUNK))
                if not chunk:
                    raise ConnectionError("client closed the connection mid-body")
                remaining -= len(chunk)
                self.body_size += len(chunk)
                yield chunk

    def read_body(self) -> bytes:
        if self.body_cache is None:
            self.body_cache = b"".join(self.iter_body())
        return self.body_cache

    def read_json(self) -> Any:
        body = self.read_body()
        if not body.strip():
            return {}
        try:
            return json.loads(body)
        except ValueError as exc:
            raise HubError(400, f"Invalid JSON body: {exc}") from exc

    def drain_body(self) -> None:
        try:
            for _ in self.iter_body():
                pass
        except (ConnectionError, ValueError):
            self.close_connection = True

    # ------------------------------------------------------------------ query helpers
    def qget(self, name: str, default: str | None = None) -> str | None:
        values = self.query.get(name)
        return values[-1] if values else default

    def qbool(self, name: str) -> bool:
        return (self.qget(name) or "").lower() in ("1", "true", "yes", "on")

    # ------------------------------------------------------------------ responses
    def send_bytes(
        self,
        status: int,
        body: bytes = b"",
        *,
        content_type: str = "application/json; charset=utf-8",
        headers: dict[str, str] | None = None,
    ) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.status_sent = status
        if self.command != "HEAD" and body:
            self.wfile.write(body)
            self.response_size += len(body)

    def send_json(
        self, status: int, payload: Any, *, headers: dict[str, str] | None = None, content_type: str | None = None
    ) -> None:
        body = json.dumps(payload).encode()
        self.send_bytes(status, body, content_type=content_type or "application/json; charset=utf-8", headers=headers)

    def send_error_json(self, err: HubError) -> None:
        headers = dict(err.headers)
        if err.code:
            headers["X-Error-Code"] = err.code
        headers["X-Error-Message"] = err.message.splitlines()[0][:500] if err.message else ""
        self.send_json(err.status, {"error": err.message, **err.body}, headers=headers)

    def send_file(
        self, source: Path | bytes, size: int, *, headers: dict[str, str], file_path: str, range_ok: bool = True
    ) -> None:
        """Send a blob honouring `Range: bytes=...` (206/416) and any download cut armed for `file_path`."""
        start, end, status = 0, size - 1, 200
        extra = dict(headers)
        extra["Accept-Ranges"] = "bytes"
        range_header = self.headers.get("Range") if (range_ok and self.command == "GET") else None
        if range_header:
            parsed = parse_range(range_header, size)
            if parsed == "unsatisfiable":
                self.send_json(
                    416, {"error": "Requested range not satisfiable"}, headers={"Content-Range": f"bytes */{size}"}
                )
                return
            if parsed is not None:
                start, end = parsed  # type: ignore[str-unpack,assignment]
                status = 206
                extra["Content-Range"] = f"bytes {start}-{end}/{size}"
        length = max(0, end - start + 1)
        self.send_response(status)
        self.send_header("Content-Type", "application/octet-stream")
        for key, value in extra.items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(length))
        self.end_headers()
        self.status_sent = status
        if self.command == "HEAD" or length == 0:
            return
        cut = self.hub.faults.take_cut(file_path, self.decoded_path)
        corrupt = self.hub.faults.take_corruption(file_path, self.decoded_path)
        throttle = self.hub.faults.throttle_for(file_path, self.decoded_path)
        budget = length if cut is None else min(cut, length)
        for chunk in _iter_source(source, start, budget):
            if corrupt:
                chunk, corrupt = bytes([chunk[0] ^ 0xFF]) + chunk[1:], False
                self.fault_kind = "corrupt"
            if throttle is None:
                self.wfile.write(chunk)
                self.response_size += len(chunk)
                continue
            rate = throttle.bytes_per_second
            piece = max(1024, rate // 20)  # about 20 writes a second: a steady slow link
            for offset in range(0, len(chunk), piece):
                part = chunk[offset : offset + piece]
                self.wfile.write(part)
                self.response_size += len(part)
                throttle.sent(len(part))
                time.sleep(len(part) / rate)
        if cut is not None:
            self.fault_kind = "cut"
            if budget < length:
                self.wfile.flush()
                self.close_connection = True  # EOF before Content-Length is satisfied: the client sees a cut


def _iter_source(source: Path | bytes, start: int, count: int) -> Iterator[bytes]:
    if isinstance(source, (bytes, bytearray)):
        for offset in range(start, start + count, _CHUNK):
            yield bytes(source[offset : min(offset + _CHUNK, start + count)])
        return
    with open(source, "rb") as fh:
        fh.seek(start)
        remaining = count
        while remaining:
            chunk = fh.read(min(remaining, _CHUNK))
            if not chunk:
                break
            remaining -= len(chunk)
            yield chunk


def parse_range(header: str, size: int) -> tuple[int, int] | str | None:
    """Parse a single `bytes=a-b` / `bytes=a-` / `bytes=-n` range. None = ignore (serve 200), or "unsatisfiable"."""
    header = header.strip()
    if not header.lower().startswith("bytes=") or "," in header:
        return None
    first, _, last = header[6:].strip().partition("-")
    try:
        if first == "":
            suffix = int(last)
            if suffix <= 0:
                return "unsatisfiable"
            return max(0, size - suffix), size - 1
        start = int(first)
        end = int(last) if last else size - 1
    except ValueError:
        return None
    if start >= size or start > end:
        return "unsatisfiable"
    return start, min(end, size - 1)
