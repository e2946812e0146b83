"""The attention-only client (`larql predict|generate --embed URL --ffn URL`) against in-process servers
on loopback, tiny models: exact against the local forward, every way of naming the tiers, and failover
(the one test that kills a shard process is multi-process)."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from larql_edge.errors import ProtocolError, RemoteError
from larql_edge.format.vindex import Vindex
from larql_edge.model.forward import Transformer
from larql_edge.roles.client._build import build_remote
from larql_edge.wire.grid import parse_targets
from tests import _inproc as inproc
from tests._cli import larql
from tests._grid import Procs, StubEmbed, remote_args, wait_grid

IDS = [2, 4, 5, 6, 7, 8, 9, 10, 4]
PROMPT = "the capital of france is"


@pytest.fixture(scope="module", params=["gemma3", "llama"])
def family_grid(request, tiny_models):
    fam = request.param
    with inproc.grid(tiny_models[fam], ["0-0", "1-1"]) as g:
        g["vindex"] = tiny_models[fam]
        g["local"] = Transformer.local(tiny_models[fam])
        yield g


def test_three_tier_logits_equal_local(family_grid):
    remote = build_remote(Vindex.open(family_grid["vindex"]), remote_args(ffn=family_grid["router"].url))
    local = family_grid["local"]
    want = local.head.logits(local.forward(IDS))
    got = remote.head.logits(remote.forward(IDS))
    assert np.max(np.abs(got - want)) <= 1e-5
    # Decode with the KV cache, one token at a time, matches too.
    lc, rc = local.new_cache(), remote.new_cache()
    local.forward(IDS[:3], lc)
    remote.forward(IDS[:3], rc)
    for t in IDS[3:]:
        assert np.max(np.abs(remote.next_logits([t], rc) - local.next_logits([t], lc))) <= 1e-5


def test_cli_predict_and_generate_match_local(family_grid):
    v = str(family_grid["vindex"])
    for cmd in ("predict", "generate"):
        extra = ["--max-tokens", "8"] if cmd == "generate" else []
        loc = larql(cmd, "--vindex", v, "--prompt", PROMPT, "--json", *extra)
        rem = larql(cmd, "--vindex", v, "--ffn", family_grid["router"].url, "--prompt", PROMPT, "--json", *extra)
        assert loc.returncode == 0 and rem.returncode == 0, rem.stderr
        a, b = json.loads(loc.stdout), json.loads(rem.stdout)
        if cmd == "predict":
            assert [r["id"] for r in a["top_k"]] == [r["id"] for r in b["top_k"]]
            np.testing.assert_allclose([r["logprob"] for r in a["top_k"]], [r["logprob"] for r in b["top_k"]], atol=1e-5)
        else:
            assert a["generated_ids"] == b["generated_ids"]


def test_generate_streams_text(family_grid):
    r = larql("generate", "--vindex", str(family_grid["vindex"]), "--ffn", family_grid["router"].url,
              "--prompt", PROMPT, "--max-tokens", "4")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(PROMPT) and "tok/s" in r.stderr


def test_direct_shards_by_range_and_explicit_embed(family_grid):
    g = family_grid
    ffn = ",".join(f"{rng}={s[0].url}" for rng, s in g["shards"].items())
    remote = build_remote(Vindex.open(g["vindex"]), remote_args(ffn=ffn, embed=g["embed"].url))
    local = g["local"]
    np.testing.assert_allclose(remote.next_logits(IDS), local.next_logits(IDS), atol=1e-5, rtol=0)


def test_f16_wire_keeps_the_order(family_grid):
    g = family_grid
    remote = build_remote(Vindex.open(g["vindex"]), remote_args(ffn=g["router"].url, ffn_f16=True))
    got, want = remote.next_logits(IDS), g["local"].next_logits(IDS)
    assert np.argmax(got) == np.argmax(want)
    np.testing.assert_allclose(got, want, atol=5e-2)


def test_a_layer_no_target_serves_is_an_error(family_grid):
    g = family_grid
    with pytest.raises(RemoteError, match="layers 1-1"):
        build_remote(Vindex.open(g["vindex"]), remote_args(ffn=f"0-0={g['shards']['0-0'][0].url}", embed=g["embed"].url))
    with pytest.raises(RemoteError, match="--embed"):
        build_remote(Vindex.open(g["vindex"]), remote_args(ffn=f"0-1={g['shards']['0-0'][0].url}"))
    r = larql("predict", "--vindex", str(g["vindex"]), "--ffn", f"0-0={g['shards']['0-0'][0].url}",
              "--embed", g["embed"].url, "--prompt", PROMPT)
    assert r.returncode == 1 and "layers 1-1" in r.stderr and "Traceback" not in r.stderr


def test_a_shard_serving_the_wrong_layers_is_a_clear_error(family_grid):
    g = family_grid
    # Misconfigured: claims layer 1 is at the layer-0 shard. The shard's 400 names its range.
    remote = build_remote(Vindex.open(g["vindex"]),
                          remote_args(ffn=f"0-1={g['shards']['0-0'][0].url}", embed=g["embed"].url))
    with pytest.raises(RemoteError, match="serves layers 0-0"):
        remote.next_logits(IDS)


def test_client_loads_only_attention_and_norms(tiny_models, tmp_path):
    """The remote client works from a vindex holding no embeddings and no FFN weights."""
    src = tiny_models["gemma3"]
    dst = tmp_path / "attn-only"
    shutil.copytree(src, dst)
    for name in ("embeddings.bin", "gate_vectors.bin", "up_weights.bin", "down_weights.bin"):
        (dst / name).unlink()
    with StubEmbed(src) as stub, inproc.shard(src, "0-1") as shard:
        remote = build_remote(Vindex.open(dst), remote_args(ffn=shard.url, embed=stub.url))
        local = Transformer.local(src)
        np.testing.assert_allclose(remote.next_logits(IDS), local.next_logits(IDS), atol=1e-5, rtol=0)
        assert "POST /v1/embed" in stub.requests and "POST /v1/logits" in stub.requests


@pytest.mark.multiprocess
def test_client_fails_over_between_direct_replicas(tiny_models):
    """--ffn URL1,URL2 (replicas): kill the one in use mid-generation; the output is unchanged."""
    v = tiny_models["gemma3"]
    local = list(Transformer.local(v).generate(IDS[:4], 10, stop_ids=[]))
    with StubEmbed(v) as stub, Procs() as procs:
        a, b = procs.shard(v, "0-1", None, "a"), procs.shard(v, "0-1", None, "b")
        a.wait_ready(60)
        b.wait_ready(60)
        remote = build_remote(Vindex.open(v), remote_args(ffn=f"{a.url},{b.url}", embed=stub.url))
        out = []
        for i, tok in enumerate(remote.generate(IDS[:4], 10, stop_ids=[])):
            out.append(tok)
            if i == 3:
                a.kill()  # the client has been using a (the first listed)
        assert out == local
        assert remote.ffn_provider.replicas.failovers >= 1


def test_parse_targets():
    t = parse_targets("http://a:1, 0-8=http://b:2/ ,9-17=https://c")
    assert [(x.url, str(x.layers) if x.layers else None) for x in t] == [
        ("http://a:1", None), ("http://b:2", "0-8"), ("https://c", "9-17")]
    for bad in ("a:1", "0-x=http://a", "ftp://x"):
        with pytest.raises(ProtocolError, match=f"--ffn entry '{bad}'"):
            parse_targets(bad)


def test_router_without_embed_gives_a_clear_error(tiny_models):
    with inproc.router() as router, inproc.shard(tiny_models["gemma3"], "0-1", join=router.url):
        wait_grid(router.url)
        r = larql("predict", "--vindex", str(tiny_models["gemma3"]), "--ffn", router.url, "--prompt", PROMPT,
                  "--retries", "1")
        assert r.returncode == 1 and "embed" in r.stderr and "Traceback" not in r.stderr


def test_a_larql_embed_server_that_answers_top_k_json_only(tiny_models):
    """LARQL's /v1/logits never sends raw f32[vocab]: the client switches to top-k JSON, says so, and
    greedy decoding stays exact; sampling draws among the top k."""
    v = tiny_models["gemma3"]
    local = Transformer.local(v)
    want = list(local.generate(IDS[:4], 8, stop_ids=[]))
    with StubEmbed(v, larql_logits=True) as stub, inproc.shard(v, "0-1") as shard:
        notes = []
        remote = build_remote(Vindex.open(v), remote_args(ffn=shard.url, embed=stub.url, logits_top_k=8))
        remote.head.notice = notes.append
        assert list(remote.generate(IDS[:4], 8, stop_ids=[])) == want
        assert remote.head.mode == "top-k JSON" and "top 8" in notes[0] and len(notes) == 1
        top8 = set(np.argsort(-local.next_logits(IDS[:4]))[:8].tolist())
        sampled = {next(remote.generate(IDS[:4], 1, temperature=8.0, seed=s, stop_ids=[])) for s in range(24)}
        assert sampled <= top8 and len(sampled) > 1


def test_generate_against_a_grid_that_is_not_up_fails_at_once_on_its_own_line(tiny_models):
    """`larql generate` against an unreachable grid retried silently for 16 s, then printed its error
    glued to the echoed prompt (`...hilarql generate: error: ...`). Nothing listening at the start is
    an error at once (no retry lines), and the prompt's line is ended before the error."""
    from tests._grid import free_port

    url = f"http://127.0.0.1:{free_port()}"
    r = larql("generate", "--vindex", str(tiny_models["llama"]), "--ffn", url, "--prompt", PROMPT,
              "--max-tokens", "4")
    assert r.returncode == 1
    assert r.stdout == PROMPT + "\n"
    assert "nothing answers at " + url in r.stderr and "is it running?" in r.stderr, r.stderr
    assert "retrying" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_every_retry_wait_is_a_progress_line():
    """Retries against a failing replica (the default budget spans ~15 s) each say so, bounded."""
    import http.server
    import threading

    from larql_edge.net.remote import Replicas, make_client

    class Busy(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = b'{"error": "warming up"}'
            self.send_response(503)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Busy)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        lines: list[str] = []
        url = f"http://127.0.0.1:{server.server_address[1]}"
        reps = Replicas(make_client(5.0), retries=3, backoff=0.01, what="FFN", on_retry=lines.append,
                        refused_first_is_fatal=True)
        with pytest.raises(RemoteError, match="after 4 attempts"):
            reps.request([url], "GET", "/v1/health")
        assert len(lines) == 3 and all("HTTP 503 warming up; retrying in" in line for line in lines), lines
        assert lines[-1].endswith("(attempt 4 of 4)")
    finally:
        server.shutdown()
        server.server_close()
