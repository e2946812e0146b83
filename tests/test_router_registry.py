"""The router's registry on its own: joins, heartbeats, eviction, replica choice, coverage and gaps."""

from __future__ import annotations

import pytest

from larql_edge.format.layers import LayerRange, gaps, split_even
from larql_edge.roles.router.registry import Conflict, Registry
from larql_edge.wire.grid import Announce, Load, ProtocolError


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def ann(url, start=0, end=3, cap="ffn", model="m", n=4, hidden=8, vh="h"):
    return Announce.from_json({"capability": cap, "public_url": url, "model": model, "num_layers": n,
                               "hidden_size": hidden, "layer_start": start, "layer_end": end, "vindex_hash": vh})


def join(reg, a):
    """Join and keep the member token on the member (as the member itself would)."""
    m, token = reg.join(a)
    m.test_token = token
    return m


@pytest.fixture
def reg():
    clock = Clock()
    r = Registry(heartbeat_interval=1.0, clock=clock)
    r.clock_obj = clock
    return r


def test_join_heartbeat_and_eviction(reg):
    a = join(reg, ann("http://a:1", 0, 1))
    b = join(reg, ann("http://b:1", 2, 3))
    assert reg.view()["complete"] and reg.view()["gaps"] == []
    reg.clock_obj.t += 2.0
    assert reg.heartbeat(Load(member_id=a.id, member_token=a.test_token, inflight=2, rss_bytes=5,
                              layer_latency_ms={0: 1.5})) is a
    assert a.reported_inflight == 2 and a.layer_latency_ms == {0: 1.5}
    reg.clock_obj.t += 1.5  # b silent for 3.5 s > 3 intervals; a for 1.5 s
    evicted = reg.evict_stale()
    assert [m.id for m in evicted] == [b.id]
    v = reg.view()
    assert v["gaps"] == ["2-3"] and not v["complete"]
    assert reg.heartbeat(Load(member_id=b.id, member_token=b.test_token)) is None  # forgotten: join again


def test_the_routers_own_stall_is_not_a_members_silence(reg):
    """A router whose loop ran late (a starved host) does not evict members for heartbeats it could
    not read meanwhile; a member silent beyond that is still evicted (issue 19: a rolling update on a
    busy host uncovered a range)."""
    a = join(reg, ann("http://a:1", 0, 3))
    reg.clock_obj.t += 3.5
    reg.note_stall(2.0)  # housekeeping slept 2 s longer than asked
    reg.note_stall(-0.1)  # early wake-ups count for nothing
    assert reg.silence(a) == pytest.approx(1.5)
    assert reg.evict_stale() == [] and reg.view()["complete"]
    reg.heartbeat(Load(member_id=a.id, member_token=a.test_token))
    reg.clock_obj.t += 3.5  # silent 3.5 s with the router on time: evicted
    assert reg.silence(a) == pytest.approx(3.5)
    assert [m.id for m in reg.evict_stale()] == [a.id]


def test_a_live_members_url_cannot_be_taken(reg):
    """A key holder cannot replace a member by joining with its URL; once it is evicted, it can rejoin."""
    a1 = join(reg, ann("http://a:1"))
    with pytest.raises(Conflict, match="already has the URL"):
        join(reg, ann("http://a:1"))
    reg.clock_obj.t += 3.5
    reg.evict_stale()
    a2 = join(reg, ann("http://a:1"))
    assert a1.id != a2.id and list(reg.members) == [a2.id]


def test_heartbeat_and_leave_need_the_members_token(reg):
    from larql_edge.errors import Forbidden

    a = join(reg, ann("http://a:1"))
    for token in ("", "someone-elses", a.test_token[:-1]):
        with pytest.raises(Forbidden):
            reg.heartbeat(Load(member_id=a.id, member_token=token))
        with pytest.raises(Forbidden):
            reg.leave(a.id, token)
    assert reg.leave(a.id, a.test_token) is a and reg.leave(a.id, a.test_token) is None
    assert reg.members == {}


def test_join_bounds_keep_the_router_responsive():
    """num_layers = 2**40 once kept a router at 100% CPU forever: the protocol bounds it."""
    for bad in ({"num_layers": 2**40}, {"layer_end": 5000, "num_layers": 4096}, {"hidden_size": 2**30}):
        with pytest.raises(ProtocolError):
            Announce.from_json({"capability": "ffn", "public_url": "http://a:1", "model": "m", "num_layers": 4,
                                "layer_start": 0, "layer_end": 3} | bad)


def test_model_mismatch_is_conflict(reg):
    join(reg, ann("http://a:1"))
    with pytest.raises(Conflict):
        join(reg, ann("http://b:1", model="other"))
    with pytest.raises(Conflict):
        join(reg, ann("http://b:1", hidden=16))
    with pytest.raises(Conflict):
        join(reg, ann("http://b:1", end=5, n=6))


def test_a_replica_of_another_build_is_refused_and_told_why(reg):
    """Issue 19 (High): a q4k shard was accepted as a replica beside f16 shards of "the same model"."""
    join(reg, ann("http://f16-a:1", 0, 1, vh="f16hash"))
    join(reg, ann("http://f16-b:1", 2, 3, vh="f16hash"))
    with pytest.raises(Conflict) as e:
        join(reg, ann("http://q4k:1", 0, 1, vh="q4khash"))
    assert "q4khash" in str(e.value) and "f16hash" in str(e.value) and "http://f16-a:1" in str(e.value)
    with pytest.raises(Conflict):  # overlapping a range counts too
        join(reg, ann("http://q4k:1", 1, 2, vh="q4khash"))
    join(reg, ann("http://f16-c:1", 0, 1, vh="f16hash"))  # the same build is a replica
    join(reg, ann("http://embed-a:1", cap="embed", vh="embedslice"))  # another tier holds other files
    with pytest.raises(Conflict):
        join(reg, ann("http://embed-b:1", cap="embed", vh="otherembed"))
    assert len(reg.members) == 4


