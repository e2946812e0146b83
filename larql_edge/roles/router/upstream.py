"""Requests from the router to members, with outcome bookkeeping and failover between replicas.

A member "failed" when it cannot be reached, times out, or answers 5xx: the registry cools it
down and the request is retried on another replica. A 4xx is the caller's mistake and goes back
to the caller as it is (retrying it elsewhere would fail the same way).
"""

from __future__ import annotations

import logging
import time

from larql_edge.roles.router.registry import Member, Registry
from larql_edge.service.h1 import Reply, TransportError, describe, error_text
from larql_edge.service.h1_async import H1Pool

log = logging.getLogger("larql.router")

FORWARD_REQUEST_HEADERS = ("content-type", "accept", "if-none-match", "accept-encoding")
FORWARD_REPLY_HEADERS = ("content-type", "etag", "cache-control", "vary", "last-modified", "content-encoding")


class MemberFailed(Exception):
    def __init__(self, member: Member, reason: str):
        super().__init__(reason)
        self.member = member
        self.reason = reason


class Upstream:
    def __init__(self, registry: Registry, timeout: float, metrics=None):
        self.registry = registry
        # Connect fails fast on loopback/LAN (refused or unreachable); reads may take a long prefill.
        self.pool = H1Pool(timeout=timeout, connect_timeout=min(2.0, timeout))
        self.metrics = metrics
        self.inflight = 0  # requests to members awaiting their reply (larql_router_inflight)

    async def close(self) -> None:
        await self.pool.aclose()

    async def send(self, m: Member, method: str, path: str, *, content: bytes | None = None,
                   headers: dict[str, str] | None = None, params: str = "") -> Reply:
        """One request to one member; raises MemberFailed for a failure that another replica may not have."""
        url = m.url + path + (f"?{params}" if params else "")
        m.inflight += 1
        self.inflight += 1
        t0 = time.perf_counter()
        try:
            r = await self.pool.request(method, url, content=content, headers=headers)
        except TransportError as e:
            self._failed(m, f"{type(e).__name__}")
            raise MemberFailed(m, f"{m.url}: {describe(e)}") from None
        finally:
            m.inflight -= 1
            self.inflight -= 1
        dt = time.perf_counter() - t0
        if self.metrics is not None:
            self.metrics.upstream.labels(m.capability).observe(dt)
        if r.status_code >= 500:
            self._failed(m, str(r.status_code))
            raise MemberFailed(m, f"{m.url}: HTTP {r.status_code} {error_text(r, 200)}".rstrip())
        self.registry.succeeded(m, dt * 1e3)
        return r

    def _failed(self, m: Member, why: str) -> None:
        self.registry.failed(m)
        if self.metrics is not None:
            self.metrics.failures.labels(m.capability, why).inc()
        log.warning("member %s (%s) failed: %s; cooling down", m.url, m.capability, why)


def forward_headers(headers) -> dict[str, str]:
    return {k: headers[k] for k in FORWARD_REQUEST_HEADERS if k in headers}


def reply_headers(r: Reply) -> dict[str, str]:
    return {k: r.headers[k] for k in FORWARD_REPLY_HEADERS if k in r.headers and k != "content-type"}


