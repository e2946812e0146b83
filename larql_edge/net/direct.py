"""The direct data path: each layer's FFN request goes straight to a shard serving it.

The routers stay the control plane and the fallback: the client learns which live shard serves
which layers from a router's ``GET /v1/topology`` (`larql_edge.wire.grid.Topology`), asks again
every ``refresh_s`` (the grid's heartbeat interval) and at once after a direct request failed, and
lists the routers after the shards for every layer, so a failed shard costs one attempt and the
request goes on through a router, which re-routes it to another replica.

A shard that failed stays out of the direct path for a cooldown that grows while it keeps
failing (the router may list it a little longer, until it notices). A URL given on the command
line that does not answer ``/v1/topology`` as a router (a shard serving every layer, or an older
router) is simply used as it is.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

from larql_edge.errors import LarqlError
from larql_edge.net.h1 import TransportError
from larql_edge.net.h1_sync import HttpClient
from larql_edge.net.hops import Hop, HopLog, server_seconds
from larql_edge.wire.grid import TOPOLOGY, Target, Topology

log = logging.getLogger("larql.net")

COOLDOWN_FIRST_S = 2.0
COOLDOWN_MAX_S = 60.0
EMA = 0.2


class DirectPath:
    def __init__(self, client: HttpClient, targets: Sequence[Target], num_layers: int, enabled: bool = True,
                 clock: Callable[[], float] = time.monotonic):
        self.client, self.targets, self.num_layers, self.clock = client, list(targets), num_layers, clock
        self.routers = [t.url for t in targets if t.layers is None] if enabled else []
        self.topology: Topology | None = None
        self.next_refresh = 0.0
        self.refreshes = 0
        self._down: dict[str, tuple[float, int]] = {}  # url -> (until, consecutive failures)
        self.ema: dict[str, float] = {}  # url -> seconds a hop took (moving average)
        self._fallback = {layer: [t.url for t in self.targets if t.serves(layer)] for layer in range(num_layers)}
        self._direct: dict[int, list[str]] = {}
        self.hops: HopLog | None = None  # a refresh is a hop of the token that makes it (tier "topology")

    @property
    def enabled(self) -> bool:
        return bool(self.routers)

    def _live(self, urls) -> list[str]:
        if self.routers and self.clock() >= self.next_refresh:
            self.refresh()
        now = self.clock()
        out = [u for u in urls() if self._down.get(u, (0.0, 0))[0] <= now]
        out.sort(key=lambda u: self.ema.get(u, 0.0))  # one never tried goes first: it gets measured
        return out

    def urls(self, layer: int) -> tuple[list[str], list[str]]:
        """(the live shards serving ``layer``, fastest first; the command line's targets for it)."""
        return self._live(lambda: self._direct.get(layer, ())), self._fallback.get(layer, [])

    def embed_urls(self, fallback: Sequence[str]) -> list[str]:
        """The live embed servers, fastest first, then ``fallback`` (the routers, which proxy one)."""
        direct = self._live(lambda: self.topology.embed if self.topology is not None else ())
        return direct + [u for u in fallback if u not in direct]

    def refresh(self) -> None:
        self.refreshes += 1
        for url in list(self.routers):
            t0 = time.perf_counter()
            try:
                r = self.client.request("GET", url + TOPOLOGY, max_body=1 << 20)
            except TransportError:
                continue
            if self.hops is not None:
                self.hops.add(Hop("topology", None, url, time.perf_counter() - t0, server_seconds(r)))
            if r.status_code in (404, 405):  # not a router (a shard serving every layer), or an older one
                self.routers.remove(url)
                continue
            try:
                topo = Topology.from_json(r.json()) if r.status_code == 200 else None
            except (ValueError, LarqlError):
                topo = None
            if topo is None:
                continue
            if self.topology is None or topo.version != self.topology.version:
                log.info("topology %s: %d shards", topo.version, len(topo.shards))
            self.topology = topo
            self._direct = {layer: [t.url for t in topo.shards if t.serves(layer)] for layer in range(self.num_layers)}
            self.next_refresh = self.clock() + topo.refresh_s
            return
        # No router answered: keep what we knew, and ask again soon (the fallback still works).
        self.next_refresh = self.clock() + COOLDOWN_FIRST_S

    def is_direct(self, url: str) -> bool:
        t = self.topology
        return t is not None and (url in t.embed or any(s.url == url for s in t.shards))

    def succeeded(self, url: str, seconds: float) -> None:
        self._down.pop(url, None)
        prev = self.ema.get(url)
        self.ema[url] = seconds if prev is None else prev + EMA * (seconds - prev)

    def late(self, url: str, seconds: float) -> None:
        """A request that lost a hedge (or stalled) took this long: it counts against its shard's speed,
        and the shard is ranked behind every other one known. Its elapsed time alone is not enough:
        on a loaded host the winner's moving average can still hold older, slower hops, and the
        loser would stay first for several more hedged hops."""
        prev = self.ema.get(url, seconds)
        others = max((v for u, v in self.ema.items() if u != url), default=0.0)
        self.ema[url] = max(prev, seconds, others * 1.01)

    def failed(self, url: str) -> None:
        if not self.is_direct(url):
            return
        _, n = self._down.get(url, (0.0, 0))
        self._down[url] = (self.clock() + min(COOLDOWN_FIRST_S * 2**n, COOLDOWN_MAX_S), n + 1)
        self.next_refresh = 0.0  # the topology may have changed: ask at the next hop
