"""A local Hugging Face Hub for tests: speaks the HTTP API the unmodified `huggingface_hub` client uses.

    from larql_edge.testing.hubserver import HubServer

    with HubServer() as hub:                     # 127.0.0.1, ephemeral port, data in a temp dir
        api = HfApi(endpoint=hub.url, token=hub.token)
        api.create_repo("test-user/vx", repo_type="dataset")
        ...
        assert hub.lfs_bytes_uploaded() == 0
        hub.fail_next("POST", r"/preupload/", 500)
        hub.fail_next_download_after("*.bin", 1000)
        hub.corrupt_next_download("*.bin")       # one flipped byte, right length and headers
        slow = hub.throttle_downloads("*.bin", 100_000)   # bytes/s, until hub.remove_fault(slow)

Serves model and dataset repos (repo API, tree, preupload, NDJSON commit, Git LFS batch/upload/verify,
resolve with Range), collections and whoami. It never advertises Xet (no X-Xet-* headers, `xetEnabled: false`),
so clients must run with `HF_HUB_DISABLE_XET=1` (or `huggingface_hub.constants.HF_HUB_DISABLE_XET = True`)
to take the LFS path. Module map: `_server` (lifecycle, test API), `_routes` (URL routing), `_handler`
(HTTP plumbing, auth, faults, logging), `_api_repos` / `_api_lfs` / `_api_collections` (handlers),
`_storage` (repos, commits, blobs), `_collections`, `_faults`, `_recording`, `_guard` (`local_only_client`).
"""

from ._errors import HubError
from ._faults import DownloadCorruption, DownloadCut, DownloadThrottle, StatusFault
from ._guard import ForeignHostBlocked, local_only_client
from ._recording import RecordedRequest
from ._server import DEFAULT_TOKEN, DEFAULT_USER, HubServer
from ._storage import Commit, FileEntry, Repo, git_blob_sha1, lfs_pointer

__all__ = [
    "DEFAULT_TOKEN",
    "DEFAULT_USER",
    "Commit",
    "DownloadCorruption",
    "DownloadCut",
    "DownloadThrottle",
    "FileEntry",
    "ForeignHostBlocked",
    "HubError",
    "HubServer",
    "RecordedRequest",
    "Repo",
    "StatusFault",
    "git_blob_sha1",
    "lfs_pointer",
    "local_only_client",
]
