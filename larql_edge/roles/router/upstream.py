"""Requests from the router to members, with outcome bookkeeping and failover between replicas.

What counts as a member's failure is `larql_edge.net.failures` (shared with the client): a
failure cools the member down in the registry (eviction follows if it keeps failing) and raises
`MemberFailed`, so the caller retries on another replica; the caller's own mistakes come back as
replies. Replies are bounded in size (an oversize one is the member's failure, read no further).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from larql_edge.errors import BadRequest, MemberSilent
from larql_edge.net.failures import is_member_failure
from larql_edge.net.h1 import Reply, TransportError, describe, error_text
from larql_edge.net.h1_async import H1Pool
from larql_edge.roles.router.registry import Member, Registry
from larql_edge.wire import VINDEX_HEADER

log = logging.getLogger("larql.router")

FORWARD_REQUEST_HEADERS = ("content-type", "accept", "if-none-match", "accept-encoding")
FORWARD_REPLY_HEADERS = ("content-type", "etag", "cache-control", "vary", "last-modified", "content-encoding",
                         VINDEX_HEADER)


class MemberFailed(Exception):
    def __init__(self, member: Member, reason: str):
        super().__init__(reason)
        self.member = member
        self.reason = reason


class Upstream:
    def __init__(self, registry: Registry, timeout: float, metrics=None, max_reply: int = 64 << 20):
        self.registry = registry
        # Connect fails fast on loopback/LAN (refused or unreachable); reads may take a long prefill.
        self.pool = H1Pool(timeout=timeout, connect_timeout=min(2.0, timeout))
        self.max_reply = max_reply
        self.metrics = metrics
        self.inflight = 0  # requests to members awaiting their reply (larql_router_inflight)

    async def close(self) -> None:
        await self.pool.aclose()

    async def send(self, m: Member, method: str, path: str, *, content: bytes | None = None,
                   headers: dict[str, str] | None = None, params: str = "", proxied: bool = False,
                   timeout: float | None = None) -> Reply:
        """One request to one member: a success or the caller's mistake comes back; anything else
        raises MemberFailed (a failure another replica may not have)."""
        url = m.url + path + (f"?{params}" if params else "")
        m.inflight += 1
        self.inflight += 1
        t0 = time.perf_counter()
        try:
            call = self.pool.request(method, url, content=content, headers=headers, max_body=self.max_reply,
                                     timeout=timeout)
            r = await (call if m.static else self._unless_silent(m, call))
        except TransportError as e:
            self._failed(m, f"{type(e).__name__}")
            raise MemberFailed(m, f"{m.url}: {describe(e)}") from None
        finally:
            m.inflight -= 1
            self.inflight -= 1
        dt = time.perf_counter() - t0
        if self.metrics is not None:
            self.metrics.upstream.labels(m.capability).observe(dt)
        if is_member_failure(r.status_code, proxied):
            self._failed(m, str(r.status_code))
            raise MemberFailed(m, f"{m.url}: HTTP {r.status_code} {error_text(r, 200)}".rstrip())
        self.registry.succeeded(m, dt * 1e3)
        return r

    async def _unless_silent(self, m: Member, call) -> Reply:
        """``call``'s reply, unless the member stops heartbeating first (frozen: SIGSTOP, a hung host):
        then it is failed at the registry's eviction age, not after the whole hop timeout (12-17 s of
        stalled generation). A member computing a long request still heartbeats from its event loop."""
        task = asyncio.ensure_future(call)
        reg = self.registry
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=min(0.5, reg.heartbeat_interval / 2))
                if done:
                    return task.result()
                silent = reg.silence(m)
                if silent > reg.evict_after:
                    raise MemberSilent(f"no heartbeat for {silent:.1f} s")
        finally:
            if not task.done():
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task

    def malformed(self, m: Member, why: str) -> MemberFailed:
        """A reply with a good status and a bad body is the member's failure too."""
        self._failed(m, "malformed")
        return MemberFailed(m, f"{m.url}: {why}")

    def _failed(self, m: Member, why: str) -> None:
        self.registry.failed(m)
        if self.metrics is not None:
            self.metrics.failures.labels(m.capability, why).inc()
        log.warning("member %s (%s) failed: %s; cooling down", m.url, m.capability, why)


def forward_headers(headers, names: tuple[str, ...] = FORWARD_REQUEST_HEADERS) -> dict[str, str]:
    """The caller's headers a member needs. Sanic hands over undecodable bytes as non-Latin-1
    characters that no HTTP request can carry: the caller's mistake, a 400, never a 500."""
    out = {k: headers[k] for k in names if k in headers}
    for k, v in out.items():
        if not v.isascii() or not v.isprintable():
            raise BadRequest(f"the {k} header is not printable ASCII")
    return out


def reply_headers(r: Reply) -> dict[str, str]:
    return {k: r.headers[k] for k in FORWARD_REPLY_HEADERS if k in r.headers and k != "content-type"}


