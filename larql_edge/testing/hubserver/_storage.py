"""Repositories, commits and content-addressed blobs, kept in a temporary directory.

Model of the data, close to what the Hub keeps:

- every file's bytes live once in a blob store keyed by their sha256 (``objects/ab/abcdef...``);
- a repo has branches (``main``) pointing at commits; a commit is an immutable snapshot ``path -> FileEntry``
  plus its parent, title, message, date and author; every commit is kept, so old revisions stay readable;
- a file is either *regular* (git blob: its oid is the git blob sha1 of its content) or *LFS* (its oid is the
  git blob sha1 of its pointer file, and its ``lfs`` block carries the sha256 of the content);
- a repo has its own LFS object set: an object counts as "already uploaded" only for the repo it was uploaded
  to (the batch API answers per repo, as on the Hub).
"""

from __future__ import annotations

import base64
import binascii
import fnmatch
import hashlib
import os
import shutil
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path, PurePosixPath
from typing import Any, Iterable

from ._errors import HubError, entry_not_found, repo_not_found, revision_not_found

REPO_TYPES = ("model", "dataset")

# A trimmed copy of the `.gitattributes` the Hub puts in every new repo (the LFS patterns that matter here).
DEFAULT_GITATTRIBUTES = """\
*.7z filter=lfs diff=lfs merge=lfs -text
*.arrow filter=lfs diff=lfs merge=lfs -text
*.bin filter=lfs diff=lfs merge=lfs -text
*.bz2 filter=lfs diff=lfs merge=lfs -text
*.ckpt filter=lfs diff=lfs merge=lfs -text
*.gguf filter=lfs diff=lfs merge=lfs -text
*.gz filter=lfs diff=lfs merge=lfs -text
*.h5 filter=lfs diff=lfs merge=lfs -text
*.msgpack filter=lfs diff=lfs merge=lfs -text
*.npy filter=lfs diff=lfs merge=lfs -text
*.npz filter=lfs diff=lfs merge=lfs -text
*.onnx filter=lfs diff=lfs merge=lfs -text
*.parquet filter=lfs diff=lfs merge=lfs -text
*.pt filter=lfs diff=lfs merge=lfs -text
*.pth filter=lfs diff=lfs merge=lfs -text
*.safetensors filter=lfs diff=lfs merge=lfs -text
*.tar filter=lfs diff=lfs merge=lfs -text
*.zip filter=lfs diff=lfs merge=lfs -text
*.zst filter=lfs diff=lfs merge=lfs -text
"""


def now_iso(ts: float | None = None) -> str:
    """The Hub's timestamp format: ``2024-01-31T12:34:56.789Z``."""
    dt = datetime.fromtimestamp(time.time() if ts is None else ts, tz=timezone.utc)
    return dt.strftime("%Y-%m-%dT%H:%M:%S.") + f"{dt.microsecond // 1000:03d}Z"


def git_blob_sha1(data: bytes) -> str:
    """The git object id of a blob with this content (what the Hub reports as a regular file's oid/ETag)."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def lfs_pointer(sha256: str, size: int) -> bytes:
    """The Git LFS pointer file committed in place of an LFS file's content."""
    return f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\nsize {size}\n".encode()


def is_binary_sample(sample: bytes) -> bool:
    """Binary if it holds a NUL byte or is not UTF-8 (ignoring a multi-byte character cut at the sample's end)."""
    if b"\0" in sample:
        return True
    try:
        sample.decode("utf-8")
    except UnicodeDecodeError as exc:
        return exc.start < len(sample) - 3
    return False


def validate_repo_path(path: str) -> str:
    """Reject paths a real Hub refuses in commits: absolute, ``..``/``.`` segments, empty segments, ``.git/``."""
    if not isinstance(path, str) or not path or path.startswith("/") or "\\" in path:
        raise HubError(400, f"Invalid path in repo: {path!r}")
    parts = path.split("/")
    if any(part in ("", ".", "..") for part in parts) or parts[0] == ".git":
        raise HubError(400, f"Invalid path in repo: {path!r}")
    return path


@dataclass(frozen=True)
class FileEntry:
    """One file of a commit."""

    path: str
    size: int
    sha256: str  # sha256 of the content: key in the blob store; the LFS oid for LFS files
    lfs: bool
    git_oid: str  # git blob sha1: of the content for regular files, of the pointer file for LFS files

    @property
    def pointer(self) -> bytes:
        return lfs_pointer(self.sha256, self.size)

    @property
    def pointer_size(self) -> int:
        return len(self.pointer)

    @property
    def etag(self) -> str:
        """The value the Hub sends as (linked) ETag: sha256 for LFS files, git blob sha1 otherwise."""
        return self.sha256 if self.lfs else self.git_oid


