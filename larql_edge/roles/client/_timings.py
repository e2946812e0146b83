"""``larql generate --timings``: where each token's time went.

Per token: its wall time (from asking for it to having it), what was computed here (the model's
``local_s``: attention, norms, sampling) and every hop it made (`larql_edge.net.hops.Hop`: the server's own time from
its Server-Timing header, the rest is network). The table shows, per hop of a decoded token, which
server answered and the mean compute and network time, so a slow hop stands out.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field

from larql_edge.net.hops import Hop


@dataclass
class TokenTime:
    wall_s: float
    local_s: float
    hops: list[Hop] = field(default_factory=list)
    draft_s: float = 0.0  # the draft model's time (--draft), here on this machine

    @property
    def hops_s(self) -> float:
        return sum(h.wall_s for h in self.hops)

    def as_json(self) -> dict:
        return {"wall_ms": round(self.wall_s * 1e3, 3), "local_ms": round(self.local_s * 1e3, 3),
                "draft_ms": round(self.draft_s * 1e3, 3),
                "hops": [{"tier": h.tier, "layer": h.layer, "url": h.url, "wall_ms": round(h.wall_s * 1e3, 3),
                          "compute_ms": round((h.server_s or 0.0) * 1e3, 3), "network_ms": round(h.network_s * 1e3, 3),
                          "hedged": h.hedged} for h in self.hops]}


def _name(h: Hop) -> str:
    return f"layer {h.layer}" if h.tier == "ffn" else h.tier


def report(tokens: list[TokenTime], hedges: dict | None = None) -> str:
    """The table for the decoded tokens (the first token's time is the prompt's prefill: left out)."""
    decoded = tokens[1:] or tokens
    if not decoded:
        return "timings: no token"
    n = len(decoded)
    wall = sum(t.wall_s for t in decoded) / n
    local = sum(t.local_s for t in decoded) / n
    draft = sum(t.draft_s for t in decoded) / n
    hops = [h for t in decoded for h in t.hops]
    compute = sum(h.server_s or 0.0 for h in hops) / n
    network = sum(h.network_s for h in hops) / n
    other = wall - local - draft - compute - network
    drafted = f" + draft model {draft * 1e3:.2f} ms" if any(t.draft_s for t in decoded) else ""
    lines = [f"timings: mean of {n} decoded tokens: {wall * 1e3:.2f} ms = local compute {local * 1e3:.2f} ms"
             f"{drafted} + {len(hops) / n:.0f} hops ({compute * 1e3:.2f} ms compute, {network * 1e3:.2f} ms network)"
             f" + other {other * 1e3:.2f} ms"]
    by: dict[tuple[int, str], list[Hop]] = defaultdict(list)
    order = {"embed": -1, "ffn": 0, "logits": 1 << 20, "topology": 1 << 21}
    for h in hops:
        by[(order.get(h.tier, 0) + (h.layer or 0), _name(h))].append(h)
    for (_, name), hs in sorted(by.items()):
        url = Counter(h.url for h in hs).most_common(1)[0][0]
        c = sum(h.server_s or 0.0 for h in hs) / len(hs) * 1e3
        w = sum(h.network_s for h in hs) / len(hs) * 1e3
        extra = f" ({sum(h.hedged for h in hs)} hedged)" if any(h.hedged for h in hs) else ""
        lines.append(f"  {name + ':':<10} {url}  {c:.2f} ms compute, {w:.2f} ms network{extra}")
    if hedges and hedges["hops"]:
        lines.append(f"  hedges: {hedges['hedges_sent']} sent, {hedges['hedges_won']} won, of {hedges['hops']} hedgeable hops")
    return "\n".join(lines)