def test_best_replica_and_failover(reg):
    a = join(reg, ann("http://a:1"))
    b = join(reg, ann("http://b:1"))
    a.inflight = 3
    assert reg.ffn_candidates(0)[0] is b  # less outstanding work wins
    a.inflight = 0
    reg.failed(b)
    assert reg.ffn_candidates(0)[0] is a  # a member in cooldown goes last...
    a.down_until = reg.clock_obj.t + 5
    assert {m.id for m in reg.ffn_candidates(0)} == {a.id, b.id}  # ...but is still a last resort
    reg.clock_obj.t += 10
    reg.succeeded(b, 1.0)
    assert b.consecutive_failures == 0 and b.available(reg.clock_obj.t)


def test_ties_rotate_between_replicas(reg):
    join(reg, ann("http://a:1"))
    join(reg, ann("http://b:1"))
    firsts = {reg.ffn_candidates(0)[0].url for _ in range(4)}
    assert firsts == {"http://a:1", "http://b:1"}


def test_cooldown_grows(reg):
    a = join(reg, ann("http://a:1"))
    reg.failed(a)
    first = a.down_until - reg.clock_obj.t
    reg.failed(a)
    assert a.down_until - reg.clock_obj.t == pytest.approx(2 * first)


def test_assign_groups_layers_on_few_members(reg):
    join(reg, ann("http://a:1", 0, 1))
    join(reg, ann("http://b:1", 2, 3))
    groups, missing = reg.assign([0, 1, 2, 3, 1])
    assert missing == []
    by_url = {reg.members[mid].url: pos for mid, pos in groups.items()}
    assert by_url == {"http://a:1": [0, 1, 4], "http://b:1": [2, 3]}
    # Excluding the only member of 2-3 leaves those positions without a member: never zeros.
    b = next(m for m in reg.members.values() if m.url == "http://b:1")
    groups, missing = reg.assign([0, 2, 3], exclude=[b.id])
    assert missing == [1, 2]


def test_static_members_never_evicted(reg):
    s = reg.add_static("ffn", "http://s:1/", LayerRange(0, 3))
    reg.clock_obj.t += 1000
    assert reg.evict_stale() == [] and s.url == "http://s:1"
    assert reg.heartbeat(Load(member_id=s.id)) is None and reg.leave(s.id, "") is None


def test_embed_members(reg):
    e = join(reg, ann("http://e:1", cap="embed"))
    assert e.layers is None and not e.serves(0)
    assert reg.embed_candidates() == [e] and reg.view()["embed"] == 1


def test_coverage_runs(reg):
    join(reg, ann("http://a:1", 0, 3))
    join(reg, ann("http://b:1", 2, 3))
    assert reg.view()["coverage"] == [{"layers": "0-1", "replicas": 1}, {"layers": "2-3", "replicas": 2}]


@pytest.mark.parametrize(
    "obj",
    [
        None, [], {}, {"capability": "gpu"},
        {"capability": "ffn", "public_url": "http://a:1", "model": "m"},  # no layer range
        {"capability": "ffn", "public_url": "http://a:1", "model": "m", "layer_start": 3, "layer_end": 1},
        {"capability": "ffn", "public_url": "http://a:1", "model": "m", "layer_start": 0, "layer_end": 9, "num_layers": 4},
        {"capability": "ffn", "public_url": "ftp://a:1", "model": "m", "layer_start": 0, "layer_end": 1},
        {"capability": "ffn", "public_url": "http://a:1?x=1", "model": "m", "layer_start": 0, "layer_end": 1},
        {"capability": "embed", "public_url": "http://a:1", "model": ""},
        {"capability": "embed", "public_url": "http://a:1", "model": "m", "num_layers": "4"},
        {"capability": "embed", "public_url": "http://a:1", "model": "m", "hidden_size": True},
    ],
)
def test_bad_announcements(obj):
    with pytest.raises(ProtocolError):
        Announce.from_json(obj)


@pytest.mark.parametrize(
    "obj",
    [None, {}, {"member_id": ""}, {"member_id": 5}, {"member_id": "a", "inflight": -1},
     {"member_id": "a", "layer_latency_ms": {"x": 1}}, {"member_id": "a", "layer_latency_ms": {"1": -1}},
     {"member_id": "a", "layer_latency_ms": [1]}],
)
def test_bad_heartbeats(obj):
    with pytest.raises(ProtocolError):
        Load.from_json(obj)


def test_layer_helpers():
    assert LayerRange.parse("0-8") == LayerRange(0, 8) and LayerRange.parse("3") == LayerRange(3, 3)
    assert str(LayerRange(2, 5)) == "2-5" and len(LayerRange(2, 5)) == 4 and 5 in LayerRange(2, 5)
    for bad in ("", "a-b", "5-2", "-1"):
        with pytest.raises(ValueError):
            LayerRange.parse(bad)
    assert split_even(18, 2) == [LayerRange(0, 8), LayerRange(9, 17)]
    assert split_even(5, 3) == [LayerRange(0, 1), LayerRange(2, 3), LayerRange(4, 4)]
    assert [str(g) for g in gaps({0, 1, 4}, 7)] == ["2-3", "5-6"]

