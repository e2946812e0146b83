"""The OpenAPI documents of the FFN shard and the router: built by code, committed, served, complete
(the embed server's own are in test_embed_server.py), and all three proven against behaviour by
schemathesis with every check (tests/_schemathesis.py), in-process on a tiny model."""

from __future__ import annotations

import json
import os
from pathlib import Path

import httpx
import pytest
from sanic.http import Http

from tests import _inproc as inproc
from tests._grid import wait_grid

REPO = Path(__file__).resolve().parents[1]
# Small limits keep schemathesis's boundary cases (maxItems, maxLength) cheap and reachable.
# Small limits keep schemathesis's boundary cases cheap and every constraint stated exactly.
EMBED_LIMITS = {"max_tokens": 16, "max_text_chars": 500}
SHARD_LIMITS = {"max_rows": 4}
# Sanic bounds the request head by a class attribute, set by the last app started from its max body:
# in one process the apps share it, so the test gives it the value every production server has (16 KiB,
# larql_edge.service._envelope.MAX_HEAD_BYTES) (500 characters of text then fit in a URL however they
# are encoded: 12 bytes a character at worst).
HEAD_BOUND = 16384


def _documented(doc: dict) -> set[str]:
    return {p.replace("{", "<").replace("}", ">") for p in doc["paths"]}


def _routes(app) -> set[str]:
    """The paths a running app routes (its router is finalized when it starts)."""
    # The router's /v1/token/<op> is one handler for the two documented operations.
    out = set()
    for r in app.router.routes:
        path = "/" + r.path.replace(":str", "")
        out |= {path.replace("<op>", op) for op in ("encode", "decode")} if "<op>" in path else {path}
    return out


@pytest.fixture(scope="module")
def grid(tiny_models):
    """A router with an embed member and two one-layer shards, all joined (the in-process grid)."""
    vx = tiny_models["gemma3"]
    # Heartbeats every second: under a fuzzer on two cores a 0.25 s heartbeat can miss its eviction deadline.
    with inproc.router(heartbeat=1.0) as r, inproc.embed({"m": vx}, join=r.url, **EMBED_LIMITS) as e, \
            inproc.shard(vx, "0-0", join=r.url, **SHARD_LIMITS) as a, inproc.shard(vx, "1-1", join=r.url, **SHARD_LIMITS) as b:
        inproc.wait_ready(e)
        wait_grid(r.url, embed=1)
        Http.set_header_max_size(HEAD_BOUND)
        yield {"router": r, "embed": e, "ffn": a, "ffn2": b}


@pytest.mark.parametrize("role", ["ffn", "router"])
def test_document_is_served_committed_and_complete(grid, role):
    from importlib import import_module

    spec = import_module(f"larql_edge.roles.{role}.openapi").openapi_spec
    served = httpx.get(grid[role].url + "/openapi.json").json()
    committed = json.loads((REPO / "openapi" / f"{role}.json").read_text())
    assert served == committed == spec(), f"regenerate: python -m larql_edge.roles.{role}.openapi > openapi/{role}.json"
    assert _documented(committed) == _routes(grid[role].app)


def test_the_ffn_document_narrowed_to_a_shard_states_its_width_layers_and_limits(grid):
    from larql_edge.roles.ffn.openapi import openapi_spec

    stats = httpx.get(grid["ffn"].url + "/v1/stats").json()
    req = openapi_spec(stats)["components"]["schemas"]["WalkRequest"]["properties"]
    assert (req["layer"]["minimum"], req["layer"]["maximum"]) == (0, 0)
    rows = req["residual"]["anyOf"][0]
    assert rows["maxItems"] == 4 and rows["items"]["minItems"] == rows["items"]["maxItems"] == 32
    generic = openapi_spec()["components"]["schemas"]["WalkRequest"]["properties"]
    assert generic["residual"]["anyOf"][0]["maxItems"] == 8192 and "minItems" not in generic["residual"]["anyOf"][0]["items"]


def _deployment(grid, role: str) -> dict:
    get = lambda name, path: httpx.get(grid[name].url + path).json()  # noqa: E731
    embed = {"limits": get("embed", "/v1/stats")["limits"], "models": get("embed", "/v1/models")["models"]}
    if role == "embed":
        return embed
    if role == "ffn":
        return get("ffn", "/v1/stats")
    return {"stats": get("router", "/v1/stats"), "shard": get("ffn", "/v1/stats"), "embed": embed}


@pytest.mark.slow  # tens of seconds in-process (tests/conftest.py: the tiers)
@pytest.mark.parametrize("role", ["embed", "ffn", "router"])
def test_schemathesis_finds_no_failure(grid, role):
    """Every check of schemathesis, every phase, against the document narrowed to this deployment
    (SCHEMATHESIS_EXAMPLES=25 for a longer run: about a minute instead of half; SCHEMATHESIS_SEED
    for other cases)."""
    from importlib import import_module

    from tests._schemathesis import run

    doc = import_module(f"larql_edge.roles.{role}.openapi").openapi_spec(_deployment(grid, role))
    report = run(doc, grid[role].url, max_examples=int(os.environ.get("SCHEMATHESIS_EXAMPLES", "5")),
                 seed=int(os.environ.get("SCHEMATHESIS_SEED", "1")))
    print(f"schemathesis {role}: {report}")
    assert report.cases > 100
    assert not report.failures and not report.errors, str(report)
