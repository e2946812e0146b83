"""Everything a request handler needs, shared by all handler threads of one server."""

from __future__ import annotations

import secrets
import threading
from dataclasses import dataclass, field

from ._collections import CollectionStore
from ._faults import Faults
from ._recording import RequestLog
from ._storage import Repo, Storage


@dataclass(frozen=True)
class PendingUpload:
    """An LFS upload URL handed out by the batch API (the stand-in for an S3 presigned URL)."""

    repo_type: str
    repo_id: str
    oid: str
    size: int


@dataclass
class HubState:
    storage: Storage
    collections: CollectionStore
    faults: Faults
    log: RequestLog
    tokens: dict[str, str]  # token -> user name; empty = authorization disabled (every request is "valid")
    default_user: str
    require_token_for_reads: bool
    lfs_threshold: int
    tree_page_size: int
    base_url: str = ""
    pending_uploads: dict[str, PendingUpload] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def auth_enabled(self) -> bool:
        return bool(self.tokens)

    def new_upload(self, repo: Repo, oid: str, size: int) -> str:
        upload_id = secrets.token_hex(16)
        with self.lock:
            self.pending_uploads[upload_id] = PendingUpload(repo.repo_type, repo.repo_id, oid, size)
        return upload_id

    def get_upload(self, upload_id: str) -> PendingUpload | None:
        with self.lock:
            return self.pending_uploads.get(upload_id)

    def finish_upload(self, upload_id: str) -> None:
        with self.lock:
            self.pending_uploads.pop(upload_id, None)
