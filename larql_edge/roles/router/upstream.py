"""Requests from the router to members, with outcome bookkeeping and failover between replicas.

What counts as a member's failure is `larql_edge.net.failures` (shared with the client): a
failure cools the member down in the registry (eviction follows if it keeps failing) and raises
`MemberFailed`, so the caller retries on another replica; the caller's own mistakes come back as
replies. Replies are bounded in size (an oversize one is the member's failure, read no further).

Slow is not failed (#19, DESIGN.md §10). A joined member proves it is alive by heartbeating, so a
reply later than its hop deadline is not evidence against it (under the router's own load, or a
legal huge request on a busy host, a healthy shard is simply slow): past the deadline the request
moves to another live replica if the caller says there is one (`MemberSlow`, no cooldown), and
otherwise keeps waiting, up to ``max_wait``. Only silence (no heartbeat), no connection, a bad
status or a bad reply fails a joined member. A static member has no heartbeat to prove it alive:
its deadline is a failure, as before.
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


class MemberSlow(MemberFailed):
    """A live member past its hop deadline while another replica could answer: the request moves
    there. Not a failure of the member (no cooldown, no failure counted)."""


class Upstream:
    def __init__(self, registry: Registry, timeout: float, metrics=None, max_reply: int = 64 << 20,
                 max_wait: float = 600.0):
        self.registry = registry
        # Connect fails fast on loopback/LAN (refused or unreachable); reads may take a long prefill.
        self.pool = H1Pool(timeout=timeout, connect_timeout=min(2.0, timeout))
        self.max_reply = max_reply
        self.max_wait = max_wait  # the longest a live (heartbeating) member is waited for
        self.metrics = metrics
        self.inflight = 0  # requests to members awaiting their reply (larql_router_inflight)
        self.slow = 0  # replies past their deadline from live members (waited for, or moved: not failures)

    async def close(self) -> None:
        await self.pool.aclose()

    async def send(self, m: Member, method: str, path: str, *, content: bytes | None = None,
                   headers: dict[str, str] | None = None, params: str = "", proxied: bool = False,
                   timeout: float | None = None, elsewhere: bool = False) -> Reply:
        """One request to one member: a success or the caller's mistake comes back; anything else
        raises MemberFailed (a failure another replica may not have). ``timeout``: the hop's
        deadline; ``elsewhere``: another live replica could answer this (then a live member past
        the deadline raises `MemberSlow`; without one it is waited for, up to ``max_wait``)."""
        url = m.url + path + (f"?{params}" if params else "")
        deadline = timeout or self.pool.timeout
        m.inflight += 1
        self.inflight += 1
        t0 = time.perf_counter()
        try:
            call = self.pool.request(method, url, content=content, headers=headers, max_body=self.max_reply,
                                     timeout=deadline if m.static else max(deadline, self.max_wait))
            r = await (call if m.static else self._unless_silent(m, call, deadline, elsewhere))
        except MemberSlow:
            raise
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

    async def _unless_silent(self, m: Member, call, deadline: float, elsewhere: bool) -> Reply:
        """``call``'s reply, unless the member stops heartbeating first (frozen: SIGSTOP, a hung host):
        then it is failed at the registry's eviction age, not after the whole hop timeout (12-17 s of
        stalled generation). A member computing a long request still heartbeats from its event loop,
        and is waited for past ``deadline`` (or, ``elsewhere``, left for another replica unblamed)."""
        task = asyncio.ensure_future(call)
        reg = self.registry
        t0 = time.monotonic()
        late = False
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=min(0.5, reg.heartbeat_interval / 2))
                if done:
                    return task.result()
                silent = reg.silence(m)
                if silent > reg.evict_after:
                    raise MemberSilent(f"no heartbeat for {silent:.1f} s")
                waited = time.monotonic() - t0
                if waited > deadline and not late:
                    late = True
                    self.slow += 1
                    if self.metrics is not None:
                        self.metrics.slow.labels(m.capability, "moved" if elsewhere else "waited").inc()
                    if elsewhere:
                        log.info("member %s (%s) is past its %.1f s deadline but heartbeating: trying another "
                                 "replica (not a failure)", m.url, m.capability, deadline)
                        raise MemberSlow(m, f"{m.url}: no reply within {deadline:.1f} s (alive; not failed)")
                    log.info("member %s (%s) is past its %.1f s deadline but heartbeating: still waiting "
                             "(no other replica)", m.url, m.capability, deadline)
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


