"""`HubServer`: the test server's lifecycle and its test-facing API (request log, faults, direct data access)."""

from __future__ import annotations

import base64
import fnmatch
import socket
import tempfile
import threading
from contextlib import contextmanager
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any, Iterator, Mapping

from ._api_collections import CollectionRoutes
from ._api_lfs import LfsRoutes
from ._api_repos import RepoRoutes
from ._collections import CollectionStore
from ._faults import DownloadCorruption, DownloadCut, DownloadThrottle, Faults, InjectedEntry, StatusFault
from ._recording import RecordedRequest, RequestLog, filter_requests
from ._state import HubState
from ._storage import DEFAULT_GITATTRIBUTES, Commit, FileEntry, Repo, Storage, is_binary_sample, matches_gitattributes

DEFAULT_TOKEN = "test-token"
DEFAULT_USER = "test-user"


class HubRequestHandler(RepoRoutes, LfsRoutes, CollectionRoutes):
    """One handler class with every route (the mixins share the plumbing of `BaseHubHandler`)."""


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], hub: HubState) -> None:
        self.hub = hub
        self._connections: set[socket.socket] = set()
        self._conn_lock = threading.Lock()
        super().__init__(address, HubRequestHandler)

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._conn_lock:
            self._connections.add(request)
        super().process_request(request, client_address)

    def shutdown_request(self, request: Any) -> None:
        with self._conn_lock:
            self._connections.discard(request)
        super().shutdown_request(request)

    def close_connections(self) -> None:
        """Close kept-alive client connections so their handler threads end."""
        with self._conn_lock:
            conns = list(self._connections)
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


