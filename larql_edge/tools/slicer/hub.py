"""The Hub boundary: one place that talks to ``huggingface_hub`` and translates its errors.

Everything above this module (publish, pull) sees `HubError` with a clear one-line message; the
token is taken from ``HF_TOKEN`` or the library's login and never appears in a message.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import wraps
from pathlib import PurePosixPath
from typing import Any, TypeVar

from larql_edge.tools.slicer.errors import HubError

REPO_TYPES = ("dataset", "model")
_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}/[A-Za-z0-9][A-Za-z0-9._-]{0,95}$")

T = TypeVar("T")


def validate_repo_id(repo_id: str) -> str:
    """OWNER/NAME with the Hub's characters; no '..', no leading or trailing separators."""
    if (
        not isinstance(repo_id, str)
        or not _REPO_ID.match(repo_id)
        or ".." in repo_id
        or "--" in repo_id
        or repo_id.endswith((".", "-", "_"))
        or repo_id.split("/")[0].endswith((".", "-", "_"))
    ):
        raise HubError(
            f"invalid repo id {repo_id!r}: expected OWNER/NAME of letters, digits, '-', '_' or '.', "
            "without '..' or '--' and not ending in a separator"
        )
    return repo_id


def safe_relpath(path: str) -> str:
    """Refuse a remote listing entry that would escape the output folder."""
    p = PurePosixPath(path)
    if not path or "\\" in path or p.is_absolute() or any(part in ("..", "") for part in path.split("/")) or ":" in p.parts[0]:
        raise HubError(f"unsafe path {path!r} in the remote file listing: refusing to download")
    return path


def _translate(e: Exception, what: str) -> HubError:
    from huggingface_hub import errors as hf

    status = getattr(getattr(e, "response", None), "status_code", None)
    if isinstance(e, hf.RepositoryNotFoundError) or status == 404:
        return HubError(f"{what}: not found (404)")
    if isinstance(e, hf.GatedRepoError) or status in (401, 403):
        return HubError(
            f"{what}: not authorized ({status}): set HF_TOKEN or log in with `hf auth login`"
        )
    if isinstance(e, hf.RevisionNotFoundError):
        return HubError(f"{what}: revision not found")
    if isinstance(e, hf.HfHubHTTPError):
        return HubError(f"{what}: the Hub answered {status or 'an error'}")
    if isinstance(e, hf.LocalEntryNotFoundError):
        return HubError(f"{what}: the Hub could not be reached")
    if isinstance(e, (OSError, ConnectionError, TimeoutError)):
        return HubError(f"{what}: {type(e).__name__}: {e}")
    if type(e).__module__.startswith(("httpx", "httpcore", "requests", "urllib3")):
        return HubError(f"{what}: network error ({type(e).__name__})")
    if isinstance(e, hf.HFValidationError):
        return HubError(f"{what}: {e}")
    raise e


@contextmanager
def hub_errors(what: str) -> Iterator[None]:
    try:
        yield
    except HubError:
        raise
    except Exception as e:
        raise _translate(e, what) from None


def translated(what: str) -> Callable[[Callable[..., T]], Callable[..., T]]:
    def deco(fn: Callable[..., T]) -> Callable[..., T]:
        @wraps(fn)
        def inner(*a: Any, **k: Any) -> T:
            with hub_errors(what):
                return fn(*a, **k)

        return inner

    return deco


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
