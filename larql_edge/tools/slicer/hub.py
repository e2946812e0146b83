"""The Hub boundary: the one place that talks to ``huggingface_hub`` and translates its errors.

Everything above this module (publish, pull) sees the typed `HubError` family of
`larql_edge.errors` with a clear one-line message. `FOREIGN` maps every exception class of
``huggingface_hub.errors`` explicitly (a test walks that module and fails on a class missing here,
so a new huggingface_hub release cannot slip an unmapped error past us); an exception resolves to
the entry of the first class in its MRO, so ``GatedRepoError`` (a ``RepositoryNotFoundError``
subclass in huggingface_hub 2.x) is reported as gated, not as missing. HTTP errors without a more
specific class map by status. Anything else raised from inside huggingface_hub's own code (a
``TypeError`` on an answer it did not expect, an assertion) is the library failing, not us: it
becomes a one-line `HubError` too. The token comes from the caller, ``HF_TOKEN`` or the library's
login, and never appears in a message.

Downloads (used by pull) go two ways, both through huggingface_hub's own URL, header and session
helpers. Git-stored files (the Hub keeps them under 10 MB) go through the unmodified
``hf_hub_download``. Git LFS files (the weights) go through `Hub.fetch`, a Range-resuming fetch:
huggingface_hub 2.4 resumes a download only inside one call and only from whole 10 MB chunks, and it
writes each download to a process-unique ``<name>.<uuid>.incomplete`` that it deletes on failure, so
nothing a failed or interrupted download fetched is ever reused. `Hub.fetch` appends to one
partial per file and content, which the next attempt or the next pull continues with
``Range: bytes=<size on disk>-``, under huggingface_hub's own lock for the file and in its layout
(so ``hf_hub_download`` and ``hf download`` find the file in place and trust it). When the pull's
stop event is set, `Hub.fetch` stops at its next network read and ``hf_hub_download`` at its next
chunk (its progress bar raises `_Cancelled`). `LocalFolder` and `HubCache` say where huggingface_hub
keeps a file, its partials, its lock and its metadata in an output folder and in the Hub cache.
(With ``hf_xet`` installed huggingface_hub would take Xet for LFS files; `Hub.fetch` takes the plain
HTTP path the Hub offers every client, the one ``HF_HUB_DISABLE_XET=1`` selects.)
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from larql_edge.console import human
from larql_edge.errors import (
    HubError,
    HubForbidden,
    HubGated,
    HubInvalid,
    HubNotFound,
    HubRateLimited,
    HubRevisionNotFound,
    HubUnauthorized,
    HubUnavailable,
)

REPO_TYPES = ("dataset", "model")
RETRY_DELAYS = (0.5, 1.0, 2.0)  # seconds before each retry of a download that follows an attempt with no progress
TOKEN_HINT = "set HF_TOKEN (or --hf-token-file), or log in with `hf auth login`"


def validate_repo_id(repo_id: str) -> str:
    """OWNER/NAME as the Hub allows it (huggingface_hub's own rule), with the owner required."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id as hf_validate

    try:
        if not isinstance(repo_id, str) or repo_id.count("/") != 1:
            raise HFValidationError("expected OWNER/NAME")
        hf_validate(repo_id)
    except HFValidationError as e:
        raise HubInvalid(f"invalid repo id {repo_id!r}: expected OWNER/NAME ({str(e).split('. ')[0]})") from None
    return repo_id


BOOKKEEPING = ".cache/huggingface"  # huggingface_hub's metadata, locks and partials inside an output folder


CONTROL_DIRS = frozenset({".git", ".hg", ".svn", ".bzr", "_darcs", ".jj", "git~1"})


def safe_relpath(path: str) -> str:
    """Refuse a remote listing entry that would escape the output folder, or that huggingface_hub's own
    path guard would refuse halfway through a download (a drive like ``a/C:x`` in any segment, control
    characters), or that would land in its bookkeeping folder. Checked before anything is written."""
    parts = path.split("/")
    # A version-control folder anywhere (.git/config, .git/hooks: `git status` in the output folder then
    # runs what they say); Windows and macOS match names case-blind and ignore trailing dots and spaces.
    if any(part.lower().rstrip(". ") in CONTROL_DIRS for part in parts):
        raise HubInvalid(f"unsafe path {path!r} in the remote file listing (a version-control folder): refusing to download")
    if (not path or "\\" in path or PurePosixPath(path).is_absolute() or any(part in ("..", ".", "") for part in parts)
            or any(":" in part for part in parts) or any(ord(c) < 32 or c == "\x7f" for c in path)
            or path == BOOKKEEPING or path.startswith(BOOKKEEPING + "/")):
        raise HubInvalid(f"unsafe path {path!r} in the remote file listing: refusing to download")
    return path


def validate_revision(revision: str | None) -> str | None:
    """A branch, tag or commit as git allows it (check-ref-format), refused before any request.

    An unchecked ``..`` or ``a/../b`` would be normalised away in the request URL and name another
    resource of the repo (``--revision ..`` asked for the repo itself, and huggingface_hub failed on the
    answer with a TypeError)."""
    if revision is None:
        return None
    bad = (not revision or revision.startswith("/") or revision.endswith("/") or revision.endswith(".")
           or "//" in revision or ".." in revision or "@{" in revision or revision == "@"
           or any(ord(c) < 33 or c == "\x7f" or c in "~^:?*[\\" for c in revision)
           or any(part.startswith(".") or part.endswith(".lock") for part in revision.split("/")))
    if bad:
        raise HubInvalid(f"invalid revision {revision!r}: expected a branch, tag or commit")
    return revision


def _status(e: BaseException) -> int | None:
    return getattr(getattr(e, "response", None), "status_code", None)


def by_status(e: BaseException, what: str) -> HubError:
    status = _status(e)
    if status == 401:
        return HubUnauthorized(f"{what}: not authorized (401): {TOKEN_HINT}")
    if status == 403:
        return HubForbidden(f"{what}: forbidden (403): the token may not do this")
    if status == 404:
        return HubNotFound(f"{what}: not found (404)")
    if status == 429:
        return HubRateLimited(f"{what}: rate limited by the Hub (429): wait and retry")
    if status is not None and status >= 500:
        return HubUnavailable(f"{what}: the Hub failed ({status}): retry later")
    return HubError(f"{what}: the Hub answered {status or 'an error'}")


def _msg(cls: type[HubError], text: str) -> Callable[[BaseException, str], HubError]:
    return lambda e, what: cls(f"{what}: {text}")


def _own_words(cls: type[HubError]) -> Callable[[BaseException, str], HubError]:
    return lambda e, what: cls(f"{what}: {str(e).splitlines()[0][:300] if str(e) else type(e).__name__}")


def _egress(e: BaseException, what: str) -> HubError:
    """402: the account's download allowance is used up; the Hub's own message says the usage and how
    to raise it (its first line is only the status and the request id)."""
    said = [ln.strip() for ln in str(getattr(e, "server_message", "") or "").splitlines() if ln.strip()]
    return HubForbidden(f"{what}: the account's Hub download (egress) allowance is used up (402)"
                        + (f": {said[0][:300]}" if said else ": see the account's usage on the Hub"))


_UNREACHABLE = _own_words(HubError)  # inference, CLI, DDUF, sandbox...: never raised by the calls we make

# Every class of huggingface_hub.errors (2.5), most specific first where they inherit.
FOREIGN: dict[str, Callable[[BaseException, str], HubError]] = {
    "GatedRepoError": _msg(HubGated, f"gated repo: accept its conditions on the Hub, then {TOKEN_HINT}"),
    "RepositoryNotFoundError": _msg(HubNotFound, f"repository not found (or private: check the name; {TOKEN_HINT})"),
    "RevisionNotFoundError": _msg(HubRevisionNotFound, "revision not found (check the branch, tag or commit)"),
    "RemoteEntryNotFoundError": _msg(HubNotFound, "file not found in the repository"),
    "DisabledRepoError": _msg(HubForbidden, "the repository is disabled"),
    "EgressLimitError": _egress,
    "BucketNotFoundError": _msg(HubNotFound, "bucket not found"),
    "JobNotFoundError": _msg(HubNotFound, "job not found"),
    "BadRequestError": _own_words(HubError),
    "BucketBatchError": by_status,
    "HfHubHTTPError": by_status,
    "IncompleteSnapshotError": _msg(HubUnavailable, "the Hub could not be reached and the local copy is incomplete"),
    "LocalEntryNotFoundError": _msg(HubUnavailable, "the Hub could not be reached and nothing is cached"),
    "EntryNotFoundError": _msg(HubNotFound, "file not found"),
    "OfflineModeIsEnabled": _msg(HubUnavailable, "HF_HUB_OFFLINE is set: unset it to reach the Hub"),
    "LocalTokenNotFoundError": _msg(HubUnauthorized, f"no Hub token: {TOKEN_HINT}"),
    "HFValidationError": _own_words(HubInvalid),
    "HfUriError": _own_words(HubInvalid),
    "FileMetadataError": _own_words(HubError),
    "XetDownloadError": _own_words(HubUnavailable),
    "DryRunError": _own_words(HubError),
    "FileDuplicationError": _own_words(HubError),
    "CorruptedCacheException": _own_words(HubError),
    "CacheNotFound": _own_words(HubError),
    "CachedRepoTreeNotFoundError": _own_words(HubError),
    "RevisionResolutionError": _own_words(HubRevisionNotFound),
    "NotASafetensorsRepoError": _UNREACHABLE,
    "SafetensorsParsingError": _UNREACHABLE,
    "InferenceEndpointTimeoutError": _UNREACHABLE,
    "InferenceEndpointError": _UNREACHABLE,
    "InferenceTimeoutError": _UNREACHABLE,
    "GenerationError": _UNREACHABLE,
    "IncompleteGenerationError": _UNREACHABLE,
    "OverloadedError": _UNREACHABLE,
    "UnknownError": _UNREACHABLE,
    "ValidationError": _UNREACHABLE,
    "TextGenerationError": _UNREACHABLE,
    "CLIExtensionInstallError": _UNREACHABLE,
    "ConfirmationError": _UNREACHABLE,
    "CLIError": _UNREACHABLE,
    "DDUFCorruptedFileError": _UNREACHABLE,
    "DDUFInvalidEntryNameError": _UNREACHABLE,
    "DDUFExportError": _UNREACHABLE,
    "DDUFError": _UNREACHABLE,
    "DeviceCodeError": _UNREACHABLE,
    "OIDCError": _UNREACHABLE,
    "SandboxCommandError": _UNREACHABLE,
    "SandboxError": _UNREACHABLE,
    "StrictDataclassClassValidationError": _UNREACHABLE,
    "StrictDataclassDefinitionError": _UNREACHABLE,
    "StrictDataclassFieldValidationError": _UNREACHABLE,
    "StrictDataclassError": _UNREACHABLE,
}


def translate(e: BaseException, what: str) -> HubError:
    """The typed error for an exception raised by huggingface_hub (or its HTTP stack) doing ``what``."""
    for cls in type(e).__mro__:
        if cls.__module__.startswith("huggingface_hub") and cls.__name__ in FOREIGN:
            return FOREIGN[cls.__name__](e, what)
    if type(e).__module__.split(".")[0] in ("httpx", "httpx2", "httpcore", "httpcore2", "requests", "urllib3"):
        return HubUnavailable(f"{what}: network error ({type(e).__name__}): the Hub could not be reached")
    if isinstance(e, (ConnectionError, TimeoutError)):
        return HubUnavailable(f"{what}: {type(e).__name__}: {e}")
    if isinstance(e, OSError):
        return HubError(f"{what}: {e.strerror or type(e).__name__}{': ' + str(e.filename) if e.filename else ''}")
    if isinstance(e, ValueError):  # huggingface_hub's own argument and path checks
        return HubInvalid(f"{what}: {_first_line(e)}")
    if _raised_inside_huggingface_hub(e):  # the library failed on something it did not expect
        return HubError(f"{what}: huggingface_hub failed ({type(e).__name__}: {_first_line(e)})")
    raise e


def _first_line(e: BaseException) -> str:
    return str(e).splitlines()[0][:300] if str(e) else type(e).__name__


def _raised_inside_huggingface_hub(e: BaseException) -> bool:
    tb = e.__traceback__
    while tb is not None:
        if str(tb.tb_frame.f_globals.get("__name__", "")).startswith("huggingface_hub"):
            return True
        tb = tb.tb_next
    return False


@contextmanager
def hub_errors(what: str) -> Iterator[None]:
    try:
        yield
    except HubError:
        raise
    except Exception as e:
        raise translate(e, what) from None


class Hub:
    """A thin, error-translating view of `huggingface_hub.HfApi` for one endpoint and repo type."""

    def __init__(self, endpoint: str | None = None, token: str | None = None, repo_type: str = "dataset",
                 mirror: str | None = None):
        """``mirror``: where file contents are fetched instead (``{mirror}/{repo}/resolve/{commit}/{file}``,
        an nginx cache in front of the Hub: deploy/nginx/hub-mirror.conf); the listing and the commit
        still come from ``endpoint``. Every node of a fleet then costs the Hub one download per file."""
        if endpoint:
            # huggingface_hub pings the public Hub on first use whatever the endpoint; a user who
            # chose another endpoint has not asked for that. (Its constants are read at import.)
            import huggingface_hub.constants as hf_constants

            hf_constants.HF_HUB_DISABLE_TELEMETRY = True
        from huggingface_hub import HfApi

        if repo_type not in REPO_TYPES:
            raise HubError(f"unknown repo type {repo_type!r} (dataset or model)")
        self.repo_type = repo_type
        self.api = HfApi(endpoint=endpoint, token=token)
        self.endpoint = self.api.endpoint.rstrip("/")
        self.files_endpoint = mirror.rstrip("/") if mirror else self.endpoint
        self.token = token

    def url(self, repo_id: str) -> str:
        prefix = "datasets/" if self.repo_type == "dataset" else ""
        return f"{self.endpoint}/{prefix}{repo_id}"

    def create_repo(self, repo_id: str) -> None:
        with hub_errors(f"create {self.repo_type} repo {repo_id}"):
            self.api.create_repo(repo_id, repo_type=self.repo_type, exist_ok=True)

    def exists(self, repo_id: str) -> bool:
        with hub_errors(f"probe {repo_id}"):
            return bool(self.api.repo_exists(repo_id, repo_type=self.repo_type))

    def resolve_commit(self, repo_id: str, revision: str | None = None) -> str:
        """The commit a branch or tag names now: a pull lists and downloads that one snapshot."""
        validate_revision(revision)
        with hub_errors(f"resolve {repo_id}" + (f"@{revision}" if revision else "")):
            info = self.api.repo_info(repo_id, repo_type=self.repo_type, revision=revision)
            if not info.sha:
                raise HubError(f"resolve {repo_id}: the Hub named no commit")
            return str(info.sha)

    def remote_files(self, repo_id: str, revision: str | None = None) -> dict[str, RemoteFile]:
        """path -> `RemoteFile`; raises HubError (404 when the repo is missing)."""
        from huggingface_hub.hf_api import RepoFile

        validate_revision(revision)
        out: dict[str, RemoteFile] = {}
        with hub_errors(f"list {repo_id}"):
            for entry in self.api.list_repo_tree(repo_id, recursive=True, revision=revision, repo_type=self.repo_type):
                if isinstance(entry, RepoFile):
                    lfs = entry.lfs
                    sha = (getattr(lfs, "sha256", None) or (lfs.get("sha256") if isinstance(lfs, dict) else None)) if lfs else None
                    out[entry.path] = RemoteFile(entry.path, int(entry.size), sha, entry.blob_id or None)
        return out

    def lfs_oids(self, repo_id: str) -> dict[str, str]:
        """path -> remote lfs.oid; empty for a repo that does not exist yet (publish uploads everything).
        Any other failure (no network, 5xx) is raised: a dry run must not show an upload plan as if
        the Hub were empty."""
        # One plain request first: huggingface_hub retries a listing with backoff for ~24 s when
        # nothing answers, while this fails at once (and skips the listing of a new repo).
        if not self.exists(repo_id):
            return {}
        try:
            return {p: f.lfs_sha256 for p, f in self.remote_files(repo_id).items() if f.lfs_sha256}
        except HubNotFound:
            return {}

    # -- downloads ------------------------------------------------------------------------------

    def download(self, repo_id: str, filename: str, *, revision: str, cache_dir: Path, local_dir: Path | None,
                 stop: threading.Event) -> Path:
        """One file through the unmodified ``hf_hub_download`` (into ``local_dir``, or the Hub cache)."""
        from huggingface_hub import hf_hub_download

        with hub_errors(f"download {repo_id}/{filename}"):
            return Path(hf_hub_download(
                repo_id, filename, repo_type=self.repo_type, revision=revision, endpoint=self.files_endpoint,
                token=self.token, cache_dir=str(cache_dir), local_dir=str(local_dir) if local_dir else None,
                tqdm_class=stop_aware_progress(stop),
            ))

    def fetch(self, repo_id: str, filename: str, *, revision: str, part: Path, size: int, stop: threading.Event,
              progress: Callable[[int], None] = lambda n: None) -> int:
        """Download ``filename`` at ``revision`` into ``part`` until it holds ``size`` bytes; return how many
        bytes came over the network now (those already in ``part`` are continued from, never fetched again).

        Transient failures (network, 408, 429, 5xx) are retried at once while they make progress and
        ``len(RETRY_DELAYS)`` more times when they do not; after that a `HubError`, and ``part`` stays for
        the next pull to continue. The caller holds the file's lock and checks the content."""
        from huggingface_hub import constants, hf_hub_url
        from huggingface_hub.utils import build_hf_headers

        what = f"download {repo_id}/{filename}"
        with hub_errors(what):
            url = hf_hub_url(repo_id, filename, repo_type=self.repo_type, revision=revision,
                             endpoint=self.files_endpoint)
            headers = build_hf_headers(token=self.token)
        headers["Accept-Encoding"] = "identity"  # the bytes as stored: a Range counts those
        timeout = constants.HF_HUB_DOWNLOAD_TIMEOUT
        fetched, failures = 0, 0
        while True:
            have = part.stat().st_size if part.exists() else 0
            if have > size:  # not a prefix of this file
                part.unlink()
                have = 0
            if have == size:
                return fetched
            if stop.is_set():
                raise _Cancelled()
            got = _Tally(progress)  # bytes this attempt wrote, also when it fails midway
            error: HubError | None = None
            try:
                _fetch_once(url, headers, part, have, timeout, stop, got)
            except _Cancelled:
                raise
            except Exception as e:
                if not _transient(e):
                    if _status(e) == 416:  # the Hub says our partial is not a prefix of the file
                        part.unlink(missing_ok=True)
                    raise translate(e, what) from None
                error = translate(e, what)
            fetched += got.n
            if got.n == 0 and error is None:  # a clean end of body, short of the file: as a failure
                error = HubUnavailable(f"{what}: the Hub ended the download at byte {have} of {size}")
            if error is None:
                continue
            failures = 0 if got.n else failures + 1
            if failures > len(RETRY_DELAYS):
                kept = part.stat().st_size if part.exists() else 0
                raise type(error)(f"{error.message} ({human(kept)} of {human(size)} kept: pull again to resume)")
            if failures and stop.wait(RETRY_DELAYS[failures - 1]):
                raise _Cancelled()


@dataclass(frozen=True)
class RemoteFile:
    """A file of a repo's listing: its size, and what identifies its content on the Hub."""

    path: str
    size: int
    lfs_sha256: str | None  # the content's sha256 when the file is stored in Git LFS
    blob_id: str | None  # the git blob id (sha1 of "blob <size>\0" + content) of a file stored in git

    @property
    def etag(self) -> str | None:
        """What the Hub answers as the file's ETag, and so the name of its blob in the Hub cache."""
        return self.lfs_sha256 or self.blob_id


class _Cancelled(BaseException):
    """Raised inside a download when the pull is stopping (Ctrl-C). A BaseException, so neither
    huggingface_hub's handlers nor `hub_errors` catch it on its way out (huggingface_hub then deletes
    its own partial, as it does on any failure)."""


def stop_aware_progress(stop: threading.Event) -> type:
    """The progress-bar class given to ``hf_hub_download``: it draws nothing (the pull prints its own
    lines) and raises `_Cancelled` at the download's next chunk once ``stop`` is set."""

    class StopAwareProgress:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            if stop.is_set():
                raise _Cancelled()

        def __enter__(self) -> "StopAwareProgress":
            return self

        def __exit__(self, *exc: Any) -> None:
            pass

        def update(self, n: float | None = 1) -> None:
            if stop.is_set():
                raise _Cancelled()

        def close(self) -> None:
            pass

    return StopAwareProgress


class _Tally:
    """Counts the bytes of one attempt and passes them on to the caller's progress."""

    def __init__(self, forward: Callable[[int], None]):
        self.n, self.forward = 0, forward

    def __call__(self, n: int) -> None:
        self.n += n
        self.forward(n)


def _fetch_once(url: str, headers: dict[str, str], part: Path, have: int, timeout: float,
                stop: threading.Event, progress: Callable[[int], None]) -> None:
    from huggingface_hub.utils import get_session, hf_raise_for_status

    h = dict(headers)
    if have:
        h["Range"] = f"bytes={have}-"
    # huggingface_hub's own client (its proxies, certificates and hooks); it follows the Hub's redirect to
    # a CDN and drops the Authorization header when that redirect leaves the Hub's host.
    with get_session().stream("GET", url, headers=h, timeout=timeout) as r:
        hf_raise_for_status(r)
        mode = "ab"
        if have and r.status_code != 206:
            mode = "wb"  # the server ignored the Range and sends the whole file
        elif have and not r.headers.get("Content-Range", "").startswith(f"bytes {have}-"):
            raise HubError(f"{url}: the Hub answered a range that does not start at byte {have}")
        part.parent.mkdir(parents=True, exist_ok=True)
        with open(part, mode) as f:
            for chunk in r.iter_bytes():
                if stop.is_set():
                    raise _Cancelled()
                f.write(chunk)
                progress(len(chunk))


def _transient(e: BaseException) -> bool:
    status = _status(e)
    if status is not None:
        return status in (408, 429) or status >= 500
    return type(e).__module__.split(".")[0] in ("httpx", "httpx2", "httpcore", "httpcore2") or isinstance(
        e, (ConnectionError, TimeoutError))


# -- where huggingface_hub keeps files on disk --------------------------------------------------------


def digest(path: Path, *, sha256: bool, git: bool, chunk: int = 8 << 20) -> tuple[str | None, str | None]:
    """(sha256, git blob id) of a file, in one read; each only when asked for."""
    size = path.stat().st_size
    h256 = hashlib.sha256() if sha256 else None
    h1 = hashlib.sha1(f"blob {size}\0".encode()) if git else None
    with open(path, "rb") as f:
        while block := f.read(chunk):
            if h256 is not None:
                h256.update(block)
            if h1 is not None:
                h1.update(block)
    return (h256.hexdigest() if h256 else None, h1.hexdigest() if h1 else None)


@contextmanager
def file_lock(path: Path, stop: threading.Event | None = None) -> Iterator[None]:
    """huggingface_hub's own lock for a file (so we and it never write the same file at once); waiting
    for it stops when ``stop`` is set."""
    from filelock import Timeout
    from huggingface_hub.utils import WeakFileLock

    path.parent.mkdir(parents=True, exist_ok=True)
    with ExitStack() as held:
        while True:
            try:
                held.enter_context(WeakFileLock(path, timeout=0.2))
                break
            except Timeout:
                if stop is not None and stop.is_set():
                    raise _Cancelled() from None
        yield


def lock_is_free(path: Path) -> bool:
    """Whether nobody (no process, no thread) holds huggingface_hub's lock ``path`` right now."""
    from filelock import Timeout
    from huggingface_hub.utils import WeakFileLock

    if not path.exists():
        return True
    try:
        with WeakFileLock(path, timeout=0.05):
            return True
    except Timeout:
        return False


class LocalFolder:
    """A repo hydrated into an output folder (huggingface_hub's ``local_dir``).

    huggingface_hub keeps, under ``.cache/huggingface/download/``, a ``<path>.metadata`` (commit, etag,
    time) and a ``<path>.lock`` per file, and ``<hash>.<etag>.<uuid>.incomplete`` while it downloads
    one. Our partial of an LFS file sits beside them as ``<path>.<etag[:16]>.part``.
    """

    def __init__(self, root: Path):
        self.root = Path(root)
        self.bookkeeping = self.root / BOOKKEEPING / "download"

    def file(self, name: str) -> Path:
        return self.root / name

    def lock(self, name: str) -> Path:
        return self.bookkeeping / f"{name}.lock"

    def partial(self, name: str, etag: str) -> Path:
        return self.bookkeeping / f"{name}.{etag[:16]}.part"

    def recorded(self, name: str, etag: str) -> bool:
        """Whether huggingface_hub's metadata says the file is this content (and it was not changed since)."""
        from huggingface_hub._local_folder import read_download_metadata

        with hub_errors(f"read the metadata of {name}"):
            meta = read_download_metadata(self.root, name)
        return meta is not None and meta.etag == etag

    def record(self, name: str, commit: str, etag: str) -> None:
        """Write huggingface_hub's metadata for a file we placed, so it (and ``hf download``) trust it."""
        from huggingface_hub._local_folder import write_download_metadata

        with hub_errors(f"write the metadata of {name}"):
            write_download_metadata(self.root, name, commit_hash=commit, etag=etag)

    def forget(self, name: str) -> None:
        """Remove a file and its metadata: the next pull downloads it again."""
        self.file(name).unlink(missing_ok=True)
        (self.bookkeeping / f"{name}.metadata").unlink(missing_ok=True)

    def partials(self) -> list[Path]:
        """Every partial in the folder: ours (``.part``) and huggingface_hub's (``.incomplete``)."""
        if not self.bookkeeping.is_dir():
            return []
        return [p for p in self.bookkeeping.rglob("*") if p.name.endswith((".part", ".incomplete")) and p.is_file()]

    def incomplete_of(self, name: str, etag: str) -> list[Path]:
        """huggingface_hub's partials of one file (``<hash>.<etag>.incomplete`` and its ``.<uuid>`` variants)."""
        from huggingface_hub._local_folder import get_local_download_paths

        with hub_errors(f"locate the partials of {name}"):
            stem = get_local_download_paths(self.root, name).incomplete_path(etag).name[: -len(".incomplete")]
        folder = (self.bookkeeping / name).parent
        return [p for p in folder.glob(f"{stem}*.incomplete") if p.is_file()] if folder.is_dir() else []


class HubCache:
    """One repo in huggingface_hub's cache: ``blobs/<etag>`` (the content), ``snapshots/<commit>/<path>``
    (a link to its blob), ``.locks/<repo>/<etag>.lock``, and ``blobs/<etag>.<uuid>.incomplete`` while
    huggingface_hub downloads one. Our partial of an LFS file is ``blobs/<etag>.part``.
    """

    def __init__(self, cache_dir: Path, repo_id: str, repo_type: str, commit: str):
        from huggingface_hub.file_download import repo_folder_name

        folder = repo_folder_name(repo_id=repo_id, repo_type=repo_type)
        self.cache_dir = Path(cache_dir)
        self.storage = self.cache_dir / folder
        self.blobs = self.storage / "blobs"
        self.locks = self.cache_dir / ".locks" / folder
        self.root = self.storage / "snapshots" / commit

    def file(self, name: str) -> Path:
        return self.root / name

    def blob(self, etag: str) -> Path:
        return self.blobs / etag

    def lock(self, etag: str) -> Path:
        return self.locks / f"{etag}.lock"

    def partial(self, etag: str) -> Path:
        return self.blobs / f"{etag}.part"

    def forget(self, name: str, etag: str | None) -> None:
        """Remove a file's snapshot link and the blob it showed (wrong bytes, whoever else links to it):
        the next pull downloads it again."""
        pointer = self.file(name)
        shown = [Path(os.path.realpath(pointer))] if pointer.is_symlink() else []
        pointer.unlink(missing_ok=True)
        blobs = Path(os.path.realpath(self.blobs))
        for blob in shown + ([Path(os.path.realpath(self.blob(etag)))] if etag else []):
            if blob.parent == blobs:  # never a file outside this repo's blobs
                blob.unlink(missing_ok=True)

    def partials(self) -> list[Path]:
        """Every partial of this repo in the cache: ours (``.part``) and huggingface_hub's (``.incomplete``)."""
        if not self.blobs.is_dir():
            return []
        return [p for p in self.blobs.iterdir() if p.name.endswith((".part", ".incomplete")) and p.is_file()]
