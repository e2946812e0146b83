"""The grid membership protocol: what a member sends the router, and how the router checks it.

Members authenticate with the grid key as a bearer token (``Authorization: Bearer KEY``).

- ``POST /v1/grid/join``      `Announce` as JSON -> ``{"member_id", "member_token", "heartbeat_interval_s",
  "evict_after_s"}``. The router first probes the announced URL (``/v1/health``, ``/v1/stats``) and
  refuses a member that is not what it announces; a URL a live member already has is refused too.
- ``POST /v1/grid/heartbeat`` `Load` (with ``member_token``) as JSON -> ``{"ok": true}``; 404 when the
  router does not know the member (it restarted, or evicted it): the member then joins again.
- ``POST /v1/grid/leave``     ``{"member_id", "member_token"}`` -> ``{"ok": true}`` (a clean shutdown;
  eviction covers the rest).

The member token is what makes a member's heartbeats and leave its own: the grid key lets anyone
holding it join, but not speak for a member it did not start (README, "Trust").
"""

from __future__ import annotations

from dataclasses import dataclass, field
from urllib.parse import urlsplit

from larql_edge.errors import ProtocolError
from larql_edge.format.layers import LayerRange
from larql_edge.wire.numbers import json_int

JOIN = "/v1/grid/join"
HEARTBEAT = "/v1/grid/heartbeat"
LEAVE = "/v1/grid/leave"
CAPABILITIES = ("ffn", "embed")
# Bounds of what a member may announce: a model has at most this many layers (as many as one FFN
# request may name), a width at most this; the router iterates over layers, so they must be bounded.
MAX_LAYERS = 4096
MAX_HIDDEN = 1 << 20
MAX_INFLIGHT = 1 << 20


def _str(obj: dict, key: str, required: bool = True, limit: int = 512) -> str:
    v = obj.get(key)
    if v is None and not required:
        return ""
    if not isinstance(v, str) or not v or len(v) > limit:
        raise ProtocolError(f'"{key}" must be a non-empty string of at most {limit} characters')
    return v


def _int(obj: dict, key: str, required: bool = True, minimum: int = 0, maximum: int = 1 << 40) -> int | None:
    v = obj.get(key)
    if v is None and not required:
        return None
    v = json_int(v)
    if v is None or v < minimum or v > maximum:
        raise ProtocolError(f'"{key}" must be an integer from {minimum} to {maximum}')
    return v


