"""The Hub boundary: the one place that talks to ``huggingface_hub`` and translates its errors.

Everything above this module (publish, pull) sees the typed `HubError` family of
`larql_edge.errors` with a clear one-line message. `FOREIGN` maps every exception class of
``huggingface_hub.errors`` explicitly (a test walks that module and fails on a class missing here,
so a new huggingface_hub release cannot slip an unmapped error past us); an exception resolves to
the entry of the first class in its MRO, so ``GatedRepoError`` (a ``RepositoryNotFoundError``
subclass in huggingface_hub 2.x) is reported as gated, not as missing. HTTP errors without a more
specific class map by status. The token comes from the caller, ``HF_TOKEN`` or the library's
login, and never appears in a message.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import PurePosixPath
from typing import Any

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


def safe_relpath(path: str) -> str:
    """Refuse a remote listing entry that would escape the output folder."""
    p = PurePosixPath(path)
    if not path or "\\" in path or p.is_absolute() or any(part in ("..", "") for part in path.split("/")) or ":" in p.parts[0]:
        raise HubInvalid(f"unsafe path {path!r} in the remote file listing: refusing to download")
    return path


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


_UNREACHABLE = _own_words(HubError)  # inference, CLI, DDUF, sandbox...: never raised by the calls we make

# Every class of huggingface_hub.errors (2.4), most specific first where they inherit.
FOREIGN: dict[str, Callable[[BaseException, str], HubError]] = {
    "GatedRepoError": _msg(HubGated, f"gated repo: accept its conditions on the Hub, then {TOKEN_HINT}"),
    "RepositoryNotFoundError": _msg(HubNotFound, f"repository not found (or private: check the name; {TOKEN_HINT})"),
    "RevisionNotFoundError": _msg(HubRevisionNotFound, "revision not found (check the branch, tag or commit)"),
    "RemoteEntryNotFoundError": _msg(HubNotFound, "file not found in the repository"),
    "DisabledRepoError": _msg(HubForbidden, "the repository is disabled"),
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
        return HubInvalid(f"{what}: {str(e).splitlines()[0][:300]}")
    raise e


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

    def __init__(self, endpoint: str | None = None, token: str | None = None, repo_type: str = "dataset"):
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

    def remote_files(self, repo_id: str, revision: str | None = None) -> dict[str, dict[str, Any]]:
        """path -> {"size", "lfs_sha256" or None}; raises HubError (404 when the repo is missing)."""
        from huggingface_hub.hf_api import RepoFile

        out: dict[str, dict[str, Any]] = {}
        with hub_errors(f"list {repo_id}"):
            for entry in self.api.list_repo_tree(repo_id, recursive=True, revision=revision, repo_type=self.repo_type):
                if isinstance(entry, RepoFile):
                    lfs = entry.lfs
                    sha = (getattr(lfs, "sha256", None) or (lfs.get("sha256") if isinstance(lfs, dict) else None)) if lfs else None
                    out[entry.path] = {"size": entry.size, "lfs_sha256": sha}
        return out

    def lfs_oids(self, repo_id: str) -> dict[str, str]:
        """path -> remote lfs.oid; empty when anything goes wrong (publish then uploads everything)."""
        try:
            return {p: f["lfs_sha256"] for p, f in self.remote_files(repo_id).items() if f["lfs_sha256"]}
        except HubError:
            return {}