class HubServer:
    """A local server speaking the Hugging Face Hub HTTP API used by the unmodified `huggingface_hub` client.

    Use as a context manager (or `start()`/`stop()`); point clients at `server.url`.
    `repo_type` arguments of the helpers default to "dataset" (larql-edge's default repo type).

    Args:
        token: the bearer token accepted for `user`; None disables authorization (any token is accepted).
            A wrong token is always answered 401; a missing one is 401 on writes (and whoami).
        require_token_for_reads: also answer 401 to anonymous reads.
        lfs_threshold: preupload answers "lfs" from this size on (also for binary samples and for paths
            matching a `filter=lfs` pattern of the repo's `.gitattributes`).
        tree_page_size: entries per tree page before a `Link: <...>; rel="next"` header (the Hub uses 1000).
        gitattributes: content of the `.gitattributes` of every new repo's initial commit (None: empty repo).
        root: where to keep data (default: a temp dir removed by `stop()`).
    """

    def __init__(
        self,
        *,
        token: str | None = DEFAULT_TOKEN,
        user: str = DEFAULT_USER,
        require_token_for_reads: bool = False,
        lfs_threshold: int = 10 * 1024 * 1024,
        tree_page_size: int = 1000,
        gitattributes: str | None = DEFAULT_GITATTRIBUTES,
        root: str | Path | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
    ) -> None:
        self._owns_root = root is None
        self._root = Path(tempfile.mkdtemp(prefix="hubserver-")) if root is None else Path(root)
        storage = Storage(self._root, initial_gitattributes=gitattributes)
        self._state = HubState(
            storage=storage,
            collections=CollectionStore(lambda t, i: storage.find_repo(t, i) is not None),
            faults=Faults(),
            log=RequestLog(),
            tokens={token: user} if token is not None else {},
            default_user=user,
            require_token_for_reads=require_token_for_reads,
            lfs_threshold=lfs_threshold,
            tree_page_size=tree_page_size,
        )
        self._address = (host, port)
        self._httpd: _HTTPServer | None = None
        self._thread: threading.Thread | None = None
        self.token = token
        self.user = user

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> "HubServer":
        if self._httpd is not None:
            return self
        self._httpd = _HTTPServer(self._address, self._state)
        host, port = self._httpd.server_address[:2]
        host = host.decode() if isinstance(host, bytes) else host
        self._state.base_url = f"http://{host}:{port}"
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05}, name=f"hubserver:{port}", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving and close client connections. The request log stays readable; the temp dir is removed."""
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.close_connections()
            self._httpd.server_close()
            if self._thread is not None:
                self._thread.join(timeout=5)
            self._httpd = None
            self._thread = None
        if self._owns_root:
            self._state.storage.cleanup()

    def __enter__(self) -> "HubServer":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    @property
    def url(self) -> str:
        """The endpoint to give clients, e.g. `HfApi(endpoint=server.url)`; `http://127.0.0.1:<port>`."""
        if not self._state.base_url or self._httpd is None:
            raise RuntimeError("HubServer is not running: call start() or use it as a context manager")
        return self._state.base_url

    # ------------------------------------------------------------------ auth
    def add_token(self, token: str, user: str) -> None:
        """Accept another bearer token, acting as `user` (enables authorization if the server had none)."""
        self._state.tokens[token] = user

    # ------------------------------------------------------------------ request log
    @property
    def requests(self) -> list[RecordedRequest]:
        return self._state.log.snapshot()

    def requests_matching(
        self, method: str | None = None, path_regex: str | None = None, *, status: int | None = None
    ) -> list[RecordedRequest]:
        """Requests whose method equals `method` (None/"*" = any) and whose decoded path `re.search`es `path_regex`."""
        return self._state.log.matching(method, path_regex, status=status)

    def clear_requests(self) -> None:
        self._state.log.clear()

    def lfs_uploads(self) -> list[RecordedRequest]:
        """Successful PUTs to LFS upload URLs."""
        return [r for r in self.requests_matching("PUT", r"^/_lfs/upload/") if 200 <= r.status < 300]

    def lfs_bytes_uploaded(self) -> int:
        """Total body bytes of successful LFS uploads."""
        return sum(r.body_size for r in self.lfs_uploads())

    def bytes_downloaded(self, path_glob: str = "*") -> int:
        """Total response bytes of file downloads (`/resolve/`) whose repo file path matches `path_glob`."""
        total = 0
        for r in self.requests_matching("GET", r"/resolve/"):
            file_path = r.path.split("/resolve/", 1)[1].split("/", 1)[-1]
            if fnmatch.fnmatchcase(file_path, path_glob):
                total += r.response_size
        return total

    @contextmanager
    def expect_requests(
        self, min_count: int = 1, method: str | None = None, path_regex: str | None = None
    ) -> Iterator[list[RecordedRequest]]:
        """Assert that the block made at least `min_count` (matching) requests to this server.

        Yields a list that is filled with the block's requests when it exits. Guards against a client call that
        silently went somewhere else (e.g. the public Hub) or never went out (served from a cache).
        """
        before = len(self._state.log)
        seen: list[RecordedRequest] = []
        yield seen
        new = self._state.log.snapshot()[before:]
        seen.extend(new)
        hits = filter_requests(new, method, path_regex)
        if len(hits) < min_count:
            what = f" {method or '*'} {path_regex or ''}".rstrip()
            raise AssertionError(
                f"expected >= {min_count} request(s){what} to the hub server, saw {len(hits)}: "
                + ", ".join(str(r) for r in new)
            )

    # ------------------------------------------------------------------ faults
    def fail_next(
        self, method: str | None, path_regex: str, status: int = 500, *, times: int = 1, message: str | None = None
    ) -> StatusFault:
        """Answer `status` to the next `times` requests matching (method, `re.search` on the decoded path)."""
        return self._state.faults.add_status(method, path_regex, status, times=times, message=message)

    def respond_with(
        self,
        method: str | None,
        path_regex: str,
        status: int,
        *,
        times: int | None = None,
        message: str | None = None,
        error_code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> StatusFault:
        """Answer a fixed `status` (with optional X-Error-Code) to matching requests until `clear_faults()`."""
        return self._state.faults.add_status(
            method, path_regex, status, times=times, message=message, code=error_code, headers=dict(headers or {})
        )

    def fail_next_download_after(self, path_glob: str, nbytes: int, *, times: int = 1) -> DownloadCut:
        """Cut the next `times` GET downloads of files matching `path_glob` after `nbytes` body bytes.

        The glob matches the file's path in the repo (`"*.bin"`) or the full request path. The response
        announces the full Content-Length, sends `nbytes`, then closes the connection.
        """
        return self._state.faults.add_cut(path_glob, nbytes, times=times)

    def corrupt_next_download(self, path_glob: str, *, times: int = 1) -> DownloadCorruption:
        """Serve the next `times` GET downloads of files matching `path_glob` with one byte flipped.

        The length, the headers (ETag, X-Linked-Etag) and the listing stay right: only the bytes are wrong,
        as after a fault in transit or in the Hub's storage. The glob matches like `fail_next_download_after`.
        """
        return self._state.faults.add_corruption(path_glob, times=times)

    def throttle_downloads(self, path_glob: str, bytes_per_second: int) -> DownloadThrottle:
        """Serve GET downloads of files matching `path_glob` at about `bytes_per_second` until the fault is
        removed (`remove_fault`) or `clear_faults()`: a slow link, so a test can interrupt a download midway."""
        return self._state.faults.add_throttle(path_glob, bytes_per_second)

    def remove_fault(self, fault: StatusFault | DownloadCut | DownloadCorruption | DownloadThrottle) -> None:
        """Disarm one fault returned by `fail_next`, `respond_with`, `fail_next_download_after`, ..."""
        self._state.faults.remove(fault)

    def inject_tree_entry(
        self, repo_id: str, path: str, *, repo_type: str = "dataset", content: bytes = b"", lfs: bool = False
    ) -> None:
        """List an extra file `path` (e.g. `../x`, `/etc/passwd`) in the repo's root/recursive tree and siblings.

        A `/resolve/` request for exactly that path serves `content`.
        """
        self._state.faults.inject(InjectedEntry(repo_type, repo_id, path, content, lfs))

    def clear_faults(self) -> None:
        self._state.faults.clear()

    # ------------------------------------------------------------------ direct data access (no HTTP)
    def create_repo(self, repo_id: str, *, repo_type: str = "dataset", private: bool = False) -> Repo:
        repo, _ = self._state.storage.create_repo(repo_type, repo_id, private=private, author=self.user)
        return repo

    def commit_files(
        self,
        repo_id: str,
        files: Mapping[str, bytes],
        *,
        repo_type: str = "dataset",
        lfs: bool | None = None,
        message: str = "Seed files",
        branch: str = "main",
    ) -> str:
        """Commit `files` directly (creating the repo if needed); returns the commit sha.

        `lfs=None` stores a file as LFS when it is binary, matches `.gitattributes` or reaches the LFS threshold.
        """
        storage = self._state.storage
        repo, _ = storage.create_repo(repo_type, repo_id, author=self.user)
        patterns = storage.lfs_patterns(repo.head(branch))
        ops = []
        for path, data in files.items():
            as_lfs = lfs
            if as_lfs is None:
                as_lfs = len(data) > 0 and (
                    len(data) >= self._state.lfs_threshold
                    or matches_gitattributes(path, patterns)
                    or is_binary_sample(data[:512])
                )
            if as_lfs:
                oid = storage.put_bytes(data)
                storage.add_lfs_object(repo, oid, len(data))
                ops.append({"key": "lfsFile", "value": {"path": path, "algo": "sha256", "oid": oid, "size": len(data)}})
            else:
                ops.append({"key": "file", "value": {"path": path, "encoding": "base64",
                                                     "content": base64.b64encode(data).decode()}})
        return storage.commit(repo, branch, ops, summary=message, author=self.user).oid

    def repo(self, repo_id: str, *, repo_type: str = "dataset") -> Repo | None:
        return self._state.storage.find_repo(repo_type, repo_id)

    def commits(self, repo_id: str, *, repo_type: str = "dataset", revision: str = "main") -> list[Commit]:
        """The repo's history from `revision`, newest first."""
        storage = self._state.storage
        repo = storage.get_repo(repo_type, repo_id)
        return repo.history(storage.resolve(repo, revision))

    def files(self, repo_id: str, *, repo_type: str = "dataset", revision: str = "main") -> dict[str, FileEntry]:
        """`path -> FileEntry` at `revision` (FileEntry has size, sha256, lfs, git_oid)."""
        storage = self._state.storage
        repo = storage.get_repo(repo_type, repo_id)
        return dict(storage.resolve(repo, revision).files)

    def file_bytes(self, repo_id: str, path: str, *, repo_type: str = "dataset", revision: str = "main") -> bytes:
        entry = self.files(repo_id, repo_type=repo_type, revision=revision)[path]
        return self._state.storage.read_blob(entry.sha256)

    def has_lfs_object(self, repo_id: str, sha256: str, *, repo_type: str = "dataset") -> bool:
        repo = self._state.storage.get_repo(repo_type, repo_id)
        return self._state.storage.repo_has_lfs_object(repo, sha256)

    def collections(self, owner: str | None = None) -> list[dict[str, Any]]:
        """Every collection (of `owner`), as the API's JSON."""
        recs = self._state.collections.list(owners=[owner] if owner else None)
        return [CollectionStore.to_json(r) for r in recs]

