"""The router's view of the grid: members, their liveness and load, and which one serves a layer.

Members come two ways: they join over HTTP and heartbeat (evicted when heartbeats stop), or they
are static (``--shards`` / ``--embed`` flags; probed, never evicted). A request that fails against
a member puts it in a short, growing cooldown so the next requests go to other replicas at once,
without waiting for the eviction deadline.
"""

from __future__ import annotations

import hashlib
import hmac
import itertools
import secrets
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from larql_edge.errors import Conflict, Forbidden
from larql_edge.format.layers import LayerRange, gaps
from larql_edge.wire.grid import Announce, Load, Target, Topology


def model_facts(stats: dict) -> dict[str, str | int]:
    """The MODEL_FACTS of a member's /v1/stats reply (anything malformed is left out)."""
    out: dict[str, str | int] = {}
    for k in MODEL_FACTS:
        v = stats.get(k)
        if isinstance(v, str) and 0 < len(v) <= 64 or isinstance(v, int) and not isinstance(v, bool) and v > 0:
            out[k] = v
    return out


def _hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


COOLDOWN_FIRST_S = 0.5
COOLDOWN_MAX_S = 8.0
EMA = 0.2
# Model facts a member's /v1/stats reports that LARQL's client reads from a remote's /v1/stats
# (besides hidden_size): the router learns them at the join probe and reports them as the grid's.
MODEL_FACTS = ("family", "vocab_size", "intermediate_size")


@dataclass
class Member:
    id: str
    capability: str  # "ffn" | "embed"
    url: str
    static: bool = False
    model: str = ""
    num_layers: int | None = None
    hidden_size: int | None = None
    layers: LayerRange | None = None  # None on an FFN member: every layer (a static full shard)
    vindex_hash: str = ""
    joined_at: float = 0.0
    last_seen: float = 0.0
    reported_inflight: int = 0
    rss_bytes: int = 0
    layer_latency_ms: dict[int, float] = field(default_factory=dict)
    # What the router itself observes.
    inflight: int = 0
    inflight_work: int = 0  # rows x layers of the walks in flight to it (their replies' wait, walk._post)
    requests: int = 0
    failures: int = 0
    consecutive_failures: int = 0
    down_until: float = 0.0
    rtt_ms: float | None = None
    facts: dict[str, str | int] = field(default_factory=dict)  # MODEL_FACTS the member's stats reported
    token_hash: str = field(default="", repr=False)  # sha256 of the member token (never the token)

    def serves(self, layer: int) -> bool:
        if self.capability != "ffn":
            return False
        if self.layers is None:
            return self.num_layers is None or layer < self.num_layers
        return layer in self.layers

    def available(self, now: float) -> bool:
        return now >= self.down_until

    def cost(self, layer: int | None) -> tuple[float, float]:
        """Lower is better: outstanding work first, then the expected time of one request."""
        load = self.inflight + self.reported_inflight
        est = self.rtt_ms if self.rtt_ms is not None else self.layer_latency_ms.get(layer, 0.0) if layer is not None else 0.0
        return (float(load), est)

    def view(self, now: float) -> dict:
        return {
            "id": self.id,
            "capability": self.capability,
            "url": self.url,
            "static": self.static,
            "model": self.model,
            "layers": str(self.layers) if self.layers is not None else ("all" if self.capability == "ffn" else None),
            "vindex_hash": self.vindex_hash,
            "live": self.available(now),
            "last_seen_s": round(now - self.last_seen, 2) if self.last_seen else None,
            "inflight": self.inflight,
            "reported_inflight": self.reported_inflight,
            "rss_mb": round(self.rss_bytes / 2**20, 1) if self.rss_bytes else None,
            "requests": self.requests,
            "failures": self.failures,
            "rtt_ms": round(self.rtt_ms, 3) if self.rtt_ms is not None else None,
            "layer_latency_ms": {str(k): v for k, v in sorted(self.layer_latency_ms.items())},
        }


def _same_slot(a: Announce, m: "Member") -> bool:
    """Would ``a`` answer what ``m`` answers: FFN members with overlapping layers, or two embed members."""
    if a.capability != m.capability:
        return False
    if a.capability != "ffn":
        return True
    if a.layer_start is None or a.layer_end is None or m.layers is None:
        return True  # a member serving every layer overlaps every range
    return a.layer_start <= m.layers.end and m.layers.start <= a.layer_end