def check_url(url: str, what: str = '"public_url"') -> str:
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError for a port that is not a number in range
    except ValueError:
        raise ProtocolError(f"{what} must be an http(s) URL, got {url[:200]!r}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ProtocolError(f"{what} must be an http(s) URL, got {url[:200]!r}")
    if parts.query or parts.fragment:
        raise ProtocolError(f"{what} must not carry a query or fragment")
    return url.rstrip("/")


@dataclass(frozen=True)
class Target:
    """A server named on a command line: its URL, and the layers it serves (None: every layer, as a
    router or a shard serving the whole model does)."""

    url: str
    layers: LayerRange | None = None

    def serves(self, layer: int) -> bool:
        return self.layers is None or layer in self.layers


def parse_targets(text: str, what: str = "--ffn") -> list[Target]:
    """``"URL"``, ``"URL1,URL2"`` (replicas) or ``"0-8=URL,9-17=URL"`` (by layer range): the one
    parser of the router's ``--shards`` and the client's and larql-serve's ``--ffn``/``--embed``."""
    out = []
    for part in filter(None, (p.strip() for p in (text or "").split(","))):
        rng, sep, url = part.partition("=")
        if not sep:
            rng, url = "", part
        try:
            layers = LayerRange.parse(rng) if rng else None
        except ValueError as e:
            raise ProtocolError(f"{what} entry {part!r}: {e}") from None
        out.append(Target(check_url(url.strip(), f"{what} entry {part!r}"), layers))
    return out


# GET /v1/topology at a router: which live shard serves which layers, so clients can send each
# layer's request straight to a shard (the direct data path) and keep the router as the fallback.
TOPOLOGY = "/v1/topology"


@dataclass(frozen=True)
class Topology:
    version: str  # changes whenever the shards or their ranges change
    shards: tuple[Target, ...]
    refresh_s: float  # how often a client should ask again (the grid's heartbeat interval)
    embed: tuple[str, ...] = ()  # live embed servers: embeddings and logits go straight to one too

    def to_json(self) -> dict:
        return {"version": self.version, "refresh_s": self.refresh_s,
                "shards": [{"url": t.url, "layers": str(t.layers) if t.layers is not None else "all"} for t in self.shards],
                "embed": list(self.embed)}

    @classmethod
    def from_json(cls, obj: object) -> "Topology":
        if not isinstance(obj, dict) or not isinstance(obj.get("shards"), list):
            raise ProtocolError('a topology is an object with a "shards" list')
        shards = []
        for s in obj["shards"][:MAX_LAYERS]:
            if not isinstance(s, dict):
                raise ProtocolError("a topology shard is an object")
            rng = _str(s, "layers", limit=32)
            try:
                layers = None if rng == "all" else LayerRange.parse(rng)
            except ValueError as e:
                raise ProtocolError(str(e)) from None
            shards.append(Target(check_url(_str(s, "url"), "a topology shard URL"), layers))
        refresh = obj.get("refresh_s", 2.0)
        if not isinstance(refresh, (int, float)) or isinstance(refresh, bool) or not 0 < refresh <= 3600:
            raise ProtocolError('"refresh_s" must be a number of seconds, up to 3600')
        embed = obj.get("embed", [])
        if not isinstance(embed, list) or not all(isinstance(u, str) for u in embed):
            raise ProtocolError('"embed" must be a list of URLs')
        return cls(_str(obj, "version", limit=128), tuple(shards), float(refresh),
                   tuple(check_url(u, "a topology embed URL") for u in embed[:MAX_LAYERS]))


@dataclass(frozen=True)
class Announce:
    capability: str
    public_url: str
    model: str
    num_layers: int | None
    hidden_size: int | None
    layer_start: int | None
    layer_end: int | None
    vindex_hash: str

    @classmethod
    def from_json(cls, obj: object) -> "Announce":
        if not isinstance(obj, dict):
            raise ProtocolError("the join body must be a JSON object")
        cap = obj.get("capability")
        if cap not in CAPABILITIES:
            raise ProtocolError(f'"capability" must be one of {", ".join(CAPABILITIES)}')
        a = cls(
            capability=cap,
            public_url=check_url(_str(obj, "public_url", limit=2048)),
            model=_str(obj, "model"),
            num_layers=_int(obj, "num_layers", required=cap == "ffn", minimum=1, maximum=MAX_LAYERS),
            hidden_size=_int(obj, "hidden_size", required=False, minimum=1, maximum=MAX_HIDDEN),
            layer_start=_int(obj, "layer_start", required=cap == "ffn", maximum=MAX_LAYERS - 1),
            layer_end=_int(obj, "layer_end", required=cap == "ffn", maximum=MAX_LAYERS - 1),
            vindex_hash=_str(obj, "vindex_hash", required=False, limit=128),
        )
        if cap == "ffn":
            assert a.layer_start is not None and a.layer_end is not None  # required for ffn above
            if a.layer_end < a.layer_start:
                raise ProtocolError('"layer_end" must be >= "layer_start" (the range is inclusive)')
            if a.num_layers is not None and a.layer_end >= a.num_layers:
                raise ProtocolError(f'layer range {a.layer_start}-{a.layer_end} exceeds "num_layers" {a.num_layers}')
        return a


@dataclass(frozen=True)
class Load:
    member_id: str
    member_token: str = field(default="", repr=False)
    inflight: int = 0
    rss_bytes: int = 0
    layer_latency_ms: dict[int, float] = field(default_factory=dict)

    @classmethod
    def from_json(cls, obj: object) -> "Load":
        if not isinstance(obj, dict):
            raise ProtocolError("the heartbeat body must be a JSON object")
        lat = obj.get("layer_latency_ms") or {}
        if not isinstance(lat, dict) or len(lat) > MAX_LAYERS:
            raise ProtocolError('"layer_latency_ms" must be an object {layer: ms}')
        parsed: dict[int, float] = {}
        for k, v in lat.items():
            if not (isinstance(k, str) and k.isdigit() and int(k) < MAX_LAYERS):
                raise ProtocolError(f'"layer_latency_ms" key {str(k)[:20]!r} is not a layer number')
            layer = int(k)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (0 <= v < 1e9):
                raise ProtocolError(f'"layer_latency_ms" value for layer {k} must be a number >= 0')
            parsed[layer] = float(v)
        return cls(
            member_id=_str(obj, "member_id", limit=64),
            member_token=_str(obj, "member_token", required=False, limit=128),
            inflight=_int(obj, "inflight", required=False, maximum=MAX_INFLIGHT) or 0,
            rss_bytes=_int(obj, "rss_bytes", required=False) or 0,
            layer_latency_ms=parsed,
        )
