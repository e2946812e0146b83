"""Membership of any role (FFN shard, embed server) in a grid: join the router, then heartbeat.

A role calls `install_membership` on its Sanic app; after the server starts, a background task
joins the router with the grid key as a bearer token and sends a heartbeat every interval the
router asks for. The task never gives up: when the router is down it keeps trying, and when the
router answers a heartbeat with 404 (it restarted, or evicted us) the member simply joins again,
so a router restart needs no member restart. On a clean stop the member leaves.

The grid key is only ever put in the Authorization header; it is never logged or shown.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from typing import Any

import httpx
from sanic import Sanic

from larql_edge.config import Flags
from larql_edge.service.identity import rss_bytes
from larql_edge.wire.grid import HEARTBEAT, JOIN, LEAVE, check_url

log = logging.getLogger("larql.grid")

# Backoff while the router is unreachable: quick first retries (a router restart takes ~1 s),
# capped so a long outage costs one small request every few seconds.
RETRY_FIRST_S = 0.2
RETRY_MAX_S = 3.0
REFUSED_RETRY_S = 10.0  # a refused key will not start working soon; don't hammer the router
NOT_READY_POLL_S = 0.2


def add_membership_flags(flags: Flags) -> None:
    """``--join``, ``--grid-key`` (secret), ``--public-url``, each with its LARQL_ env twin."""
    flags.add("--join", default=None, metavar="ROUTER_URL", help="register with this router (larql-router)")
    flags.add("--grid-key", default=None, secret=True, metavar="KEY", help="the grid's shared key (with --join)")
    flags.add("--public-url", default=None, metavar="URL",
              help="URL the router and clients reach this server at (default: http://HOST:PORT)")


def default_public_url(host: str, port: int) -> str:
    h = host if host not in ("", "0.0.0.0", "::") else "127.0.0.1"
    if ":" in h and not h.startswith("["):
        h = f"[{h}]"
    return f"http://{h}:{port}"


def membership_settings(args: Any, host: str, port: int) -> dict | None:
    """Checked membership settings from parsed flags, or None when ``--join`` is not given.

    Raises ValueError with a message safe to print (it never contains the key).
    """
    router = getattr(args, "join", None)
    if not router:
        return None
    key = getattr(args, "grid_key", None)
    if not key:
        raise ValueError("--join needs --grid-key (or LARQL_GRID_KEY)")
    public = getattr(args, "public_url", None) or default_public_url(host, port)
    try:
        check_url(router)
        public = check_url(public)
    except ValueError as e:
        raise ValueError(str(e).replace('"public_url"', "the URL")) from None
    return {"router_url": router.rstrip("/"), "grid_key": key, "public_url": public}


class Membership:
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
        self.interval = 1.0
        self.joins = 0
        self._stop = asyncio.Event()
        self._client: httpx.AsyncClient | None = None
        self._warned = False

    def _body(self) -> dict:
        d = dict(self.describe())
        d.update(capability=self.capability, public_url=self.public_url, rss_bytes=rss_bytes(), pid=os.getpid())
        return d

    async def _post(self, path: str, body: dict) -> httpx.Response:
        assert self._client is not None
        return await self._client.post(self.router + path, json=body, headers=self._auth)

    async def join(self) -> bool:
        r = await self._post(JOIN, self._body())
        if r.status_code == 200:
            reply = r.json()
            self.member_id = str(reply["member_id"])
            self.interval = max(0.05, float(reply.get("heartbeat_interval_s", 1.0)))
            self.joins += 1
            self._warned = False
            log.info("joined the grid at %s as %s (%s, %s)", self.router, self.member_id, self.capability, self.public_url)
            return True
        if r.status_code == 401:
            log.error("the router at %s refused the grid key (401); check --grid-key", self.router)
            raise _Refused
        log.error("the router at %s refused the join: %s %s", self.router, r.status_code, _error_text(r))
        return False

    async def heartbeat(self) -> None:
        d = self._body()
        load = {k: d[k] for k in ("inflight", "layer_latency_ms", "rss_bytes") if k in d}
        r = await self._post(HEARTBEAT, {"member_id": self.member_id, **load})
        if r.status_code == 404:
            log.warning("the router at %s no longer knows this member; joining again", self.router)
            self.member_id = None
        elif r.status_code == 401:
            self.member_id = None
            raise _Refused
        elif r.status_code != 200:
            log.warning("heartbeat refused: %s %s", r.status_code, _error_text(r))

    async def run(self) -> None:
        self._client = httpx.AsyncClient(timeout=self.timeout)
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
                        await self.heartbeat()
                        wait = self.interval if self.member_id else 0.0
                    delay = RETRY_FIRST_S
                except _Refused:
                    wait = REFUSED_RETRY_S
                except (httpx.HTTPError, ValueError, KeyError) as e:
                    if not self._warned:
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
            await self._client.post(self.router + LEAVE, json={"member_id": self.member_id},
                                    headers=self._auth, timeout=1.0)
        except httpx.HTTPError:
            pass  # eviction covers a router we cannot reach
        self.member_id = None

    def stop(self) -> None:
        self._stop.set()


class _Refused(Exception):
    pass


def _error_text(r: httpx.Response) -> str:
    try:
        return str(r.json().get("error", ""))[:200]
    except ValueError:
        return ""


def install_membership(app: Sanic, router_url: str | None, grid_key: str | None, public_url: str,
                       capability: str, describe_fn: Callable[[], dict],
                       ready_fn: Callable[[], bool] | None = None) -> Membership | None:
    """Join ``router_url`` after the server starts, heartbeat while it runs, leave when it stops.

    ``describe_fn()`` returns the announcement fields (``model``, ``num_layers``, ``hidden_size``,
    ``layer_start``/``layer_end`` for FFN, ``vindex_hash``) and the current load (``inflight``,
    ``layer_latency_ms``); it is called for every join and heartbeat. Capability, public URL and
    RSS are added here. ``ready_fn()``, when given, gates the join: a role that loads after it
    listens (the embed server) joins only once it can answer. Does nothing (returns None) when
    ``router_url`` is empty. With several Sanic workers, install it in one worker only: members
    are told apart by their public URL, so two workers would keep replacing each other.
    """
    if not router_url:
        return None
    if not grid_key:
        raise ValueError("joining a grid needs the grid key")
    member = Membership(router_url, grid_key, public_url, capability, describe_fn, ready_fn=ready_fn)
    app.ctx.membership = member

    @app.after_server_start
    async def _start_membership(app, _loop=None):
        app.ctx.membership_task = asyncio.get_running_loop().create_task(member.run())

    @app.before_server_stop
    async def _stop_membership(app, _loop=None):
        member.stop()
        task = getattr(app.ctx, "membership_task", None)
        if task is not None:
            try:
                await asyncio.wait_for(task, timeout=2.0)
            except (asyncio.TimeoutError, asyncio.CancelledError):
                task.cancel()

    return member