class Registry:
    def __init__(self, heartbeat_interval: float = 2.0, evict_after: float | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.heartbeat_interval = heartbeat_interval
        self.evict_after = evict_after if evict_after is not None else 3 * heartbeat_interval
        self.clock = clock
        self.members: dict[str, Member] = {}
        self._rr = itertools.count()  # breaks ties between equally good replicas in turn

    # -- membership ------------------------------------------------------------------------------
    def add_static(self, capability: str, url: str, layers: LayerRange | None = None) -> Member:
        m = Member(id=f"static-{capability}-{len(self.members)}", capability=capability, url=url.rstrip("/"),
                   static=True, layers=layers, joined_at=self.clock())
        self.members[m.id] = m
        return m

    def _check_fits(self, a: Announce, ignore: str | None) -> None:
        for m in self.members.values():
            if m.id == ignore or not m.model:
                continue
            if m.model != a.model:
                raise Conflict(f"this grid serves model {m.model!r}; the member announced {a.model!r}")
            if a.hidden_size and m.hidden_size and a.hidden_size != m.hidden_size:
                raise Conflict(f"hidden size {a.hidden_size} does not match the grid's {m.hidden_size}")
            if a.num_layers and m.num_layers and a.num_layers != m.num_layers:
                raise Conflict(f"num_layers {a.num_layers} does not match the grid's {m.num_layers}")
            if a.vindex_hash and m.vindex_hash and a.vindex_hash != m.vindex_hash and _same_slot(a, m):
                # One model identity: replicas answer interchangeably, so they must hold the same
                # files (a q4k build beside f16 ones gives a different text for the same request).
                what = f"layers {a.layer_start}-{a.layer_end}" if a.capability == "ffn" else "the embed tier"
                raise Conflict(f"the member serves vindex {a.vindex_hash} for {what}, but {m.url} serves vindex "
                               f"{m.vindex_hash} there: replicas must serve the same files (same dtype, quantization "
                               f"and extraction); stop the other build's members first")

    def check_join(self, a: Announce) -> None:
        """Refuse a member that does not fit the grid, or that claims a URL a live member has (a key
        holder must not be able to replace a member; a restarted one rejoins once its old entry is
        evicted, ``evict_after`` seconds after its last heartbeat)."""
        if any(m.url == a.public_url for m in self.members.values()):
            raise Conflict(f"a live member already has the URL {a.public_url}: a member that restarted rejoins "
                           f"once its old entry is evicted ({self.evict_after:g} s without heartbeats)")
        self._check_fits(a, ignore=None)

    def join(self, a: Announce, facts: dict[str, str | int] | None = None) -> tuple[Member, str]:
        """Add a member; returns it and its token (what its heartbeats and leave must present)."""
        self.check_join(a)
        now = self.clock()
        token = secrets.token_urlsafe(24)
        m = Member(
            id=secrets.token_hex(8), capability=a.capability, url=a.public_url, model=a.model,
            num_layers=a.num_layers, hidden_size=a.hidden_size, vindex_hash=a.vindex_hash,
            layers=LayerRange(a.layer_start, a.layer_end)
            if a.capability == "ffn" and a.layer_start is not None and a.layer_end is not None else None,
            joined_at=now, last_seen=now, token_hash=_hash(token), facts=dict(facts or {}),
        )
        self.members[m.id] = m
        return m, token

    def authenticate(self, member_id: str, token: str) -> Member | None:
        """The member, if ``token`` is its own (constant-time); None for an unknown or static id."""
        m = self.members.get(member_id)
        if m is None or m.static:
            return None
        if not hmac.compare_digest(_hash(token), m.token_hash):
            raise Forbidden("member token refused: heartbeat and leave take the token the join returned")
        return m

    def heartbeat(self, load: Load) -> Member | None:
        m = self.authenticate(load.member_id, load.member_token)
        if m is None:
            return None
        m.last_seen = self.clock()
        m.reported_inflight = load.inflight
        m.rss_bytes = load.rss_bytes
        m.layer_latency_ms = dict(load.layer_latency_ms)
        return m

    def leave(self, member_id: str, token: str) -> Member | None:
        m = self.authenticate(member_id, token)
        if m is not None:
            del self.members[member_id]
        return m

    def evict_stale(self, own_lag: float = 0.0) -> list[Member]:
        """Members silent for longer than ``evict_after`` plus ``own_lag``: how late this router's own
        loop has recently been (a heartbeat that waited in a busy router's queue is not the member's
        silence: the router must not blame a member for its own overload)."""
        now = self.clock()
        limit = self.evict_after + max(0.0, own_lag)
        stale = [m for m in self.members.values() if not m.static and now - m.last_seen > limit]
        for m in stale:
            del self.members[m.id]
        return stale

    # -- outcomes of requests ----------------------------------------------------------------------
    def succeeded(self, m: Member, rtt_ms: float) -> None:
        m.requests += 1
        m.consecutive_failures = 0
        m.down_until = 0.0
        m.rtt_ms = rtt_ms if m.rtt_ms is None else m.rtt_ms + EMA * (rtt_ms - m.rtt_ms)

    def failed(self, m: Member) -> None:
        m.requests += 1
        m.failures += 1
        m.consecutive_failures += 1
        cool = min(COOLDOWN_FIRST_S * 2 ** (m.consecutive_failures - 1), COOLDOWN_MAX_S)
        m.down_until = self.clock() + cool

    # -- routing ---------------------------------------------------------------------------------
    def ffn_candidates(self, layer: int, exclude: Iterable[str] = ()) -> list[Member]:
        """Members serving ``layer``, best first; members in cooldown only as a last resort."""
        ex = set(exclude)
        ms = [m for m in self.members.values() if m.serves(layer) and m.id not in ex]
        return self._rank(ms, layer)

    def embed_candidates(self, exclude: Iterable[str] = ()) -> list[Member]:
        ex = set(exclude)
        return self._rank([m for m in self.members.values() if m.capability == "embed" and m.id not in ex], None)

    def _rank(self, ms: list[Member], layer: int | None) -> list[Member]:
        now = self.clock()
        turn = next(self._rr)
        n = max(len(ms), 1)
        keyed = sorted(
            ((not m.available(now), m.cost(layer), (i - turn) % n, m) for i, m in enumerate(ms)),
            key=lambda t: t[:3],
        )
        return [t[3] for t in keyed]

    def assign(self, layers: Iterable[int], exclude: Iterable[str] = ()) -> tuple[dict[str, list[int]], list[int]]:
        """Map each position of ``layers`` to a member id, preferring members already chosen.

        Returns ``({member_id: [positions]}, [positions with no member])``. Keeping a request's
        layers on as few members as possible keeps fan-out (and merge work) small.
        """
        groups: dict[str, list[int]] = {}
        missing: list[int] = []
        for pos, layer in enumerate(layers):
            cands = self.ffn_candidates(layer, exclude)
            if not cands:
                missing.append(pos)
                continue
            now = self.clock()
            chosen = next((m for m in cands if m.id in groups and m.available(now)), cands[0])
            groups.setdefault(chosen.id, []).append(pos)
        return groups, missing

    # -- the grid at a glance --------------------------------------------------------------------------
    @property
    def hidden_size(self) -> int | None:
        return next((m.hidden_size for m in self.members.values() if m.hidden_size), None)

    @property
    def num_layers(self) -> int | None:
        ns = [m.num_layers for m in self.members.values() if m.num_layers]
        return max(ns) if ns else None

    def _replicas(self, now: float) -> dict[int, int]:
        n = self.num_layers or 0
        return {layer: sum(1 for m in self.members.values() if m.serves(layer) and m.available(now)) for layer in range(n)}

    def gaps(self) -> list[LayerRange]:
        """The runs of layers no live FFN member serves (empty while the model is unknown)."""
        n = self.num_layers
        if n is None:
            return []
        replicas = self._replicas(self.clock())
        return gaps({layer for layer, c in replicas.items() if c > 0}, n)

    def topology(self) -> Topology:
        """The live FFN members and their layers (and the live embed servers), for clients that send
        each request straight to a member.
        A member in cooldown is left out (clients fall back to this router for its layers), so a
        failure the router noticed reaches the clients at their next refresh."""
        now = self.clock()
        shards = tuple(sorted((Target(m.url, m.layers) for m in self.members.values()
                               if m.capability == "ffn" and m.available(now)),
                              key=lambda t: (t.layers.start if t.layers else -1, t.url)))
        embed = tuple(sorted(m.url for m in self.members.values() if m.capability == "embed" and m.available(now)))
        version = hashlib.sha256(repr(([(t.url, str(t.layers)) for t in shards], embed)).encode()).hexdigest()[:16]
        return Topology(version, shards, self.heartbeat_interval, embed)

    def view(self) -> dict:
        now = self.clock()
        n = self.num_layers
        replicas = self._replicas(now)
        coverage, run = [], None
        for layer in range(n or 0):
            c = replicas[layer]
            if run and run["replicas"] == c and run["end"] == layer - 1:
                run["end"] = layer
            else:
                run = {"start": layer, "end": layer, "replicas": c}
                coverage.append(run)
        holes = [str(g) for g in gaps({layer for layer, c in replicas.items() if c > 0}, n)] if n is not None else []
        models = sorted({m.model for m in self.members.values() if m.model})
        embeds = [m for m in self.members.values() if m.capability == "embed" and m.available(now)]
        facts: dict[str, str | int] = {}
        for m in self.members.values():
            for k, v in m.facts.items():
                facts.setdefault(k, v)
        return {
            "model": models[0] if len(models) == 1 else (models or None),
            "facts": facts,
            "num_layers": n,
            "hidden_size": self.hidden_size,
            "members": [m.view(now) for m in sorted(self.members.values(), key=lambda m: (m.capability, m.url))],
            "coverage": [{"layers": f"{r['start']}-{r['end']}", "replicas": r["replicas"]} for r in coverage],
            "gaps": holes,
            "embed": len(embeds),
            "complete": n is not None and not holes,
            "heartbeat_interval_s": self.heartbeat_interval,
            "evict_after_s": self.evict_after,
        }
