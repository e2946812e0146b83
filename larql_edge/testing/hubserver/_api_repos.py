"""Repo routes: create/delete, info, tree, paths-info, preupload, commit, commits, refs, resolve, whoami."""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import re
from typing import Any
from urllib.parse import parse_qs, urlencode

from ._errors import HubError, entry_not_found
from ._handler import BaseHubHandler
from ._storage import (
    Commit,
    FileEntry,
    Repo,
    Storage,
    TreeItem,
    is_binary_sample,
    matches_gitattributes,
    matches_gitignore,
)

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}$")


class RepoRoutes(BaseHubHandler):
    # ------------------------------------------------------------------ helpers
    def repo_url(self, repo: Repo) -> str:
        return f"{self.hub.base_url}/{repo.url_path}"

    def file_json(self, entry: FileEntry) -> dict[str, Any]:
        out: dict[str, Any] = {"type": "file", "oid": entry.git_oid, "size": entry.size, "path": entry.path}
        if entry.lfs:
            out["lfs"] = {"oid": entry.sha256, "size": entry.size, "pointerSize": entry.pointer_size}
        return out

    def tree_item_json(self, repo: Repo, commit: Commit, item: TreeItem, expand: bool) -> dict[str, Any]:
        if item.type == "directory":
            out: dict[str, Any] = {"type": "directory", "oid": item.oid, "size": 0, "path": item.path}
        else:
            assert item.entry is not None
            out = self.file_json(item.entry)
        if expand:
            last = last_commit_touching(repo, commit, item.path)
            out["lastCommit"] = {"id": last.oid, "title": last.title, "date": last.date}
        return out

    def repo_json(self, repo: Repo, commit: Commit, *, blobs: bool) -> dict[str, Any]:
        siblings = []
        for path in sorted(commit.files):
            entry = commit.files[path]
            sib: dict[str, Any] = {"rfilename": path}
            if blobs:
                sib["size"] = entry.size
                sib["blobId"] = entry.git_oid
                if entry.lfs:
                    sib["lfs"] = {"size": entry.size, "sha256": entry.sha256, "pointerSize": entry.pointer_size}
            siblings.append(sib)
        siblings += [{"rfilename": inj.path} for inj in self.hub.faults.injected(repo.repo_type, repo.repo_id)]
        out: dict[str, Any] = {
            "_id": repo.object_id,
            "id": repo.repo_id,
            "author": repo.namespace,
            "sha": commit.oid,
            "lastModified": commit.date,
            "createdAt": repo.created_at,
            "private": repo.private,
            "gated": False,
            "disabled": False,
            "downloads": 0,
            "likes": 0,
            "tags": [],
            "siblings": siblings,
            "usedStorage": sum(e.size for e in commit.files.values()),
            "xetEnabled": False,
        }
        if repo.repo_type == "model":
            out["modelId"] = repo.repo_id
        return out

    # ------------------------------------------------------------------ account
    def h_whoami(self) -> None:
        user = self.acting_user
        self.send_json(
            200,
            {
                "type": "user",
                "id": hashlib.sha1(user.encode()).hexdigest()[:24],
                "name": user,
                "fullname": user,
                "email": f"{user}@hubserver.invalid",
                "emailVerified": True,
                "canPay": False,
                "isPro": False,
                "avatarUrl": "",
                "orgs": [],
                "auth": {"type": "access_token", "accessToken": {"displayName": "hubserver", "role": "write"}},
            },
        )

    def h_agent_harnesses(self) -> None:
        # huggingface_hub >= 2.x fetches this registry from `constants.ENDPOINT` to tag its User-Agent.
        self.send_json(200, {"standardEnvVars": [], "harnesses": {}})

    def h_validate_yaml(self) -> None:
        self.read_body()
        self.send_json(200, {"errors": [], "warnings": []})

    # ------------------------------------------------------------------ repos
    def h_repo_create(self) -> None:
        body = self.read_json()
        name = body.get("name")
        namespace = body.get("organization") or self.acting_user
        repo_type = body.get("type") or "model"
        if not isinstance(name, str) or not _NAME_RE.match(name) or name.endswith(".git") or "--" in name:
            raise HubError(400, f"Invalid repo name {name!r}")
        if not isinstance(namespace, str) or not _NAME_RE.match(namespace):
            raise HubError(400, f"Invalid namespace {namespace!r}")
        private = bool(body.get("private")) or body.get("visibility") == "private"
        repo, created = self.hub.storage.create_repo(
            repo_type, f"{namespace}/{name}", private=private, author=self.acting_user
        )
        url = self.repo_url(repo)
        if not created:
            raise HubError(409, f"You already created this {repo_type} repo", body={"url": url})
        self.send_json(200, {"url": url, "name": repo.repo_id, "id": repo.object_id})

    def h_repo_delete(self) -> None:
        body = self.read_json()
        name, org = body.get("name"), body.get("organization") or self.acting_user
        self.hub.storage.delete_repo(body.get("type") or "model", f"{org}/{name}")
        self.send_json(200, {})

    def h_repo_info(self, repo_type: str, repo_id: str, revision: str | None) -> None:
        repo = self.visible_repo(repo_type, repo_id)
        commit = self.hub.storage.resolve(repo, revision or "main")
        self.send_json(200, self.repo_json(repo, commit, blobs=self.qbool("blobs")))

    def h_refs(self, repo_type: str, repo_id: str) -> None:
        repo = self.visible_repo(repo_type, repo_id)
        branches = [
            {"name": name, "ref": f"refs/heads/{name}", "targetCommit": oid}
            for name, oid in sorted(repo.branches.items())
        ]
        self.send_json(200, {"branches": branches, "converts": [], "tags": [], "pullRequests": []})

    def h_commits(self, repo_type: str, repo_id: str, revision: str) -> None:
        repo = self.visible_repo(repo_type, repo_id)
        commit = self.hub.storage.resolve(repo, revision)
        self.send_json(
            200,
            [
                {
                    "id": c.oid,
                    "title": c.title,
                    "message": c.message,
                    "date": c.date,
                    "authors": [{"user": c.author or "anonymous", "avatar": ""}],
                }
                for c in repo.history(commit)
            ],
        )

    # ------------------------------------------------------------------ listing
    def h_tree(self, repo_type: str, repo_id: str, revision: str, path: str) -> None:
        repo = self.visible_repo(repo_type, repo_id)
        commit = self.hub.storage.resolve(repo, revision)
        expand = self.qbool("expand")
        items = Storage.tree_items(commit, path, recursive=self.qbool("recursive"))
        entries = [self.tree_item_json(repo, commit, item, expand) for item in items]
        if not path.strip("/"):
            entries += [inj.tree_json() for inj in self.hub.faults.injected(repo_type, repo_id)]

        page_size = self.hub.tree_page_size if not expand else min(self.hub.tree_page_size, 50)
        try:
            if self.qget("limit"):
                page_size = max(1, min(page_size, int(self.qget("limit") or page_size)))
            offset = int(self.qget("cursor") or 0)
        except ValueError as exc:
            raise HubError(400, f"Invalid pagination parameter: {exc}") from exc
        page = entries[offset : offset + page_size]
        headers = {}
        if offset + page_size < len(entries):
            query = {k: v for k, v in self.query.items() if k != "cursor"}
            query["cursor"] = [str(offset + page_size)]
            headers["Link"] = f'<{self.hub.base_url}{self.raw_path}?{urlencode(query, doseq=True)}>; rel="next"'
        self.send_json(200, page, headers=headers)

    def h_paths_info(self, repo_type: str, repo_id: str, revision: str) -> None:
        repo = self.visible_repo(repo_type, repo_id)
        commit = self.hub.storage.resolve(repo, revision)
        content_type = self.headers.get("Content-Type", "")
        body = self.read_body()
        if "json" in content_type:
            data = json.loads(body or b"{}")
            paths, expand = list(data.get("paths") or []), bool(data.get("expand"))
        else:
            form = parse_qs(body.decode(), keep_blank_values=True)
            paths, expand = form.get("paths", []), (form.get("expand", ["false"])[-1].lower() == "true")
        out = []
        for path in paths:
            path = path.strip("/")
            if path in commit.files:
                item = TreeItem("file", path, entry=commit.files[path])
            elif any(p.startswith(path + "/") for p in commit.files):
                item = TreeItem("directory", path, oid=Storage.tree_oid(commit, path))
            else:
                continue  # missing paths are silently skipped, as on the Hub
            out.append(self.tree_item_json(repo, commit, item, expand))
        self.send_json(200, out)

    # ------------------------------------------------------------------ upload
    def h_preupload(self, repo_type: str, repo_id: str, revision: str) -> None:
        repo = self.visible_repo(repo_type, repo_id)
        commit = self.hub.storage.resolve(repo, revision)
        body = self.read_json()
        files = body.get("files")
        if not isinstance(files, list):
            raise HubError(400, "Expected a 'files' list")
        gitignore = body.get("gitIgnore")
        if gitignore is None and ".gitignore" in commit.files:
            gitignore = self.hub.storage.read_blob(commit.files[".gitignore"].sha256).decode("utf-8", "replace")
        patterns = self.hub.storage.lfs_patterns(commit)
        out = []
        for item in files:
            path, size = item.get("path"), int(item.get("size") or 0)
            try:
                sample = base64.b64decode(item.get("sample") or "")
            except (binascii.Error, ValueError) as exc:
                raise HubError(400, f"Invalid base64 sample for {path}: {exc}") from exc
            lfs = size > 0 and (
                size >= self.hub.lfs_threshold or matches_gitattributes(path, patterns) or is_binary_sample(sample)
            )
            answer: dict[str, Any] = {
                "path": path,
                "uploadMode": "lfs" if lfs else "regular",
                "shouldIgnore": matches_gitignore(path, gitignore),
            }
            existing = commit.files.get(path)
            if existing is not None:
                answer["oid"] = existing.sha256 if existing.lfs else existing.git_oid
            out.append(answer)
        self.send_json(200, {"files": out, "commitOid": commit.oid})

    def h_commit(self, repo_type: str, repo_id: str, revision: str) -> None:
        repo = self.visible_repo(repo_type, repo_id)
        if self.qbool("create_pr"):
            self.read_body()
            raise HubError(400, "create_pr is not supported by the test server")
        lines = []
        for n, raw in enumerate(self.read_body().splitlines(), start=1):
            if raw.strip():
                try:
                    lines.append(json.loads(raw))
                except ValueError as exc:
                    raise HubError(400, f"Invalid NDJSON on line {n}: {exc}") from exc
        if not lines or lines[0].get("key") != "header":
            raise HubError(400, "The commit payload must start with a {'key': 'header'} line")
        header = lines[0].get("value") or {}
        summary = header.get("summary")
        if not summary:
            raise HubError(400, "The commit header needs a non-empty 'summary'")
        commit = self.hub.storage.commit(
            repo,
            revision,
            lines[1:],
            summary=summary,
            description=header.get("description") or "",
            author=self.acting_user,
            parent_commit=header.get("parentCommit"),
        )
        self.send_json(
            200,
            {
                "success": True,
                "commitOid": commit.oid,
                "commitUrl": f"{self.repo_url(repo)}/commit/{commit.oid}",
                "hookOutput": "",
                "pullRequestUrl": None,
            },
        )

    # ------------------------------------------------------------------ download
    def h_resolve(self, repo_type: str, repo_id: str, revision: str, path: str) -> None:
        repo = self.visible_repo(repo_type, repo_id)
        commit = self.hub.storage.resolve(repo, revision)
        entry = commit.files.get(path)
        if entry is None:
            for inj in self.hub.faults.injected(repo_type, repo_id):
                if inj.path == path:
                    etag = hashlib.sha256(inj.content).hexdigest()
                    headers = {"X-Repo-Commit": commit.oid, "ETag": f'"{etag}"'}
                    self.send_file(inj.content, len(inj.content), headers=headers, file_path=path)
                    return
            raise entry_not_found(path, commit.oid)
        headers = {"X-Repo-Commit": commit.oid, "ETag": f'"{entry.etag}"'}
        if entry.lfs:
            headers["X-Linked-Etag"] = f'"{entry.sha256}"'
            headers["X-Linked-Size"] = str(entry.size)
        blob = self.hub.storage.blob_path(entry.sha256)
        self.send_file(blob, entry.size, headers=headers, file_path=path)


def last_commit_touching(repo: Repo, commit: Commit, path: str) -> Commit:
    """Newest commit (from `commit` back) that changed `path` (a file, or anything under a directory)."""

    def state(c: Commit | None) -> Any:
        if c is None:
            return None
        if path in c.files:
            return c.files[path].git_oid
        return Storage.tree_oid(c, path)

    for c in repo.history(commit):
        parent = repo.commits.get(c.parent) if c.parent else None
        if state(c) != state(parent):
            return c
    return commit