@dataclass
class Commit:
    oid: str
    parent: str | None
    title: str
    message: str
    date: str
    author: str
    files: dict[str, FileEntry]


@dataclass
class Repo:
    repo_type: str
    repo_id: str
    private: bool
    created_at: str
    object_id: str
    branches: dict[str, str] = field(default_factory=dict)
    commits: dict[str, Commit] = field(default_factory=dict)
    commit_order: list[str] = field(default_factory=list)  # oldest first
    lfs_objects: dict[str, int] = field(default_factory=dict)  # sha256 -> size, uploaded to this repo

    @property
    def namespace(self) -> str:
        return self.repo_id.split("/")[0] if "/" in self.repo_id else self.repo_id

    @property
    def url_path(self) -> str:
        """Path of the repo's web page: ``datasets/ns/name`` or ``ns/name``."""
        return f"datasets/{self.repo_id}" if self.repo_type == "dataset" else self.repo_id

    def head(self, branch: str = "main") -> Commit:
        return self.commits[self.branches[branch]]

    def history(self, commit: Commit) -> list[Commit]:
        """Commits reachable from `commit`, newest first."""
        out = []
        current: Commit | None = commit
        while current is not None:
            out.append(current)
            current = self.commits.get(current.parent) if current.parent else None
        return out


@dataclass
class TreeItem:
    """One entry of a tree listing: a file (with its FileEntry) or a directory (with its tree oid)."""

    type: str  # "file" | "directory"
    path: str
    entry: FileEntry | None = None
    oid: str = ""


