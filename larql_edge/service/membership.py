"""Membership of any role (FFN shard, embed server) in a grid: join every router, then heartbeat.

A role calls `install_membership` on its Sanic app. After the server starts, a background task
joins each router with the grid key as a bearer token and heartbeats at the interval the router
asks for. The routers are ``--join``'s URLs; a URL whose host name resolves to several addresses
(a Kubernetes headless Service, a Swarm ``dnsrr`` service) counts as every one of them, and names
are resolved again every `RESOLVE_S` seconds, so a router replica that appears later is joined too.
Routers do not talk to each other: every member joining every router is what keeps their views of
the grid equal, and what lets a client fail over from one router to another.

No loop ever gives up: while a router is down it retries with backoff; when a router answers a
heartbeat with 404 (it restarted, or evicted us) the member joins again, so a router restart needs
no member restart. ``POST /v1/membership/leave`` (grid key required; what a Kubernetes preStop hook
calls) makes the member leave every router and drain (``/v1/ready`` answers 503). A clean stop
leaves too. The grid key only ever goes into the Authorization header: never logged, never shown.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import httpx
from sanic import Sanic
from sanic.request import Request
from sanic.response import HTTPResponse, json

from larql_edge.config import Flags
from larql_edge.errors import LarqlError, ProtocolError, Unauthorized
from larql_edge.format.layers import LayerRange
from larql_edge.net.tls import client_context, verify_name
from larql_edge.service.identity import rss_bytes
from larql_edge.wire.grid import HEARTBEAT, JOIN, LEAVE, check_url

log = logging.getLogger("larql.grid")

# Backoff while a router is unreachable: quick first retries (a router restart takes ~1 s),
# capped so a long outage costs one small request every few seconds.
RETRY_FIRST_S = 0.2
RETRY_MAX_S = 3.0
REFUSED_RETRY_S = 10.0  # a refused key will not start working soon; don't hammer the router
NOT_READY_POLL_S = 0.2
HANDOVER_POLL_S = 0.5
RESOLVE_S = 5.0
# A join's reply comes only after the router has probed this member back (two requests of up to 5 s
# each, router.grid_routes.PROBE_TIMEOUT_S): with 0.75 s one way, a 3 s wait gave up on every join.
JOIN_TIMEOUT_S = 20.0
LEAVE_PATH = "/v1/membership/leave"


def add_membership_flags(flags: Flags) -> None:
    """``--join``, ``--grid-key`` (secret, with ``--grid-key-file``), ``--public-url``."""
    flags.add("--join", default=None, metavar="ROUTER_URL",
              help="register with these routers (comma-separated; a name resolving to several addresses is all of them)")
    flags.add("--grid-key", default=None, secret=True, metavar="KEY", help="the grid's shared key (with --join)")
    flags.add("--public-url", default=None, metavar="URL",
              help="URL the routers and clients reach this server at (default: http://HOST:PORT)")
    flags.add("--handover-seconds", type=float, default=0.0, metavar="S",
              help="on SIGTERM, stay in the routers up to S seconds until a successor serving the same layers "
                   "has joined them (rolling updates that start the new task first), then leave and drain")


def default_public_url(host: str, port: int, tls: bool = False) -> str:
    h = host if host not in ("", "0.0.0.0", "::") else "127.0.0.1"
    if ":" in h and not h.startswith("["):
        h = f"[{h}]"
    return f"{'https' if tls else 'http'}://{h}:{port}"


@dataclass(frozen=True, repr=False)
class GridSettings:
    routers: tuple[str, ...]
    grid_key: str
    public_url: str
    handover: float = 0.0

    def __repr__(self) -> str:  # never print the key
        return f"GridSettings(routers={self.routers!r}, public_url={self.public_url!r}, grid_key=***)"


def membership_settings(args: Any, host: str, port: int) -> GridSettings | None:
    """Checked membership settings from parsed flags, or None without ``--join``.

    Raises ProtocolError with a message safe to print (it never holds the key).
    """
    join = getattr(args, "join", None)
    if not join:
        return None
    key = getattr(args, "grid_key", None)
    if not key:
        raise ProtocolError("--join needs --grid-key (or --grid-key-file, LARQL_GRID_KEY, LARQL_GRID_KEY_FILE)")
    routers = tuple(check_url(u.strip(), "--join") for u in join.split(",") if u.strip())
    if not routers:
        raise ProtocolError("--join names no router URL")
    tls = bool(getattr(args, "tls_cert", None))
    public = check_url(getattr(args, "public_url", None) or default_public_url(host, port, tls), "--public-url")
    handover = float(getattr(args, "handover_seconds", 0.0) or 0.0)
    if handover < 0:
        raise ProtocolError("--handover-seconds must be 0 or more")
    return GridSettings(routers=routers, grid_key=key, public_url=public, handover=handover)


# An address-URL `expand_router_urls` made -> the name it came from: over https the router's
# certificate is checked against that name (and sent as SNI), not against the address.
SERVER_NAMES: dict[str, str] = {}


def expand_router_urls(urls: tuple[str, ...]) -> list[str]:
    """Every router address the URLs name: a host resolving to several addresses is each of them.

    A name that does not resolve (yet) is kept as it is: its membership loop retries, and the
    next resolution may find it.
    """
    out: list[str] = []
    for url in urls:
        u = urlsplit(url)
        host, port = u.hostname or "", u.port or (443 if u.scheme == "https" else 80)
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
            addrs = sorted({str(i[4][0]) for i in infos})
        except OSError:
            addrs = []
        if len(addrs) <= 1:
            out.append(url)
            continue
        for a in addrs:
            netloc = f"[{a}]:{port}" if ":" in a else f"{a}:{port}"
            out.append(urlunsplit((u.scheme, netloc, u.path, "", "")))
            SERVER_NAMES[out[-1].rstrip("/")] = host
    return list(dict.fromkeys(out))


class RouterLink:
    """Membership with one router: join, heartbeat, join again when forgotten, leave at the end."""

    def __init__(self, router_url: str, grid_key: str, public_url: str, capability: str,
                 describe_fn: Callable[[], dict], timeout: float = 3.0,
                 ready_fn: Callable[[], bool] | None = None):
        self.router = router_url.rstrip("/")
        self._auth = {"Authorization": f"Bearer {grid_key}"}
        self.public_url = public_url
        self.capability = capability
        self.describe = describe_fn
        self.ready = ready_fn
        self.timeout = timeout
        self.member_id: str | None = None
        self.member_token: str | None = None
        self.interval = 1.0
        self.joins = 0
        self._stop = asyncio.Event()
        self._client: httpx.AsyncClient | None = None
        self._warned = False

    def _body(self) -> dict:
        d = dict(self.describe())
        d.update(capability=self.capability, public_url=self.public_url, rss_bytes=rss_bytes(), pid=os.getpid())
        return d

    def _credentials(self) -> dict:
        out: dict[str, str] = {"member_id": self.member_id or ""}
        if self.member_token:
            out["member_token"] = self.member_token
        return out

    @property
    def _extensions(self) -> dict:
        return _tls_extensions(self.router)

    async def _post(self, path: str, body: dict, timeout: float | None = None) -> httpx.Response:
        assert self._client is not None
        return await self._client.post(self.router + path, json=body, headers=self._auth, extensions=self._extensions,
                                       timeout=timeout if timeout is not None else self.timeout)

    async def join(self) -> bool:
        r = await self._post(JOIN, self._body(), timeout=max(self.timeout, JOIN_TIMEOUT_S))
        if r.status_code == 200:
            reply = r.json()
            self.member_id = str(reply["member_id"])
            token = reply.get("member_token")
            self.member_token = str(token) if token else None
            self.interval = max(0.05, float(reply.get("heartbeat_interval_s", 1.0)))
            self.joins += 1
            self._warned = False
            log.info("joined the grid at %s as %s (%s, %s)", self.router, self.member_id, self.capability, self.public_url)
            return True
        if r.status_code == 401:
            log.error("the router at %s refused the grid key (401); check --grid-key", self.router)
            raise _Refused
        if r.status_code == 409 and "already has the URL" in _error_text(r):
            # Our previous life's entry: it is evicted soon, then the next join goes through.
            log.warning("the router at %s still holds this URL from an earlier join; retrying", self.router)
            raise _Busy
        if r.status_code == 400 and "cannot reach" in _error_text(r):
            # Usually our name is not in the orchestrator's DNS yet (Swarm and Kubernetes publish a
            # task's name once it is healthy): soon fixed, so retried at the heartbeat interval.
            if not self._warned:
                log.warning("the router at %s cannot reach us yet: %s; retrying", self.router, _error_text(r))
                self._warned = True
            raise _Busy
        log.error("the router at %s refused the join: %s %s", self.router, r.status_code, _error_text(r))
        return False

    async def heartbeat(self) -> None:
        d = self._body()
        load = {k: d[k] for k in ("inflight", "layer_latency_ms", "rss_bytes") if k in d}
        r = await self._post(HEARTBEAT, {**self._credentials(), **load})
        if r.status_code in (403, 404):  # forgotten (404), or another member now holds this id (403)
            log.warning("the router at %s no longer knows this member; joining again", self.router)
            self.member_id = self.member_token = None
        elif r.status_code == 401:
            self.member_id = self.member_token = None
            raise _Refused
        elif r.status_code != 200:
            log.warning("heartbeat refused: %s %s", r.status_code, _error_text(r))

    async def run(self) -> None:
        self._client = httpx.AsyncClient(timeout=self.timeout, verify=client_context())
        loop = asyncio.get_running_loop()
        delay = RETRY_FIRST_S
        try:
            while not self._stop.is_set():
                try:
                    if self.member_id is None and self.ready is not None and not self.ready():
                        wait = NOT_READY_POLL_S  # join only once requests can be served
                    elif self.member_id is None:
                        ok = await self.join()
                        wait = self.interval if ok else REFUSED_RETRY_S
                    else:
                        # On the router's cadence from when this one was sent, not after its reply:
                        # a slow reply (a busy router or host) must not stretch the gap between two
                        # heartbeats towards the eviction age.
                        sent = loop.time()
                        await self.heartbeat()
                        wait = max(0.0, self.interval - (loop.time() - sent)) if self.member_id else 0.0
                    delay = RETRY_FIRST_S
                except _Refused:
                    wait = REFUSED_RETRY_S
                except _Busy:
                    wait = self.interval
                except (httpx.HTTPError, ValueError, KeyError, TypeError) as e:
                    if not self._warned:
                        if isinstance(e, httpx.TimeoutException) and not isinstance(e, httpx.ConnectTimeout):
                            log.warning("router %s took too long to answer (%s); retrying", self.router, type(e).__name__)
                        else:
                            log.warning("router %s unreachable (%s); retrying", self.router, type(e).__name__)
                        self._warned = True
                    wait, delay = delay, min(delay * 2, RETRY_MAX_S)
                try:
                    await asyncio.wait_for(self._stop.wait(), timeout=wait)
                except asyncio.TimeoutError:
                    pass
        finally:
            await self._leave()
            await self._client.aclose()

    async def _leave(self) -> None:
        if self.member_id is None or self._client is None:
            return
        try:
            await self._client.post(self.router + LEAVE, json=self._credentials(), headers=self._auth, timeout=1.0,
                                    extensions=self._extensions)
        except httpx.HTTPError:
            pass  # eviction covers a router we cannot reach
        self.member_id = self.member_token = None

    def stop(self) -> None:
        self._stop.set()


class Membership:
    """A member's links to every router of the grid, kept in step with what the names resolve to."""

    def __init__(self, settings: GridSettings, capability: str, describe_fn: Callable[[], dict],
                 ready_fn: Callable[[], bool] | None = None, resolve: Callable[[tuple[str, ...]], list[str]] = expand_router_urls):
        self.settings = settings
        self.capability = capability
        self.describe = describe_fn
        self.ready = ready_fn
        self.resolve = resolve
        self.links: dict[str, tuple[RouterLink, asyncio.Task]] = {}
        self._stop = asyncio.Event()

    @property
    def member_ids(self) -> dict[str, str | None]:
        return {url: link.member_id for url, (link, _) in self.links.items()}

    async def handover(self) -> None:
        """Before leaving on SIGTERM (``--handover-seconds``): stay in the routers until each one lists,
        for every layer of ours, as many live members besides this one as it listed with this one (the
        successor an orchestrator started first has joined), for at most the handover time.

        Why: an orchestrator marks a new task healthy when it serves, and stops the old one then; the
        new one joins the routers only after that (Swarm and Kubernetes publish its DNS name, which
        the routers' join probe needs, only once it is healthy). Leaving at once would leave the
        range one replica short meanwhile, and uncovered if the other replica stalls. A router that
        does not answer is not waited for; without a successor (a scale-down) this costs the bound."""
        limit = self.settings.handover
        if limit <= 0 or not self.links:
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + limit
        mine = self.describe()
        me = self.settings.public_url.rstrip("/")
        routers = list(self.links)
        async with httpx.AsyncClient(timeout=2.0, verify=client_context()) as c:
            async def replicas(url: str) -> tuple[int, int] | None:
                try:
                    r = await c.get(url + "/v1/grid", extensions=_tls_extensions(url))
                    return _replicas_besides(r.json(), self.capability, mine, me)
                except (httpx.HTTPError, LarqlError, ValueError, KeyError, TypeError, AttributeError):
                    return None

            start = dict(zip(routers, await asyncio.gather(*(replicas(u) for u in routers)), strict=True))
            # what each router must list besides us: its count with us (we are not listed: nothing to wait for)
            want = {u: others + listed for u, v in start.items() if v is not None for others, listed in [v]}
            while True:
                now = dict(zip(want, await asyncio.gather(*(replicas(u) for u in want)), strict=True))
                short = {u: (v[0] if v else None, want[u]) for u, v in now.items() if v is not None and v[0] < want[u]}
                if not short:
                    log.info("handover: every router lists a successor; leaving")
                    return
                if loop.time() >= deadline:
                    log.warning("handover: no successor after %.0f s (%s); leaving anyway", limit,
                                ", ".join(f"{u}: {have} of {need} besides us" for u, (have, need) in short.items()))
                    return
                await asyncio.sleep(HANDOVER_POLL_S)

    def _start(self, url: str) -> None:
        s = self.settings
        link = RouterLink(url, s.grid_key, s.public_url, self.capability, self.describe, ready_fn=self.ready)
        self.links[url] = (link, asyncio.get_running_loop().create_task(link.run()))

    async def _drop(self, url: str) -> None:
        link, task = self.links.pop(url)
        link.stop()
        try:
            await asyncio.wait_for(task, timeout=2.0)
        except (asyncio.TimeoutError, asyncio.CancelledError):
            task.cancel()

    async def run(self) -> None:
        try:
            while not self._stop.is_set():
                wanted = await asyncio.get_running_loop().run_in_executor(None, self.resolve, self.settings.routers)
                for url in wanted:
                    if url not in self.links:
                        self._start(url)
                for url in [u for u in self.links if u not in wanted]:
                    await self._drop(url)
                try:
                    await asyncio.wait_for(self._stop.wait(), timeout=RESOLVE_S)
                except asyncio.TimeoutError:
                    pass
        finally:
            await asyncio.gather(*(self._drop(u) for u in list(self.links)), return_exceptions=True)

    def stop(self) -> None:
        self._stop.set()


