"""Git LFS routes: the batch API, the upload URL it hands out, verify, and raw object download.

Batch (https://github.com/git-lfs/git-lfs/blob/main/docs/api/batch.md), as the Hub answers it:

    POST /[datasets/]{repo}.git/info/lfs/objects/batch
    {"operation": "upload", "transfers": ["basic", "multipart"], "objects": [{"oid", "size"}], "hash_algo": "sha256"}
    -> {"transfer": "basic", "objects": [
          {"oid", "size"}                                            # already stored in this repo: no actions
          {"oid", "size", "authenticated": true, "actions": {
              "upload": {"href": "{server}/_lfs/upload/{id}"},       # PUT the raw bytes here, no auth header
              "verify": {"href": "{server}/[datasets/]{repo}.git/info/lfs/objects/verify"}}}]}

Only the "basic" transfer is offered (no `chunk_size` header), so clients do a single PUT.
"""

from __future__ import annotations

import hashlib
import re

from ._errors import HubError
from ._handler import BaseHubHandler

_OID_RE = re.compile(r"^[0-9a-f]{64}$")
LFS_CONTENT_TYPE = "application/vnd.git-lfs+json"


class LfsRoutes(BaseHubHandler):
    def h_lfs_batch(self, repo_type: str, repo_id: str) -> None:
        repo = self.visible_repo(repo_type, repo_id)
        body = self.read_json()
        operation = body.get("operation")
        if operation not in ("upload", "download"):
            raise HubError(400, f"Unsupported LFS operation {operation!r}")
        storage = self.hub.storage
        objects = []
        for obj in body.get("objects") or []:
            oid, size = obj.get("oid"), obj.get("size")
            if not isinstance(oid, str) or not _OID_RE.match(oid) or not isinstance(size, int) or size < 0:
                objects.append(
                    {"oid": str(oid), "size": size if isinstance(size, int) else 0,
                     "error": {"code": 422, "message": "Invalid oid or size"}}
                )
                continue
            present = storage.repo_has_lfs_object(repo, oid)
            if operation == "upload":
                if present:
                    objects.append({"oid": oid, "size": size})
                    continue
                upload_id = self.hub.new_upload(repo, oid, size)
                objects.append(
                    {
                        "oid": oid,
                        "size": size,
                        "authenticated": True,
                        "actions": {
                            "upload": {"href": f"{self.hub.base_url}/_lfs/upload/{upload_id}", "expires_in": 3600},
                            "verify": {"href": f"{self.hub.base_url}/{repo.url_path}.git/info/lfs/objects/verify"},
                        },
                    }
                )
            elif present:
                objects.append(
                    {
                        "oid": oid,
                        "size": size,
                        "authenticated": True,
                        "actions": {"download": {"href": f"{self.hub.base_url}/_lfs/objects/{oid}"}},
                    }
                )
            else:
                objects.append({"oid": oid, "size": size, "error": {"code": 404, "message": "Object does not exist"}})
        self.send_json(
            200, {"transfer": "basic", "objects": objects, "hash_algo": "sha256"}, content_type=LFS_CONTENT_TYPE
        )

    def h_lfs_upload(self, upload_id: str) -> None:
        pending = self.hub.get_upload(upload_id)
        if pending is None:
            raise HubError(404, "Unknown or expired upload URL")
        storage = self.hub.storage
        repo = storage.get_repo(pending.repo_type, pending.repo_id)
        tmp = storage.new_tmp_path()
        hasher, received = hashlib.sha256(), 0
        try:
            with open(tmp, "wb") as fh:
                for chunk in self.iter_body():
                    hasher.update(chunk)
                    received += len(chunk)
                    fh.write(chunk)
            if received != pending.size or hasher.hexdigest() != pending.oid:
                raise HubError(
                    400,
                    f"Uploaded content does not match the announced object: got {received} bytes with sha256"
                    f" {hasher.hexdigest()}, expected {pending.size} bytes with sha256 {pending.oid}",
                )
            storage.adopt_file(tmp, pending.oid)
        finally:
            tmp.unlink(missing_ok=True)
        storage.add_lfs_object(repo, pending.oid, pending.size)
        self.hub.finish_upload(upload_id)
        self.send_bytes(200, b"", content_type="text/plain", headers={"ETag": f'"{pending.oid[:32]}"'})

    def h_lfs_verify(self, repo_type: str, repo_id: str) -> None:
        repo = self.visible_repo(repo_type, repo_id)
        body = self.read_json()
        oid, size = body.get("oid"), body.get("size")
        if not isinstance(oid, str) or not self.hub.storage.repo_has_lfs_object(repo, oid):
            raise HubError(404, f"Object {oid} was not uploaded to {repo_type}s/{repo_id}")
        if size is not None and repo.lfs_objects.get(oid) != size:
            raise HubError(422, f"Object {oid} has size {repo.lfs_objects.get(oid)}, not {size}")
        self.send_json(200, {"success": True}, content_type=LFS_CONTENT_TYPE)

    def h_lfs_object(self, oid: str) -> None:
        storage = self.hub.storage
        if not _OID_RE.match(oid) or not storage.has_blob(oid):
            raise HubError(404, f"Object {oid} not found")
        path = storage.blob_path(oid)
        self.send_file(path, path.stat().st_size, headers={"ETag": f'"{oid}"'}, file_path=oid)