class Storage:
    """Thread-safe store of repos, commits and blobs under `root`."""

    def __init__(self, root: Path, *, initial_gitattributes: str | None = DEFAULT_GITATTRIBUTES) -> None:
        self.root = Path(root)
        self.objects_dir = self.root / "objects"
        self.objects_dir.mkdir(parents=True, exist_ok=True)
        self.tmp_dir = self.root / "tmp"
        self.tmp_dir.mkdir(parents=True, exist_ok=True)
        self.initial_gitattributes = initial_gitattributes
        self.lock = threading.RLock()
        self.repos: dict[tuple[str, str], Repo] = {}
        self._counter = 0

    # ------------------------------------------------------------------ blobs
    def blob_path(self, sha256: str) -> Path:
        return self.objects_dir / sha256[:2] / sha256

    def has_blob(self, sha256: str) -> bool:
        return self.blob_path(sha256).is_file()

    def read_blob(self, sha256: str) -> bytes:
        return self.blob_path(sha256).read_bytes()

    def put_bytes(self, data: bytes) -> str:
        sha = hashlib.sha256(data).hexdigest()
        path = self.blob_path(sha)
        if not path.is_file():
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.new_tmp_path()
            tmp.write_bytes(data)
            os.replace(tmp, path)
        return sha

    def adopt_file(self, tmp_path: Path, sha256: str) -> None:
        """Move a fully received temp file into the blob store under its (already verified) sha256."""
        path = self.blob_path(sha256)
        if path.is_file():
            Path(tmp_path).unlink(missing_ok=True)
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        os.replace(tmp_path, path)

    def new_tmp_path(self) -> Path:
        with self.lock:
            self._counter += 1
            n = self._counter
        return self.tmp_dir / f"{os.getpid()}-{threading.get_ident()}-{n}.part"

    def _make_entry(self, path: str, size: int, sha256: str, lfs: bool) -> FileEntry:
        git_oid = git_blob_sha1(lfs_pointer(sha256, size)) if lfs else git_blob_sha1(self.read_blob(sha256))
        return FileEntry(path=path, size=size, sha256=sha256, lfs=lfs, git_oid=git_oid)

    def _new_oid(self, *parts: Any) -> str:
        with self.lock:
            self._counter += 1
            n = self._counter
        text = "\n".join(str(p) for p in parts) + f"\n{time.time_ns()}\n{n}"
        return hashlib.sha1(text.encode()).hexdigest()

    # ------------------------------------------------------------------ repos
    def create_repo(
        self, repo_type: str, repo_id: str, *, private: bool = False, author: str = ""
    ) -> tuple[Repo, bool]:
        """Create the repo with an initial commit; returns (repo, created). `created` is False if it existed."""
        if repo_type not in REPO_TYPES:
            raise HubError(400, f"Unsupported repo type {repo_type!r} (the test server speaks {REPO_TYPES})")
        with self.lock:
            existing = self.repos.get((repo_type, repo_id))
            if existing is not None:
                return existing, False
            repo = Repo(
                repo_type=repo_type,
                repo_id=repo_id,
                private=private,
                created_at=now_iso(),
                object_id=self._new_oid("repo", repo_type, repo_id)[:24],
            )
            files: dict[str, FileEntry] = {}
            if self.initial_gitattributes is not None:
                data = self.initial_gitattributes.encode()
                sha = self.put_bytes(data)
                files[".gitattributes"] = self._make_entry(".gitattributes", len(data), sha, lfs=False)
            commit = Commit(
                oid=self._new_oid("initial", repo_type, repo_id),
                parent=None,
                title="initial commit",
                message="",
                date=now_iso(),
                author=author,
                files=files,
            )
            repo.commits[commit.oid] = commit
            repo.commit_order.append(commit.oid)
            repo.branches["main"] = commit.oid
            self.repos[(repo_type, repo_id)] = repo
            return repo, True

    def find_repo(self, repo_type: str, repo_id: str) -> Repo | None:
        with self.lock:
            return self.repos.get((repo_type, repo_id))

    def get_repo(self, repo_type: str, repo_id: str) -> Repo:
        repo = self.find_repo(repo_type, repo_id)
        if repo is None:
            raise repo_not_found(repo_type, repo_id)
        return repo

    def delete_repo(self, repo_type: str, repo_id: str) -> None:
        with self.lock:
            if self.repos.pop((repo_type, repo_id), None) is None:
                raise repo_not_found(repo_type, repo_id)

    def resolve(self, repo: Repo, revision: str) -> Commit:
        """A branch name, a full commit sha or an unambiguous prefix (>= 7 chars) of one."""
        with self.lock:
            if revision in repo.branches:
                return repo.commits[repo.branches[revision]]
            if revision in repo.commits:
                return repo.commits[revision]
            if len(revision) >= 7 and all(c in "0123456789abcdef" for c in revision):
                matches = [oid for oid in repo.commits if oid.startswith(revision)]
                if len(matches) == 1:
                    return repo.commits[matches[0]]
        raise revision_not_found(revision)

    # ------------------------------------------------------------------ LFS
    def add_lfs_object(self, repo: Repo, sha256: str, size: int) -> None:
        with self.lock:
            repo.lfs_objects[sha256] = size

    def repo_has_lfs_object(self, repo: Repo, sha256: str) -> bool:
        with self.lock:
            return sha256 in repo.lfs_objects and self.has_blob(sha256)

    # ------------------------------------------------------------------ commits
    def commit(
        self,
        repo: Repo,
        branch: str,
        operations: Iterable[dict[str, Any]],
        *,
        summary: str,
        description: str = "",
        author: str = "",
        parent_commit: str | None = None,
    ) -> Commit:
        """Apply commit operations (the NDJSON lines after the header) on top of `branch`; returns the new commit."""
        with self.lock:
            if branch not in repo.branches:
                raise revision_not_found(branch)
            head = repo.head(branch)
            if parent_commit is not None and not head.oid.startswith(parent_commit):
                raise HubError(412, f"A commit has happened since. Please refresh and try again. (head is {head.oid})")
            files = dict(head.files)
            for op in operations:
                key, value = op.get("key"), op.get("value") or {}
                if key == "file":
                    path = validate_repo_path(str(value.get("path") or ""))
                    if value.get("encoding", "base64") != "base64":
                        raise HubError(400, f"Unsupported encoding {value.get('encoding')!r} for {path}")
                    try:
                        data = base64.b64decode(value.get("content", ""), validate=True)
                    except (binascii.Error, ValueError) as exc:
                        raise HubError(400, f"Invalid base64 content for {path}: {exc}") from exc
                    sha = self.put_bytes(data)
                    files[path] = self._make_entry(path, len(data), sha, lfs=False)
                elif key == "lfsFile":
                    path = validate_repo_path(str(value.get("path") or ""))
                    oid = str(value.get("oid", ""))
                    if value.get("algo", "sha256") != "sha256":
                        raise HubError(400, f"Unsupported LFS hash algorithm {value.get('algo')!r}")
                    if oid not in repo.lfs_objects or not self.has_blob(oid):
                        raise HubError(
                            400,
                            f"Your push was rejected because an LFS pointer pointed to a file that does not exist."
                            f" ({path}: sha256:{oid})",
                        )
                    size = repo.lfs_objects[oid]
                    if value.get("size") is not None and int(value["size"]) != size:
                        raise HubError(400, f"LFS object size mismatch for {path}: {value['size']} != {size}")
                    files[path] = self._make_entry(path, size, oid, lfs=True)
                elif key == "deletedFile":
                    path = str(value.get("path", ""))
                    if path not in files:
                        raise HubError(404, f"A file with this name doesn't exist: {path}", code="EntryNotFound")
                    del files[path]
                elif key == "deletedFolder":
                    prefix = str(value.get("path", "")).rstrip("/") + "/"
                    doomed = [p for p in files if p.startswith(prefix)]
                    if not doomed:
                        raise HubError(404, f"A folder with this name doesn't exist: {prefix}", code="EntryNotFound")
                    for p in doomed:
                        del files[p]
                else:
                    raise HubError(400, f"Unknown commit operation {key!r}")
            commit = Commit(
                oid=self._new_oid("commit", head.oid, summary, *sorted(f"{p}:{e.sha256}" for p, e in files.items())),
                parent=head.oid,
                title=summary,
                message=description,
                date=now_iso(),
                author=author,
                files=files,
            )
            repo.commits[commit.oid] = commit
            repo.commit_order.append(commit.oid)
            repo.branches[branch] = commit.oid
            return commit

    # ------------------------------------------------------------------ trees
    @staticmethod
    def tree_items(commit: Commit, path: str = "", *, recursive: bool = False) -> list[TreeItem]:
        """Entries under `path` ('' = root), directories first then files, each group sorted, like the Hub."""
        path = path.strip("/")
        prefix = f"{path}/" if path else ""
        if path and path in commit.files:
            raise HubError(400, f"{path} is a file, not a directory")
        under = {p: e for p, e in commit.files.items() if p.startswith(prefix)}
        if path and not under:
            raise entry_not_found(path, commit.oid)
        dirs: set[str] = set()
        files: list[FileEntry] = []
        for p, entry in under.items():
            rel = PurePosixPath(p[len(prefix) :])
            parents = [str(parent) for parent in rel.parents if str(parent) != "."]
            if recursive:
                dirs.update(prefix + d for d in parents)
                files.append(entry)
            elif parents:
                dirs.add(prefix + rel.parts[0])
            else:
                files.append(entry)
        items = [TreeItem("directory", d, oid=Storage.tree_oid(commit, d)) for d in sorted(dirs)]
        items += [TreeItem("file", e.path, entry=e) for e in sorted(files, key=lambda e: e.path)]
        return items

    @staticmethod
    def tree_oid(commit: Commit, directory: str) -> str:
        prefix = directory.rstrip("/") + "/"
        parts = sorted(f"{p}\0{e.git_oid}" for p, e in commit.files.items() if p.startswith(prefix))
        return hashlib.sha1("\n".join(parts).encode()).hexdigest()

    # ------------------------------------------------------------------ preupload
    def lfs_patterns(self, commit: Commit) -> list[str]:
        """The `filter=lfs` patterns of the commit's `.gitattributes`."""
        entry = commit.files.get(".gitattributes")
        if entry is None:
            return []
        patterns = []
        for line in self.read_blob(entry.sha256).decode("utf-8", "replace").splitlines():
            fields = line.split()
            if len(fields) >= 2 and not fields[0].startswith("#") and "filter=lfs" in fields[1:]:
                patterns.append(fields[0])
        return patterns

    def cleanup(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


def matches_gitattributes(path: str, patterns: list[str]) -> bool:
    """Gitattributes-style match: a pattern without '/' matches the basename, otherwise the full path."""
    name = path.rsplit("/", 1)[-1]
    for pattern in patterns:
        pat = pattern.lstrip("/")
        if "/" in pat:
            if fnmatch.fnmatchcase(path, pat) or (pat.endswith("/**") and path.startswith(pat[:-2])):
                return True
        elif fnmatch.fnmatchcase(name, pat):
            return True
    return False


def matches_gitignore(path: str, gitignore: str | None) -> bool:
    """A small subset of .gitignore: one glob per line, '#' comments, no negation."""
    if not gitignore:
        return False
    patterns = [ln.strip() for ln in gitignore.splitlines() if ln.strip() and not ln.strip().startswith("#")]
    patterns = [p for p in patterns if not p.startswith("!")]
    name = path.rsplit("/", 1)[-1]
    for pattern in patterns:
        pat = pattern.rstrip("/").lstrip("/")
        if fnmatch.fnmatchcase(path, pat) or fnmatch.fnmatchcase(name, pat) or path.startswith(pat + "/"):
            return True
    return False