class _Refused(Exception):
    """Control flow inside a link's loop: the router refused our key."""


class _Busy(Exception):
    """Control flow inside a link's loop: the router still has our URL from an earlier join."""


def _tls_extensions(router: str) -> dict:
    """Over https a router is verified under the name its address came from, or --tls-server-name."""
    if not router.startswith("https:"):
        return {}
    host = urlsplit(router).hostname or ""
    name = verify_name(SERVER_NAMES.get(router, host))
    return {"sni_hostname": name} if name != host else {}


def _replicas_besides(view: dict, capability: str, mine: dict, me: str) -> tuple[int, int]:
    """From a router's /v1/grid: (live members other than ``me`` that answer what this member answers,
    fewest over its layers; 1 if ``me`` is listed live, else 0)."""
    def layers_of(m: dict) -> LayerRange | None:
        text = m.get("layers")
        return None if capability != "ffn" or text in (None, "all") else LayerRange.parse(str(text))

    live = [m for m in view["members"] if m.get("capability") == capability and m.get("live")]
    listed = int(any(m["url"].rstrip("/") == me for m in live))
    others = [m for m in live if m["url"].rstrip("/") != me]
    start, end = mine.get("layer_start"), mine.get("layer_end")
    if capability != "ffn" or start is None or end is None:
        return len(others), listed
    spans = [layers_of(m) for m in others]
    count = min(sum(1 for sp in spans if sp is None or layer in sp) for layer in range(start, end + 1))
    return count, listed


