"""Real models, real processes on loopback: the three-tier forward through the router equals the
local single-process forward (golden prompts: logits, 16-token greedy continuation; f16 wire: top-10
order), and a replica killed mid-generation changes nothing."""

from __future__ import annotations

import numpy as np
import pytest

from larql_edge.format.layers import split_even
from larql_edge.format.vindex import Vindex
from larql_edge.model.forward import Transformer, top_k
from larql_edge.roles.client._build import build_remote
from tests._grid import Procs, remote_args, start_grid

pytestmark = pytest.mark.slow

MODELS = {"gemma3-270m": "gemma_f32", "smollm2-135m": "smol_f32"}


@pytest.fixture(scope="module", params=list(MODELS))
def real(request, real_grid_f32):
    vindex = request.getfixturevalue(MODELS[request.param])
    g = dict(real_grid_f32(request.param, vindex))  # its layers in 2 even ranges
    g.update(name=request.param, local=Transformer.local(vindex),
             remote=build_remote(Vindex.open(vindex), remote_args(ffn=g["router"].url, timeout=120)))
    return g


def _prompts(golden, name):
    return golden(name)["prompts"]


def test_three_tier_logits_equal_local(real, golden):
    for p in _prompts(golden, real["name"]):
        ids = p["input_ids"]
        want = real["local"].next_logits(ids)
        got = real["remote"].next_logits(ids)
        delta = float(np.max(np.abs(got - want)))
        assert delta <= 1e-3, f"{p['prompt']!r}: max |delta logit| {delta}"
        assert [i for i, _ in top_k(got, 10)] == [i for i, _ in top_k(want, 10)]


def test_three_tier_greedy_continuation_equals_local(real, golden):
    for p in _prompts(golden, real["name"]):
        ids = p["input_ids"]
        want = list(real["local"].generate(ids, 16, stop_ids=[]))
        got = list(real["remote"].generate(ids, 16, stop_ids=[]))
        assert got == want, p["prompt"]


def test_f16_wire_keeps_the_top10_order(real, golden):
    remote16 = build_remote(Vindex.open(real["vindex"]), remote_args(ffn=real["router"].url, ffn_f16=True, timeout=120))
    for p in _prompts(golden, real["name"]):
        ids = p["input_ids"]
        want = [i for i, _ in top_k(real["local"].next_logits(ids), 10)]
        got = [i for i, _ in top_k(remote16.next_logits(ids), 10)]
        assert got == want, p["prompt"]


def test_gemma_replica_killed_mid_generation(gemma_f32, golden):
    prompt = golden("gemma3-270m")["prompts"][0]
    ids = prompt["input_ids"]
    want = prompt["greedy_ids"]
    n = Vindex.open(gemma_f32).num_layers
    with Procs() as procs:
        g = start_grid(procs, gemma_f32, [str(r) for r in split_even(n, 2)], replicas=2, timeout=600)
        remote = build_remote(Vindex.open(gemma_f32), remote_args(ffn=g["router"].url, timeout=120))
        out = []
        for i, tok in enumerate(remote.generate(ids, len(want), stop_ids=[])):
            out.append(tok)
            if i == 5:
                import httpx

                members = {m["url"]: m["requests"] for m in httpx.get(g["router"].url + "/v1/grid").json()["members"]}
                first = next(iter(g["shards"].values()))
                max(first, key=lambda s: members.get(s.url, 0)).kill()
        assert out == want
