"""Fault injection: forced statuses, cut, corrupted and throttled downloads, poisoned tree listings.

Faults are consulted by the request handler before normal routing (forced statuses) or while serving
(download cuts, injected tree entries). One-shot faults are consumed by the first matching request.
"""

from __future__ import annotations

import fnmatch
import hashlib
import re
import threading
from dataclasses import dataclass, field
from typing import Any

from ._storage import git_blob_sha1, lfs_pointer


@dataclass
class StatusFault:
    """Answer `status` to requests whose method and decoded path match, `remaining` times (None = forever)."""

    method: str | None
    pattern: re.Pattern[str]
    status: int
    remaining: int | None
    message: str
    code: str | None = None
    headers: dict[str, str] = field(default_factory=dict)
    hits: int = 0

    def matches(self, method: str, path: str) -> bool:
        method_ok = self.method in (None, "*") or self.method.upper() == method.upper()
        return method_ok and self.pattern.search(path) is not None


@dataclass
class DownloadCut:
    """Close the connection after `nbytes` body bytes of a file download whose path matches `glob`."""

    glob: str
    nbytes: int
    remaining: int
    hits: int = 0

    def matches(self, file_path: str, request_path: str) -> bool:
        return fnmatch.fnmatchcase(file_path, self.glob) or fnmatch.fnmatchcase(request_path, self.glob)


@dataclass
class DownloadCorruption:
    """Flip one byte of the next `remaining` file downloads whose path matches `glob` (same length, wrong bytes)."""

    glob: str
    remaining: int
    hits: int = 0

    def matches(self, file_path: str, request_path: str) -> bool:
        return fnmatch.fnmatchcase(file_path, self.glob) or fnmatch.fnmatchcase(request_path, self.glob)


@dataclass
class DownloadThrottle:
    """Serve file downloads whose path matches `glob` at about `bytes_per_second` (until removed)."""

    glob: str
    bytes_per_second: int
    hits: int = 0
    bytes_sent: int = 0  # body bytes the throttled downloads have written so far (live, unlike the request log)
    _lock: threading.Lock = field(default_factory=threading.Lock, compare=False, repr=False)

    def sent(self, n: int) -> None:
        with self._lock:
            self.bytes_sent += n

    def matches(self, file_path: str, request_path: str) -> bool:
        return fnmatch.fnmatchcase(file_path, self.glob) or fnmatch.fnmatchcase(request_path, self.glob)


@dataclass
class InjectedEntry:
    """An extra file entry served in a repo's tree listing (and siblings), e.g. a path-traversal attempt."""

    repo_type: str
    repo_id: str
    path: str
    content: bytes
    lfs: bool

    def tree_json(self) -> dict[str, Any]:
        sha = hashlib.sha256(self.content).hexdigest()
        out: dict[str, Any] = {
            "type": "file",
            "oid": git_blob_sha1(self.content),
            "size": len(self.content),
            "path": self.path,
        }
        if self.lfs:
            pointer = lfs_pointer(sha, len(self.content))
            out["oid"] = git_blob_sha1(pointer)
            out["lfs"] = {"oid": sha, "size": len(self.content), "pointerSize": len(pointer)}
        return out


class Faults:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._status: list[StatusFault] = []
        self._cuts: list[DownloadCut] = []
        self._corruptions: list[DownloadCorruption] = []
        self._throttles: list[DownloadThrottle] = []
        self._injected: list[InjectedEntry] = []

    def add_status(
        self,
        method: str | None,
        path_regex: str,
        status: int,
        *,
        times: int | None,
        message: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> StatusFault:
        fault = StatusFault(
            method=method,
            pattern=re.compile(path_regex),
            status=status,
            remaining=times,
            message=message or f"Injected fault: HTTP {status}",
            code=code,
            headers=dict(headers or {}),
        )
        with self._lock:
            self._status.append(fault)
        return fault

    def take_status(self, method: str, path: str) -> StatusFault | None:
        with self._lock:
            for fault in self._status:
                if fault.remaining != 0 and fault.matches(method, path):
                    fault.hits += 1
                    if fault.remaining is not None:
                        fault.remaining -= 1
                    return fault
        return None

    def add_cut(self, glob: str, nbytes: int, *, times: int = 1) -> DownloadCut:
        cut = DownloadCut(glob=glob, nbytes=nbytes, remaining=times)
        with self._lock:
            self._cuts.append(cut)
        return cut

    def take_cut(self, file_path: str, request_path: str) -> int | None:
        with self._lock:
            for cut in self._cuts:
                if cut.remaining > 0 and cut.matches(file_path, request_path):
                    cut.remaining -= 1
                    cut.hits += 1
                    return cut.nbytes
        return None

    def add_corruption(self, glob: str, *, times: int = 1) -> DownloadCorruption:
        fault = DownloadCorruption(glob=glob, remaining=times)
        with self._lock:
            self._corruptions.append(fault)
        return fault

    def take_corruption(self, file_path: str, request_path: str) -> bool:
        with self._lock:
            for fault in self._corruptions:
                if fault.remaining > 0 and fault.matches(file_path, request_path):
                    fault.remaining -= 1
                    fault.hits += 1
                    return True
        return False

    def add_throttle(self, glob: str, bytes_per_second: int) -> DownloadThrottle:
        if bytes_per_second <= 0:
            raise ValueError("bytes_per_second must be positive")
        fault = DownloadThrottle(glob=glob, bytes_per_second=bytes_per_second)
        with self._lock:
            self._throttles.append(fault)
        return fault

    def throttle_for(self, file_path: str, request_path: str) -> DownloadThrottle | None:
        """The slowest throttle armed for this download, or None."""
        with self._lock:
            armed = [t for t in self._throttles if t.matches(file_path, request_path)]
            for t in armed:
                t.hits += 1
        return min(armed, key=lambda t: t.bytes_per_second, default=None)

    def inject(self, entry: InjectedEntry) -> None:
        with self._lock:
            self._injected.append(entry)

    def injected(self, repo_type: str, repo_id: str) -> list[InjectedEntry]:
        with self._lock:
            return [e for e in self._injected if e.repo_type == repo_type and e.repo_id == repo_id]

    def remove(self, fault: StatusFault | DownloadCut | DownloadCorruption | DownloadThrottle) -> None:
        with self._lock:
            for kept in (self._status, self._cuts, self._corruptions, self._throttles):
                if fault in kept:
                    kept.remove(fault)  # type: ignore[arg-type]

    def clear(self) -> None:
        with self._lock:
            self._status.clear()
            self._cuts.clear()
            self._corruptions.clear()
            self._throttles.clear()
            self._injected.clear()