def _error_text(r: httpx.Response) -> str:
    try:
        return str(r.json().get("error", ""))[:200]
    except ValueError:
        return ""


def install_membership(app: Sanic, settings: GridSettings | None, capability: str,
                       describe_fn: Callable[[], dict], ready_fn: Callable[[], bool] | None = None) -> Membership | None:
    """Join the grid after the server starts, heartbeat while it runs, leave when it stops or drains.

    ``describe_fn()`` returns the announcement fields (``model``, ``num_layers``, ``hidden_size``,
    ``layer_start``/``layer_end`` for FFN, ``vindex_hash``) and the current load (``inflight``,
    ``layer_latency_ms``); it is called for every join and heartbeat. Capability, public URL and
    RSS are added here. ``ready_fn()``, when given, gates the join: a role that loads after it
    listens (the embed server) joins only once it can answer. Does nothing without settings. With
    several Sanic workers, install it in one worker only: members are told apart by public URL.
    """
    if settings is None:
        return None
    member = Membership(settings, capability, describe_fn, ready_fn=ready_fn)
    app.ctx.membership = member
    key = settings.grid_key.encode()

    async def leave(request: Request) -> HTTPResponse:
        scheme, _, token = (request.headers.get("authorization") or "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key):
            raise Unauthorized("grid key refused")
        request.app.ctx.draining = True
        routers = len(member.links)
        member.stop()
        task = getattr(request.app.ctx, "membership_task", None)
        if task is not None:
            await asyncio.wait_for(asyncio.shield(task), timeout=5.0)
        log.info("left %d router(s) on request; draining", routers)
        return json({"left": routers, "draining": True})

    app.add_route(leave, LEAVE_PATH, methods=["POST"], name="membership_leave")

    @app.after_server_start
    async def _start_membership(app):
        app.ctx.membership_task = asyncio.get_running_loop().create_task(member.run())

    @app.before_server_stop
    async def _stop_membership(app):
        member.stop()
        task = getattr(app.ctx, "membership_task", None)
        if task is not None:
            try:
                await asyncio.wait_for(task, timeout=3.0)
            except (asyncio.TimeoutError, asyncio.CancelledError):
                task.cancel()

    return member
