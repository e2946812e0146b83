"""The Hub-protocol test server, driven by the unmodified `huggingface_hub` client (and raw HTTP where LARQL
speaks the protocol itself). Fast: no model weights, a few hundred KB of random bytes."""

from __future__ import annotations

import base64
import hashlib
import json
import os
from pathlib import Path

import httpx
import pytest
from huggingface_hub import (
    CommitOperationAdd,
    CommitOperationDelete,
    HfApi,
    hf_hub_download,
    snapshot_download,
)
from huggingface_hub import constants as hf_constants
from huggingface_hub.errors import (
    EntryNotFoundError,
    HfHubHTTPError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.hf_api import RepoFile, RepoFolder

from larql_edge.testing.hubserver import HubServer, git_blob_sha1, local_only_client  # noqa: F401

pytestmark = pytest.mark.timeout(120)

NS = "test-user"
DS = f"{NS}/gemma-vindex"
BIG = 300_000  # "large" binary: goes through LFS


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# --------------------------------------------------------------------------- fixtures
@pytest.fixture
def api(hub):
    return HfApi(endpoint=hub.url, token=hub.token)


@pytest.fixture
def cache_dir(tmp_path):
    return tmp_path / "cache"


@pytest.fixture
def vindex_dir(tmp_path):
    """A tiny vindex-shaped folder: one large binary (LFS), small text files (regular), a subfolder."""
    root = tmp_path / "vindex"
    (root / "sub").mkdir(parents=True)
    files = {
        "gate_vectors.bin": os.urandom(BIG),
        "index.json": json.dumps({"version": 2, "model": "google/gemma-3-270m"}).encode(),
        "tokenizer.json": b'{"model": {"type": "BPE"}}',
        "sub/notes.txt": b"hello vindex\n",
    }
    for rel, data in files.items():
        (root / rel).write_bytes(data)
    return root, files


def seed_dataset(api, hub, vindex_dir):
    root, files = vindex_dir
    with hub.expect_requests(method="POST", path_regex=r"/api/repos/create$"):
        api.create_repo(DS, repo_type="dataset")
    with hub.expect_requests(method="POST", path_regex=r"/commit/main$"):
        info = api.upload_folder(folder_path=root, repo_id=DS, repo_type="dataset")
    return info, files


# --------------------------------------------------------------------------- repos
def test_create_repo_dataset_and_model(api, hub):
    with hub.expect_requests(method="POST", path_regex=r"^/api/repos/create$"):
        url = api.create_repo(DS, repo_type="dataset")
    assert url.repo_id == DS and url.repo_type == "dataset"
    assert url == f"{hub.url}/datasets/{DS}"

    with hub.expect_requests(method="POST", path_regex=r"^/api/repos/create$"):
        murl = api.create_repo(f"{NS}/gemma-model")
    assert murl.repo_type == "model" and murl == f"{hub.url}/{NS}/gemma-model"

    # exist_ok: the server answers 409 (with the url), the client swallows it
    with hub.expect_requests(method="POST", path_regex=r"^/api/repos/create$") as seen:
        assert api.create_repo(DS, repo_type="dataset", exist_ok=True).repo_id == DS
    assert [r.status for r in seen] == [409]
    with pytest.raises(HfHubHTTPError) as exc:
        api.create_repo(DS, repo_type="dataset")
    assert exc.value.response.status_code == 409

    with hub.expect_requests(path_regex=rf"^/api/datasets/{DS}/revision/main$"):
        info = api.dataset_info(DS, revision="main")
    assert info.id == DS and len(info.sha) == 40
    assert [s.rfilename for s in info.siblings] == [".gitattributes"]
    assert info.xetEnabled is False
    with hub.expect_requests(path_regex=rf"^/api/models/{NS}/gemma-model$"):
        assert api.model_info(f"{NS}/gemma-model").id == f"{NS}/gemma-model"

    # repo type matters; unknown repos and revisions map to the client's typed errors
    assert api.repo_exists(DS, repo_type="dataset")
    assert not api.repo_exists(DS, repo_type="model")
    with pytest.raises(RepositoryNotFoundError):
        api.dataset_info(f"{NS}/nope")
    with pytest.raises(RevisionNotFoundError):
        api.dataset_info(DS, revision="no-such-branch")
    assert hub.repo(DS) is not None and hub.repo(f"{NS}/gemma-model", repo_type="model") is not None


def test_head_repo_probe_and_error_headers(api, hub):
    """LARQL probes siblings with `HEAD /api/datasets/{repo}`; errors carry the X-Error-Code the client keys on."""
    api.create_repo(DS, repo_type="dataset")
    with httpx.Client() as client:
        ok = client.head(f"{hub.url}/api/datasets/{DS}")
        missing = client.head(f"{hub.url}/api/datasets/{NS}/missing")
        bad_rev = client.get(f"{hub.url}/api/datasets/{DS}/revision/nope")
        no_file = client.head(f"{hub.url}/datasets/{DS}/resolve/main/nope.bin")
    assert ok.status_code == 200 and ok.content == b""
    assert missing.status_code == 404 and missing.headers["x-error-code"] == "RepoNotFound"
    assert bad_rev.status_code == 404 and bad_rev.headers["x-error-code"] == "RevisionNotFound"
    assert no_file.status_code == 404 and no_file.headers["x-error-code"] == "EntryNotFound"
    assert len(no_file.headers["x-repo-commit"]) == 40
    assert bad_rev.json()["error"]


# --------------------------------------------------------------------------- upload
def test_upload_folder_lfs_and_regular_files(api, hub, vindex_dir):
    info, files = seed_dataset(api, hub, vindex_dir)
    assert len(info.oid) == 40 and info.repo_url.repo_id == DS

    # the big binary went through preupload -> LFS batch -> PUT -> verify, the text files inline in the commit
    assert hub.lfs_bytes_uploaded() == BIG
    assert len(hub.lfs_uploads()) == 1
    assert hub.requests_matching("POST", rf"^/datasets/{DS}\.git/info/lfs/objects/verify$", status=200)
    stored = hub.files(DS)
    assert stored["gate_vectors.bin"].lfs and not stored["index.json"].lfs and not stored["sub/notes.txt"].lfs

    with hub.expect_requests(method="GET", path_regex=rf"^/api/datasets/{DS}/tree/main$"):
        tree = list(api.list_repo_tree(DS, repo_type="dataset", recursive=True))
    by_path = {e.path: e for e in tree}
    assert isinstance(by_path["sub"], RepoFolder)
    gate = by_path["gate_vectors.bin"]
    assert isinstance(gate, RepoFile)
    assert gate.lfs is not None and gate.lfs.sha256 == sha256(files["gate_vectors.bin"])
    assert gate.lfs.size == gate.size == BIG and gate.lfs.pointer_size > 100
    for rel in ("index.json", "tokenizer.json", "sub/notes.txt"):
        assert by_path[rel].lfs is None
        assert by_path[rel].blob_id == git_blob_sha1(files[rel])  # regular files: oid = git blob sha1

    # non-recursive listing of a subfolder, and repo info with file metadata
    assert [e.path for e in api.list_repo_tree(DS, "sub", repo_type="dataset")] == ["sub/notes.txt"]
    siblings = {s.rfilename: s for s in api.dataset_info(DS, files_metadata=True).siblings}
    assert siblings["gate_vectors.bin"].lfs.sha256 == sha256(files["gate_vectors.bin"])
    assert hub.file_bytes(DS, "gate_vectors.bin") == files["gate_vectors.bin"]


def test_second_identical_commit_uploads_zero_lfs_bytes(api, hub, vindex_dir):
    root, files = vindex_dir
    seed_dataset(api, hub, vindex_dir)
    head = hub.commits(DS)[0].oid
    uploaded = hub.lfs_bytes_uploaded()

    # same folder again: preupload reports the remote oids, the client drops every unchanged file (no commit)
    hub.clear_requests()
    with hub.expect_requests(method="POST", path_regex=r"/preupload/main$"):
        api.upload_folder(folder_path=root, repo_id=DS, repo_type="dataset")
    assert hub.lfs_bytes_uploaded() == 0 and uploaded == BIG
    assert not hub.requests_matching("POST", r"/commit/")
    assert hub.commits(DS)[0].oid == head

    # same bytes under a new name: the batch API answers "already stored" (no actions) -> no PUT, but a commit
    with hub.expect_requests(method="POST", path_regex=r"\.git/info/lfs/objects/batch$"):
        info = api.create_commit(
            DS,
            [CommitOperationAdd("copy_of_gate.bin", files["gate_vectors.bin"])],
            commit_message="same content, new path",
            repo_type="dataset",
        )
    assert hub.lfs_bytes_uploaded() == 0
    assert not hub.requests_matching("PUT", r"^/_lfs/upload/")
    assert hub.files(DS, revision=info.oid)["copy_of_gate.bin"].sha256 == sha256(files["gate_vectors.bin"])


def test_commit_history_delete_and_old_revisions(api, hub, vindex_dir, cache_dir):
    info, files = seed_dataset(api, hub, vindex_dir)
    first = info.oid
    second = api.create_commit(
        DS,
        [CommitOperationDelete("sub/notes.txt"), CommitOperationAdd("index.json", b'{"version": 3}')],
        commit_message="v3",
        repo_type="dataset",
    ).oid
    commits = api.list_repo_commits(DS, repo_type="dataset")
    assert [c.commit_id for c in commits[:2]] == [second, first] and commits[0].title == "v3"
    assert len(commits) == 3  # + the initial commit
    assert "sub/notes.txt" not in api.list_repo_files(DS, repo_type="dataset")
    refs = api.list_repo_refs(DS, repo_type="dataset")
    assert refs.branches[0].name == "main" and refs.branches[0].target_commit == second

    # the old commit is still readable, by full sha
    old = hf_hub_download(DS, "sub/notes.txt", repo_type="dataset", revision=first, endpoint=hub.url,
                          token=hub.token, cache_dir=cache_dir)
    assert Path(old).read_bytes() == files["sub/notes.txt"]
    new = hf_hub_download(DS, "index.json", repo_type="dataset", endpoint=hub.url, token=hub.token,
                          cache_dir=cache_dir)
    assert Path(new).read_bytes() == b'{"version": 3}'
    with pytest.raises(EntryNotFoundError):
        hf_hub_download(DS, "sub/notes.txt", repo_type="dataset", endpoint=hub.url, token=hub.token,
                        cache_dir=cache_dir)
    with pytest.raises(EntryNotFoundError):  # deleting a missing file is the Hub's EntryNotFound
        api.delete_file("does/not/exist.txt", DS, repo_type="dataset")


def test_preupload_decides_lfs_for_binary_large_and_gitattributes(hub):
    hub.create_repo(DS)
    s = lambda data: base64.b64encode(data[:512]).decode()  # noqa: E731
    payload = {
        "files": [
            {"path": "small.txt", "size": 5, "sample": s(b"hello")},
            {"path": "small.raw", "size": 4, "sample": s(b"\x00\x01\x02\x03")},
            {"path": "weights.bin", "size": 3, "sample": s(b"abc")},  # *.bin in .gitattributes
            {"path": "huge.json", "size": 20 * 1024 * 1024, "sample": s(b"{}")},
            {"path": "empty.bin", "size": 0, "sample": ""},
        ]
    }
    r = httpx.post(f"{hub.url}/api/datasets/{DS}/preupload/main", json=payload,
                   headers={"Authorization": f"Bearer {hub.token}"})
    assert r.status_code == 200
    modes = {f["path"]: f["uploadMode"] for f in r.json()["files"]}
    assert modes == {"small.txt": "regular", "small.raw": "lfs", "weights.bin": "lfs", "huge.json": "lfs",
                     "empty.bin": "regular"}
    assert all(f["shouldIgnore"] is False for f in r.json()["files"])


# --------------------------------------------------------------------------- download
def test_hf_hub_download_and_snapshot_download_get_identical_bytes(api, hub, vindex_dir, tmp_path):
    info, files = seed_dataset(api, hub, vindex_dir)
    for rel, data in files.items():
        with hub.expect_requests(method="HEAD", path_regex=rf"/datasets/{DS}/resolve/main/{rel}$"):
            path = hf_hub_download(DS, rel, repo_type="dataset", endpoint=hub.url, token=hub.token,
                                   cache_dir=tmp_path / "c1")
        assert Path(path).read_bytes() == data
    assert hub.bytes_downloaded("gate_vectors.bin") == BIG

    with hub.expect_requests(path_regex=rf"^/api/datasets/{DS}/tree/{info.oid}$"):
        snap = Path(snapshot_download(DS, repo_type="dataset", endpoint=hub.url, token=hub.token,
                                      cache_dir=tmp_path / "c2"))
    assert snap.name == info.oid
    for rel, data in files.items():
        assert (snap / rel).read_bytes() == data
    local = Path(snapshot_download(DS, repo_type="dataset", endpoint=hub.url, token=hub.token,
                                   local_dir=tmp_path / "local"))
    assert all((local / rel).read_bytes() == data for rel, data in files.items())

    # a model repo works the same way (no "datasets/" prefix anywhere)
    api.create_repo(f"{NS}/m")
    api.upload_file(path_or_fileobj=files["gate_vectors.bin"], path_in_repo="w.bin", repo_id=f"{NS}/m")
    with hub.expect_requests(method="GET", path_regex=rf"^/{NS}/m/resolve/main/w\.bin$"):
        p = hf_hub_download(f"{NS}/m", "w.bin", endpoint=hub.url, token=hub.token, cache_dir=tmp_path / "c3")
    assert Path(p).read_bytes() == files["gate_vectors.bin"]


def test_resolve_headers_ranges_and_no_xet(api, hub, vindex_dir):
    info, files = seed_dataset(api, hub, vindex_dir)
    gate = files["gate_vectors.bin"]
    url = f"{hub.url}/datasets/{DS}/resolve/main/gate_vectors.bin"
    with httpx.Client() as client:
        head = client.head(url)
        small = client.head(f"{hub.url}/datasets/{DS}/resolve/main/index.json")
        part = client.get(url, headers={"Range": "bytes=1000-1999"})
        tail = client.get(url, headers={"Range": "bytes=-10"})
        open_ended = client.get(url, headers={"Range": f"bytes={BIG - 5}-"})
        bad = client.get(url, headers={"Range": f"bytes={BIG}-"})
    h = head.headers
    assert head.status_code == 200 and int(h["content-length"]) == BIG
    assert h["x-repo-commit"] == info.oid
    assert h["x-linked-etag"].strip('"') == sha256(gate) and int(h["x-linked-size"]) == BIG
    assert h["etag"].strip('"') == sha256(gate) and h["accept-ranges"] == "bytes"
    assert small.headers["etag"].strip('"') == git_blob_sha1(files["index.json"])
    assert "x-linked-etag" not in small.headers
    assert part.status_code == 206 and part.content == gate[1000:2000]
    assert part.headers["content-range"] == f"bytes 1000-1999/{BIG}"
    assert tail.status_code == 206 and tail.content == gate[-10:]
    assert open_ended.content == gate[-5:]
    assert bad.status_code == 416 and bad.headers["content-range"] == f"bytes */{BIG}"
    # Xet is never advertised: the client stays on plain HTTP/LFS
    for r in (head, small, part):
        assert not [k for k in r.headers if k.lower().startswith("x-xet")]
    assert api.dataset_info(DS).xetEnabled is False
    assert not hub.requests_matching(None, r"xet")


def test_download_resumes_with_range_after_cut(api, hub, vindex_dir, cache_dir, monkeypatch):
    info, files = seed_dataset(api, hub, vindex_dir)
    # http_get only resumes from bytes it has flushed to disk, i.e. whole DOWNLOAD_CHUNK_SIZE chunks (10 MB by
    # default); use small chunks so a cut 200 KB into a 300 KB file leaves something to resume from.
    monkeypatch.setattr(hf_constants, "DOWNLOAD_CHUNK_SIZE", 64 * 1024)
    hub.fail_next_download_after("gate_vectors.bin", 200_000)
    hub.clear_requests()
    path = hf_hub_download(DS, "gate_vectors.bin", repo_type="dataset", endpoint=hub.url, token=hub.token,
                           cache_dir=cache_dir)
    assert Path(path).read_bytes() == files["gate_vectors.bin"]

    gets = hub.requests_matching("GET", r"/resolve/main/gate_vectors\.bin$")
    assert [g.fault for g in gets] == ["cut", None]
    cut, resumed = gets
    assert cut.status == 200 and cut.response_size == 200_000
    assert resumed.status == 206 and resumed.header("range") == "bytes=196608-"  # 3 whole 64 KiB chunks kept
    assert resumed.response_size == BIG - 196608


def test_server_error_once_is_retried_or_surfaces(api, hub, vindex_dir, cache_dir):
    info, files = seed_dataset(api, hub, vindex_dir)

    # API calls made through http_backoff (tree listing, preupload, LFS batch) retry a 500
    hub.fail_next("GET", r"/tree/", 500)
    assert len(list(api.list_repo_tree(DS, repo_type="dataset", recursive=True))) == 6
    assert [r.status for r in hub.requests_matching("GET", r"/tree/")][-2:] == [500, 200]

    # hf_hub_download's metadata HEAD retries once more on 5xx before giving up
    hub.fail_next("HEAD", r"/resolve/main/index\.json$", 503)
    path = hf_hub_download(DS, "index.json", repo_type="dataset", endpoint=hub.url, token=hub.token,
                           cache_dir=cache_dir)
    assert Path(path).read_bytes() == files["index.json"]
    assert [r.status for r in hub.requests_matching("HEAD", r"index\.json$")] == [503, 200]

    # the commit POST is not retried (it is not idempotent): the 500 surfaces and the repo is unchanged
    head = hub.commits(DS)[0].oid
    hub.fail_next("POST", r"/commit/main$", 500, message="boom")
    with pytest.raises(HfHubHTTPError) as exc:
        api.upload_file(path_or_fileobj=b"x", path_in_repo="x.txt", repo_id=DS, repo_type="dataset")
    assert exc.value.response.status_code == 500 and "boom" in str(exc.value)
    assert hub.commits(DS)[0].oid == head
    # ...and it was one-shot
    api.upload_file(path_or_fileobj=b"x", path_in_repo="x.txt", repo_id=DS, repo_type="dataset")
    assert hub.commits(DS)[0].oid != head


def test_fixed_status_faults(api, hub, vindex_dir, cache_dir):
    seed_dataset(api, hub, vindex_dir)
    fault = hub.respond_with("GET", rf"^/api/datasets/{DS}(/revision/.*)?$", 404, error_code="RepoNotFound")
    for _ in range(2):
        with pytest.raises(RepositoryNotFoundError):
            api.dataset_info(DS)
    assert fault.hits == 2
    hub.clear_faults()
    assert api.dataset_info(DS).id == DS

    hub.respond_with("HEAD", r"/resolve/", 401)
    with pytest.raises(HfHubHTTPError) as exc:
        hf_hub_download(DS, "index.json", repo_type="dataset", endpoint=hub.url, token=hub.token, cache_dir=cache_dir)
    assert exc.value.response.status_code == 401


# --------------------------------------------------------------------------- auth
def test_wrong_or_missing_token_gets_401(hub, vindex_dir, cache_dir):
    good = HfApi(endpoint=hub.url, token=hub.token)
    good.create_repo(DS, repo_type="dataset")
    wrong = HfApi(endpoint=hub.url, token="not-the-token")
    anonymous = HfApi(endpoint=hub.url, token=False)

    with hub.expect_requests(method="POST", path_regex=r"^/api/repos/create$") as seen:
        with pytest.raises(HfHubHTTPError) as exc:
            wrong.create_repo(f"{NS}/other", repo_type="dataset")
    assert exc.value.response.status_code == 401
    assert "Invalid credentials" in str(exc.value)
    assert seen[0].auth == "invalid" and seen[0].header("authorization") == "<redacted>"

    with pytest.raises(HfHubHTTPError) as exc:
        anonymous.upload_file(path_or_fileobj=b"hi", path_in_repo="a.txt", repo_id=DS, repo_type="dataset")
    assert exc.value.response.status_code == 401
    with pytest.raises(HfHubHTTPError) as exc:
        wrong.whoami()
    assert exc.value.response.status_code == 401
    assert good.whoami()["name"] == hub.user

    # reads: anonymous is fine, a wrong token is refused (as on the Hub)
    assert anonymous.dataset_info(DS).id == DS
    with pytest.raises(HfHubHTTPError) as exc:
        hf_hub_download(DS, ".gitattributes", repo_type="dataset", endpoint=hub.url, token="not-the-token",
                        cache_dir=cache_dir)
    assert exc.value.response.status_code == 401
    # the token value never reaches the log
    assert all("test-token" not in json.dumps(r.headers) for r in hub.requests)


def test_private_repos_and_token_required_for_reads(hf_env, tmp_path):
    with HubServer(require_token_for_reads=False) as hub, local_only_client() as blocked:
        owner = HfApi(endpoint=hub.url, token=hub.token)
        owner.create_repo(DS, repo_type="dataset", private=True)
        assert owner.dataset_info(DS).private is True
        with pytest.raises(RepositoryNotFoundError):  # hidden from anonymous callers, as on the Hub
            HfApi(endpoint=hub.url, token=False).dataset_info(DS)
        assert blocked == []
    with HubServer(require_token_for_reads=True) as hub, local_only_client() as blocked:
        hub.commit_files(DS, {"a.txt": b"a"})
        with pytest.raises(HfHubHTTPError) as exc:
            hf_hub_download(DS, "a.txt", repo_type="dataset", endpoint=hub.url, token=False,
                            cache_dir=tmp_path / "c")
        assert exc.value.response.status_code == 401
        path = hf_hub_download(DS, "a.txt", repo_type="dataset", endpoint=hub.url, token=hub.token,
                               cache_dir=tmp_path / "c")
        assert Path(path).read_bytes() == b"a"
        assert blocked == []


# --------------------------------------------------------------------------- collections
def test_collections_create_list_add_get(api, hub):
    api.create_repo(DS, repo_type="dataset")
    api.create_repo(f"{DS}-client", repo_type="dataset")

    with hub.expect_requests(method="POST", path_regex=r"^/api/collections$"):
        coll = api.create_collection("Gemma 3 270M — LARQL Vindex", namespace=NS, description="all slices")
    assert coll.slug.startswith(f"{NS}/gemma-3-270m-larql-vindex-") and coll.items == []
    # same title again: 409 carrying the slug; exists_ok returns the existing collection
    with pytest.raises(HfHubHTTPError) as exc:
        api.create_collection("gemma 3 270m — larql vindex", namespace=NS)
    assert exc.value.response.status_code == 409 and exc.value.response.json()["slug"] == coll.slug
    assert api.create_collection("Gemma 3 270M — LARQL Vindex", namespace=NS, exists_ok=True).slug == coll.slug

    with hub.expect_requests(method="GET", path_regex=r"^/api/collections$"):
        listed = list(api.list_collections(owner=NS))
    assert [c.slug for c in listed] == [coll.slug]

    with hub.expect_requests(method="POST", path_regex=rf"^/api/collections/{coll.slug}/items$"):
        after = api.add_collection_item(coll.slug, DS, "dataset", note="full vindex")
    assert [(i.item_id, i.item_type, i.note) for i in after.items] == [(DS, "dataset", "full vindex")]
    api.add_collection_item(coll.slug, f"{DS}-client", "dataset")
    with pytest.raises(HfHubHTTPError) as exc:  # second add of the same item
        api.add_collection_item(coll.slug, DS, "dataset")
    assert exc.value.response.status_code == 409
    assert len(api.add_collection_item(coll.slug, DS, "dataset", exists_ok=True).items) == 2
    with pytest.raises(HfHubHTTPError) as exc:  # unknown repo
        api.add_collection_item(coll.slug, f"{NS}/missing", "dataset")
    assert exc.value.response.status_code == 404

    with hub.expect_requests(method="GET", path_regex=rf"^/api/collections/{coll.slug}$"):
        got = api.get_collection(coll.slug)
    assert [i.item_id for i in got.items] == [DS, f"{DS}-client"] and got.description == "all slices"

    api.delete_collection_item(coll.slug, got.items[0].item_object_id)
    assert [i.item_id for i in api.get_collection(coll.slug).items] == [f"{DS}-client"]
    api.delete_collection(coll.slug)
    with pytest.raises(HfHubHTTPError) as exc:
        api.get_collection(coll.slug)
    assert exc.value.response.status_code == 404


# --------------------------------------------------------------------------- malicious listings, pagination
def test_injected_tree_entries_reach_the_client(api, hub, vindex_dir, tmp_path):
    seed_dataset(api, hub, vindex_dir)
    hub.inject_tree_entry(DS, "../escape.txt", content=b"pwned")
    hub.inject_tree_entry(DS, "/etc/passwd", content=b"root:x:0:0")
    paths = [e.path for e in api.list_repo_tree(DS, repo_type="dataset", recursive=True)]
    assert "../escape.txt" in paths and "/etc/passwd" in paths
    assert "../escape.txt" in [s.rfilename for s in api.dataset_info(DS).siblings]

    # huggingface_hub 2.4 refuses such names; nothing lands outside the target directory
    local = tmp_path / "pulled"
    with pytest.raises(ValueError, match="Invalid filename"):
        snapshot_download(DS, repo_type="dataset", endpoint=hub.url, token=hub.token, local_dir=local)
    assert not (tmp_path / "escape.txt").exists()
    assert list(tmp_path.rglob("escape.txt")) == [] and list(tmp_path.rglob("passwd")) == []
    assert not hub.requests_matching("GET", r"/resolve/.*(escape\.txt|passwd)$")


def test_tree_pagination(hf_env, tmp_path):
    with HubServer(tree_page_size=2) as hub, local_only_client() as blocked:
        api = HfApi(endpoint=hub.url, token=hub.token)
        hub.commit_files(DS, {f"f{i}.txt": f"{i}".encode() for i in range(5)})
        paths = [e.path for e in api.list_repo_tree(DS, repo_type="dataset", recursive=True)]
        assert paths == [".gitattributes"] + [f"f{i}.txt" for i in range(5)]
        pages = hub.requests_matching("GET", r"/tree/main$")
        assert len(pages) == 3 and [p.query.get("cursor") for p in pages] == [None, ["2"], ["4"]]
        assert blocked == []


# --------------------------------------------------------------------------- LARQL's own wire calls
def test_larql_publish_and_collection_wire_protocol(hub):
    """The raw HTTP sequence LARQL's Rust publisher sends (crates/larql-vindex/src/format/huggingface.rs)."""
    auth = {"Authorization": f"Bearer {hub.token}"}
    lfs_headers = {**auth, "Accept": "application/vnd.git-lfs+json", "Content-Type": "application/vnd.git-lfs+json"}
    data = os.urandom(50_000)
    oid = sha256(data)
    with httpx.Client(base_url=hub.url) as c:
        # create without "organization": the namespace is the token's user; 409 when it exists
        body = {"name": "larql-vx", "type": "dataset", "private": False}
        assert c.post("/api/repos/create", json=body, headers=auth).status_code == 200
        assert c.post("/api/repos/create", json=body, headers=auth).status_code == 409
        repo = f"{hub.user}/larql-vx"
        assert c.get(f"/api/datasets/{repo}/tree/main?recursive=true", headers=auth).status_code == 200

        sample = base64.b64encode(data[:512]).decode()
        pre = c.post(f"/api/datasets/{repo}/preupload/main", headers=auth,
                     json={"files": [{"path": "gate_vectors.bin", "sample": sample, "size": len(data)}]})
        assert pre.json()["files"][0]["uploadMode"] == "lfs"
        batch = {"operation": "upload", "transfers": ["basic"], "hash_algo": "sha256",
                 "objects": [{"oid": oid, "size": len(data)}]}
        r = c.post(f"/datasets/{repo}.git/info/lfs/objects/batch", json=batch, headers=lfs_headers)
        actions = r.json()["objects"][0]["actions"]
        assert c.put(actions["upload"]["href"], content=data).status_code == 200  # presigned: no auth header
        assert c.post(actions["verify"]["href"], json={"oid": oid, "size": len(data)},
                      headers=lfs_headers).status_code == 200
        ndjson = "\n".join(json.dumps(x) for x in [
            {"key": "header", "value": {"summary": "Upload gate_vectors.bin"}},
            {"key": "lfsFile", "value": {"path": "gate_vectors.bin", "algo": "sha256", "oid": oid, "size": len(data)}},
        ]) + "\n"
        commit = c.post(f"/api/datasets/{repo}/commit/main", content=ndjson,
                        headers={**auth, "Content-Type": "application/x-ndjson"})
        assert commit.status_code == 200 and len(commit.json()["commitOid"]) == 40

        # skip-if-unchanged: the tree exposes lfs.oid; a second batch has no actions for the stored object
        tree = c.get(f"/api/datasets/{repo}/tree/main?recursive=true", headers=auth).json()
        assert {e["path"]: e.get("lfs", {}).get("oid") for e in tree}["gate_vectors.bin"] == oid
        again = c.post(f"/datasets/{repo}.git/info/lfs/objects/batch", json=batch, headers=lfs_headers).json()
        assert again["objects"][0] == {"oid": oid, "size": len(data)}
        assert c.head(f"/api/datasets/{repo}", headers=auth).status_code == 200

        # hf-hub (Rust) download metadata: X-Linked-Etag / X-Linked-Size on the first response, no redirect
        head = c.head(f"/datasets/{repo}/resolve/main/gate_vectors.bin", headers=auth)
        assert head.headers["x-linked-etag"].strip('"') == oid and head.headers["x-linked-size"] == str(len(data))

        # ensure_collection: list by user, create, add items (409 on re-add), fetch by slug
        assert c.get(f"/api/users/{hub.user}/collections?limit=100", headers=auth).json() == []
        created = c.post("/api/collections", headers=auth, json={
            "title": "LARQL Vindex Library", "namespace": hub.user, "private": False}).json()
        slug = created["slug"]
        listed = c.get(f"/api/users/{hub.user}/collections?limit=100", headers=auth).json()
        assert [(x["title"], x["slug"]) for x in listed] == [("LARQL Vindex Library", slug)]
        dup = c.post("/api/collections", headers=auth, json={"title": "larql vindex library", "namespace": hub.user})
        assert dup.status_code == 409 and dup.json()["slug"] == slug
        item = {"item": {"type": "dataset", "id": repo}, "note": "full"}
        assert c.post(f"/api/collections/{slug}/items", json=item, headers=auth).status_code == 200
        assert c.post(f"/api/collections/{slug}/item", json=item, headers=auth).status_code == 409
        got = c.get(f"/api/collections/{slug}", headers=auth).json()
        assert [(i["type"], i["id"]) for i in got["items"]] == [("dataset", repo)]
        assert c.get(f"/api/collections?owner={hub.user}").json()[0]["slug"] == slug
    assert hub.file_bytes(repo, "gate_vectors.bin") == data
