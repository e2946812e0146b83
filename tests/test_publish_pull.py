"""publish / pull against the Hub-protocol test server, with the unmodified huggingface_hub client."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from larql_edge.errors import HubError, SliceError, VindexError
from larql_edge.format.presets import DEFAULT_SLICES
from larql_edge.format.vindex import Vindex, sha256_file, write_index
from larql_edge.tools.slicer.publish import default_family, default_model_title, publish, short_model_name
from larql_edge.tools.slicer.pull import pull, split_sibling_suffix
from tests._cli import slicer

REPO = "test-user/tiny-vindex"
WRITES = ("POST", "PUT", "DELETE", "PATCH")


def quiet(_msg: str) -> None:
    pass


@pytest.fixture
def vindex(tiny_models, tmp_path) -> Path:
    """A private copy (not links) of the tiny Gemma vindex that tests may change."""
    dst = tmp_path / "src.vindex"
    shutil.copytree(tiny_models["gemma3"], dst)
    return dst


def _publish(hub, src, **kw):
    return publish(src, kw.pop("repo", REPO), endpoint=hub.url, token=hub.token, log=quiet, **kw)


def test_names_are_derived_as_the_record_says():
    assert short_model_name("google/gemma-4-31b-it") == "gemma-4-31b-it"
    assert short_model_name("/Users/x/models--google--gemma-4-31B-it/snapshots/abc/") == "gemma-4-31B-it"
    assert short_model_name("gemma-3-4b-it") == "gemma-3-4b-it"
    assert default_model_title("google/gemma-4-31b-it") == "Gemma 4 31B It"
    assert default_family("gemma-4-31b-it") == "Gemma"
    assert default_family("/x/models--meta--llama-3-70b/snapshots/1/") == "Llama"
    assert split_sibling_suffix("o/m-vindex-client") == ("o/m-vindex", "client")
    assert split_sibling_suffix("o/m-vindex") == ("o/m-vindex", None)


@pytest.mark.slow  # tens of seconds in-process (tests/conftest.py: the tiers)
def test_publish_default_slices_then_republish_unchanged(hub, vindex):
    rep = _publish(hub, vindex)
    repos = [r.repo for r in rep.repos]
    assert repos == [REPO] + [f"{REPO}-{p}" for p in DEFAULT_SLICES]
    assert len(hub.collections()) == 3
    for r in repos:
        assert hub.repo(r, repo_type="dataset") is not None
    # Every file of every repo arrived with the bytes of the source.
    for r in rep.repos:
        files = hub.files(r.repo)
        assert "index.json" in files
        for name, _ in r.uploaded:
            if name != "index.json":
                assert hub.file_bytes(r.repo, name) == (vindex / name).read_bytes()
    first_lfs = hub.lfs_bytes_uploaded()
    assert first_lfs > 0
    collections_before = json.dumps([c for c in hub.collections()], sort_keys=True, default=str)

    hub.clear_requests()
    rep2 = _publish(hub, vindex)
    assert hub.lfs_bytes_uploaded() == 0, "an unchanged republish uploaded LFS bytes"
    assert all(not [n for n, _ in r.uploaded if n != "index.json" and n.endswith(".bin")] for r in rep2.repos)
    assert json.dumps([c for c in hub.collections()], sort_keys=True, default=str) == collections_before
    assert hub.requests_matching("POST", r"/api/collections$") == []


def test_changed_file_is_the_only_one_uploaded(hub, vindex):
    _publish(hub, vindex, slices=["server", "attn"], collections=[])
    # Change up_weights.bin (a new file, not an in-place write) and its checksum.
    data = bytearray((vindex / "up_weights.bin").read_bytes())
    data[0] ^= 0xFF
    (vindex / "up_weights.bin.new").write_bytes(bytes(data))
    os.replace(vindex / "up_weights.bin.new", vindex / "up_weights.bin")
    ix = Vindex.open(vindex).index
    ix = ix.replace(checksums={**ix.checksums, "up_weights.bin": sha256_file(vindex / "up_weights.bin")})
    write_index(vindex, ix)
    hub.clear_requests()
    rep = _publish(hub, vindex, slices=["server", "attn"], collections=[])
    # Small git-tracked files (index.json, manifest, the tiny tokenizer) are always re-sent by design.
    by_repo = {r.repo: {n for n, _ in r.uploaded if n.endswith(".bin")} for r in rep.repos}
    assert by_repo == {REPO: {"up_weights.bin"}, f"{REPO}-server": {"up_weights.bin"}, f"{REPO}-attn": set()}
    # The new file went up once per repo that holds it (full and server), nothing else did.
    assert [u.body_size for u in hub.lfs_uploads()] == [len(data), len(data)]
    assert hub.has_lfs_object(REPO, ix.checksums["up_weights.bin"])
    assert hub.has_lfs_object(f"{REPO}-server", ix.checksums["up_weights.bin"])


def test_dry_run_changes_nothing(hub, vindex):
    rep = _publish(hub, vindex, dry_run=True)
    assert rep.dry_run and len(rep.repos) == 6
    assert [r for r in hub.requests if r.method in WRITES] == []
    assert hub.collections() == []


def test_repo_type_model_everywhere(hub, vindex):
    rep = _publish(hub, vindex, slices=["embed"], repo_type="model")
    assert hub.repo(REPO, repo_type="model") is not None
    items = [i for c in hub.collections() for i in c["items"]]
    assert items and {i["type"] for i in items} == {"model"}
    out = pull(REPO, preset="embed", repo_type="model", endpoint=hub.url, token=hub.token, log=quiet, hints=False)
    assert Vindex.open(out.results[0].path).verify() == []
    assert rep.repos[1].repo == f"{REPO}-embed"


@pytest.mark.slow  # tens of seconds in-process (tests/conftest.py: the tiers)
def test_pull_preset_all_slices_and_collection(hub, vindex, tmp_path):
    rep = _publish(hub, vindex)
    got = pull(REPO, preset="embed", output=tmp_path / "embed", endpoint=hub.url, token=hub.token, log=quiet)
    path = got.results[0].path
    assert path == tmp_path / "embed"
    assert {f.name for f in path.iterdir() if f.is_file()} >= {"index.json", "embeddings.bin", "tokenizer.json",
                                                                "norms.bin", "weight_manifest.json"}
    assert Vindex.open(path).verify() == []
    # A pulled sibling maps back to its base and its companions.
    hinted = {name for _, name in got.siblings}
    assert REPO in hinted and f"{REPO}-server" in hinted and f"{REPO}-embed" not in hinted

    allp = pull(REPO, all_slices=True, output=tmp_path / "all", endpoint=hub.url, token=hub.token, log=quiet)
    assert [r.repo for r in allp.results] == [REPO] + [f"{REPO}-{p}" for p in DEFAULT_SLICES]
    assert all(r.error is None and Vindex.open(r.path).verify() == [] for r in allp.results)

    slug = rep.collections["model"].rsplit("/collections/", 1)[1]
    col = pull(None, collection=slug, output=tmp_path / "col", endpoint=hub.url, token=hub.token, log=quiet)
    assert len(col.results) == 6 and all(r.error is None for r in col.results)


def test_pulled_embed_preset_is_served_by_larql_embed(hub, vindex, tmp_path):
    import httpx
    import numpy as np

    from tests import _inproc as inproc

    _publish(hub, vindex, slices=["embed"], collections=[])
    got = pull(REPO, preset="embed", output=tmp_path / "embed", endpoint=hub.url, token=hub.token, log=quiet)
    folder = got.results[0].path
    with inproc.embed({"m": folder}, lm_head_cache=tmp_path / "lmc") as srv:
        inproc.wait_ready(srv)
        row = httpx.get(f"{srv.url}/v1/embed/5", headers={"Accept": "application/json"}, timeout=30).json()
        want = Vindex.open(vindex).embeddings()[5].astype(np.float32) * np.float32(Vindex.open(vindex).embed_scale)
        np.testing.assert_allclose(row["embedding"], want, rtol=0, atol=1e-6)
        r = httpx.post(f"{srv.url}/v1/logits", json={"residual": [0.1] * row["hidden_size"], "top_k": 3}, timeout=30)
        assert r.status_code == 200 and len(r.json()["top_k"]) == 3


def test_interrupted_pull_resumes_and_verifies(hub, vindex, tmp_path, monkeypatch):
    from huggingface_hub import constants as hf_constants

    _publish(hub, vindex, slices=[], collections=[])
    # The client keeps whole chunks only; small chunks let a cut file resume with a Range request.
    monkeypatch.setattr(hf_constants, "DOWNLOAD_CHUNK_SIZE", 1024)
    size = (vindex / "embeddings.bin").stat().st_size
    hub.fail_next_download_after("*embeddings.bin", size // 2)
    try:
        out = pull(REPO, output=tmp_path / "p", endpoint=hub.url, token=hub.token, log=quiet, hints=False)
    except HubError:
        out = pull(REPO, output=tmp_path / "p", endpoint=hub.url, token=hub.token, log=quiet, hints=False)
    assert Vindex.open(out.results[0].path).verify() == []
    ranged = [r for r in hub.requests_matching("GET", r"embeddings\.bin") if r.header("Range")]
    assert ranged, "the second attempt did not resume with a Range request"


def test_bad_inputs_write_nothing(hub, vindex, tmp_path):
    with pytest.raises(SliceError, match="unknown preset"):
        _publish(hub, vindex, slices=["nope"])
    with pytest.raises(SliceError, match="unknown preset"):
        pull(REPO, preset="nope", endpoint=hub.url, token=hub.token, log=quiet)
    (tmp_path / "noindex").mkdir()
    with pytest.raises(VindexError, match="missing index.json"):
        _publish(hub, tmp_path / "noindex")
    for bad in ("test-user/../x", "test-user/a b", "no-owner", "test-user/x?y", "/abs/x"):
        with pytest.raises(HubError, match="invalid repo id"):
            _publish(hub, vindex, repo=bad)
        with pytest.raises(HubError, match="invalid repo id"):
            pull(bad, endpoint=hub.url, token=hub.token, log=quiet)
    assert [r for r in hub.requests if r.method in WRITES] == []
    assert hub.collections() == []


@pytest.mark.parametrize("evil", ["../x", "/etc/passwd", "a/../../b"])
def test_unsafe_remote_listing_is_refused(hub, vindex, tmp_path, evil):
    _publish(hub, vindex, slices=[], collections=[])
    hub.inject_tree_entry(REPO, evil, content=b"pwned")
    out = tmp_path / "out"
    with pytest.raises(HubError, match="unsafe path"):
        pull(REPO, output=out, endpoint=hub.url, token=hub.token, log=quiet)
    assert not out.exists()
    assert not (tmp_path / "x").exists() and not (tmp_path / "b").exists()


@pytest.mark.parametrize("status,match", [(401, "not authorized"), (404, "not found")])
def test_server_errors_are_clear(hub, vindex, tmp_path, status, match):
    _publish(hub, vindex, slices=[], collections=[])
    hub.respond_with("GET", r"/api/datasets/", status, error_code="RepoNotFound" if status == 404 else None)
    with pytest.raises(HubError, match=match):
        pull(REPO, output=tmp_path / "o", endpoint=hub.url, token=hub.token, log=quiet)
    assert not (tmp_path / "o").exists()


@pytest.mark.slow  # tens of seconds in-process (tests/conftest.py: the tiers)
def test_cli_never_prints_the_token(hub, vindex, tmp_path, hf_env, monkeypatch):
    for k, v in {"HF_TOKEN": hub.token, "HF_ENDPOINT": hub.url}.items():
        monkeypatch.setenv(k, v)
    r = slicer("publish", str(vindex), "--repo", REPO, "--slices", "embed")
    assert r.returncode == 0, r.stderr
    assert hub.token not in r.stdout + r.stderr
    assert "collection model" in r.stdout and f"{REPO}-embed" in r.stdout
    r = slicer("pull", REPO, "--preset", "embed", "-o", str(tmp_path / "e"))
    assert r.returncode == 0, r.stderr
    assert "Also available" in r.stdout and hub.token not in r.stdout + r.stderr
    monkeypatch.setenv("HF_TOKEN", "wrong-token")
    r = slicer("publish", str(vindex), "--repo", REPO, "--slices", "none")
    assert r.returncode == 1 and "not authorized" in r.stderr and "Traceback" not in r.stderr
    assert "wrong-token" not in r.stdout + r.stderr
    # The token as a file (a mounted secret), flag and env twin alike.
    token = tmp_path / "token"
    token.write_text(hub.token + "\n")
    r = slicer("publish", str(vindex), "--repo", REPO, "--slices", "none", "--hf-token-file", str(token))
    assert r.returncode == 0, r.stderr
    monkeypatch.setenv("LARQL_HF_TOKEN_FILE", str(token))
    r = slicer("publish", str(vindex), "--repo", REPO, "--slices", "none")
    assert r.returncode == 0 and hub.token not in r.stdout + r.stderr


@pytest.mark.slow
def test_publish_real_gemma_default_slices(hub, gemma_f16, tmp_path):
    """Gemma 3 270M with the default slices: 6 repos and 3 collections; republishing sends no LFS bytes."""
    rep = publish(gemma_f16, "test-user/gemma-3-270m-vindex", endpoint=hub.url, token=hub.token, log=quiet,
                  tmp_dir=tmp_path)
    assert len(rep.repos) == 6 and len(hub.collections()) == 3
    titles = sorted(c["title"] for c in hub.collections())
    assert titles == ["Gemma 3 270M — LARQL Vindex", "Gemma Family — LARQL Vindexes", "LARQL Vindex Library"]
    total = hub.lfs_bytes_uploaded()
    hub.clear_requests()
    publish(gemma_f16, "test-user/gemma-3-270m-vindex", endpoint=hub.url, token=hub.token, log=quiet, tmp_dir=tmp_path)
    assert hub.lfs_bytes_uploaded() == 0
    assert total > 1_000_000_000  # six repos of a 525 MB vindex went up the first time


def test_publish_without_a_token_says_so_before_any_network(vindex, hf_env):
    """With no token `publish` retried a Hub it could not reach for ~27 s, then blamed the network."""
    from tests._grid import free_port

    r = slicer("publish", str(vindex), "--repo", REPO, "--endpoint", f"http://127.0.0.1:{free_port()}")
    assert r.returncode == 1, r.stderr
    assert "needs a Hub token" in r.stderr and "HF_TOKEN" in r.stderr and "hf auth login" in r.stderr
    assert "could not be reached" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_dry_run_fails_clearly_when_the_hub_cannot_be_reached(vindex, hf_env):
    """`publish --dry-run` with no Hub printed a whole upload plan (`would upload 12 files, skip 0`)
    and exited 0, as if the Hub were empty. A Hub it cannot list is an error, not an empty repo."""
    from tests._grid import free_port

    r = slicer("publish", str(vindex), "--repo", REPO, "--dry-run", "--endpoint", f"http://127.0.0.1:{free_port()}")
    assert r.returncode == 1, r.stdout
    assert "would upload" not in r.stdout
    assert "could not be reached" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
