"""URL routing: which handler answers a (method, path), and what authorization it needs.

Routes (``{t}`` is ``models`` or ``datasets``; ``{repo}`` is ``ns/name``; revisions and tree paths may be
percent-encoded, ``%2F`` included, exactly as ``huggingface_hub`` sends them):

    GET        /api/whoami-v2                          GET  /api/agent-harnesses (empty registry)
    POST       /api/repos/create                       DELETE /api/repos/delete
    POST       /api/validate-yaml
    GET|HEAD   /api/{t}/{repo}                         GET|HEAD /api/{t}/{repo}/revision/{rev}
    GET        /api/{t}/{repo}/tree/{rev}[/{path}]     POST     /api/{t}/{repo}/paths-info/{rev}
    POST       /api/{t}/{repo}/preupload/{rev}         POST     /api/{t}/{repo}/commit/{rev}
    GET        /api/{t}/{repo}/commits/{rev}           GET      /api/{t}/{repo}/refs
    POST       /[datasets/]{repo}.git/info/lfs/objects/batch
    POST       /[datasets/]{repo}.git/info/lfs/objects/verify
    PUT        /_lfs/upload/{upload_id}                (the "presigned" URL handed out by the batch API)
    GET|HEAD   /_lfs/objects/{oid}                     (LFS download action)
    GET|HEAD   /[datasets/]{repo}/resolve/{rev}/{path}
    GET        /api/collections?owner=&item=&limit=    POST /api/collections
    GET        /api/users/{ns}/collections             GET  /api/organizations/{ns}/collections
    GET|PATCH|DELETE  /api/collections/{ns}/{slug}
    POST       /api/collections/{ns}/{slug}/items      (also the singular .../item)
    PATCH|DELETE      /api/collections/{ns}/{slug}/items/{item_object_id}   (also .../item/{id})
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote

# Authorization levels.
READ = "read"  # anonymous allowed (unless the server requires tokens for reads); a wrong token is still 401
WRITE = "write"  # a valid token is required (when the server has tokens configured)
TOKEN = "token"  # a valid token is always required (whoami)
PRESIGNED = "presigned"  # the URL itself is the credential (LFS upload URLs)

REPO_TYPES_BY_PLURAL = {"models": "model", "datasets": "dataset"}
_REPO_ACTIONS = {"revision", "tree", "paths-info", "preupload", "commit", "commits", "refs", "resolve"}


@dataclass
class Route:
    name: str
    auth: str
    params: dict[str, Any] = field(default_factory=dict)


class NoRoute(Exception):
    """No handler for this path (404), or the path exists but not for this method (405)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def _segments(raw_path: str) -> list[str]:
    return [s for s in raw_path.split("/") if s != ""] if raw_path.strip("/") else []


def _split_repo(segs: list[str]) -> tuple[str, list[str]]:
    """`[ns, name, *rest]` or `[name, *rest]` -> (repo_id, rest), repo segments percent-decoded."""
    if len(segs) >= 2 and segs[1] not in _REPO_ACTIONS:
        return f"{unquote(segs[0])}/{unquote(segs[1])}", segs[2:]
    if segs:
        return unquote(segs[0]), segs[1:]
    raise NoRoute(404, "Missing repo id")


def _method_check(method: str, allowed: tuple[str, ...]) -> None:
    if method not in allowed:
        raise NoRoute(405, f"Method {method} not allowed here (allowed: {', '.join(allowed)})")


def resolve_route(method: str, raw_path: str) -> Route:
    """Map a request to a Route. `raw_path` is the percent-encoded path without the query string."""
    segs = _segments(raw_path)
    if not segs:
        raise NoRoute(404, "Not found")

    if segs[0] == "api":
        return _api_route(method, segs[1:])
    if segs[0] == "_lfs":
        return _lfs_storage_route(method, segs[1:])

    # Git LFS endpoints: /[datasets/]{repo}.git/info/lfs/objects/{batch|verify}
    for i, seg in enumerate(segs):
        if seg.endswith(".git") and segs[i + 1 : i + 4] == ["info", "lfs", "objects"] and len(segs) == i + 5:
            repo_type, repo_segs = _web_repo_type(segs[: i + 1])
            repo_segs[-1] = repo_segs[-1][: -len(".git")]
            repo_id = "/".join(unquote(s) for s in repo_segs)
            action = segs[i + 4]
            if action not in ("batch", "verify"):
                break
            _method_check(method, ("POST",))
            return Route(f"lfs_{action}", WRITE, {"repo_type": repo_type, "repo_id": repo_id})

    # File downloads: /[datasets/]{repo}/resolve/{rev}/{path}
    repo_type, rest = _web_repo_type(segs)
    for i in (1, 2):
        if len(rest) > i + 2 and rest[i] == "resolve":
            _method_check(method, ("GET", "HEAD"))
            return Route(
                "resolve",
                READ,
                {
                    "repo_type": repo_type,
                    "repo_id": "/".join(unquote(s) for s in rest[:i]),
                    "revision": unquote(rest[i + 1]),
                    "path": "/".join(unquote(s) for s in rest[i + 2 :]),
                },
            )
    raise NoRoute(404, f"No route for {raw_path}")


def _web_repo_type(segs: list[str]) -> tuple[str, list[str]]:
    if segs and segs[0] == "datasets":
        return "dataset", list(segs[1:])
    if segs and segs[0] in ("spaces", "kernels"):
        raise NoRoute(404, f"Repo type {segs[0]} is not served by the test server")
    return "model", list(segs)


def _lfs_storage_route(method: str, segs: list[str]) -> Route:
    if len(segs) == 2 and segs[0] == "upload":
        _method_check(method, ("PUT",))
        return Route("lfs_upload", PRESIGNED, {"upload_id": segs[1]})
    if len(segs) == 2 and segs[0] == "objects":
        _method_check(method, ("GET", "HEAD"))
        return Route("lfs_object", PRESIGNED, {"oid": segs[1]})
    raise NoRoute(404, "No such LFS storage route")


def _api_route(method: str, segs: list[str]) -> Route:
    if segs == ["whoami-v2"]:
        _method_check(method, ("GET",))
        return Route("whoami", TOKEN)
    if segs == ["agent-harnesses"]:
        _method_check(method, ("GET",))
        return Route("agent_harnesses", READ)
    if segs == ["repos", "create"]:
        _method_check(method, ("POST",))
        return Route("repo_create", WRITE)
    if segs == ["repos", "delete"]:
        _method_check(method, ("DELETE",))
        return Route("repo_delete", WRITE)
    if segs == ["validate-yaml"]:
        _method_check(method, ("POST",))
        return Route("validate_yaml", READ)
    if segs and segs[0] == "collections":
        return _collections_route(method, segs[1:])
    if len(segs) == 3 and segs[0] in ("users", "organizations") and segs[2] == "collections":
        _method_check(method, ("GET",))
        return Route("collections_list", READ, {"owner": unquote(segs[1])})
    if segs and segs[0] in REPO_TYPES_BY_PLURAL:
        return _repo_api_route(method, REPO_TYPES_BY_PLURAL[segs[0]], segs[1:])
    if segs and segs[0] in ("spaces", "kernels", "buckets"):
        raise NoRoute(404, f"/api/{segs[0]} is not served by the test server")
    raise NoRoute(404, f"No API route /api/{'/'.join(segs)}")


def _repo_api_route(method: str, repo_type: str, segs: list[str]) -> Route:
    repo_id, rest = _split_repo(segs)
    base = {"repo_type": repo_type, "repo_id": repo_id}
    if not rest:
        _method_check(method, ("GET", "HEAD"))
        return Route("repo_info", READ, {**base, "revision": None})
    action, args = rest[0], rest[1:]
    if action == "revision" and len(args) == 1:
        _method_check(method, ("GET", "HEAD"))
        return Route("repo_info", READ, {**base, "revision": unquote(args[0])})
    if action == "tree" and args:
        _method_check(method, ("GET",))
        path = "/".join(unquote(s) for s in args[1:])
        return Route("tree", READ, {**base, "revision": unquote(args[0]), "path": path})
    if action == "paths-info" and len(args) == 1:
        _method_check(method, ("POST",))
        return Route("paths_info", READ, {**base, "revision": unquote(args[0])})
    if action == "preupload" and len(args) == 1:
        _method_check(method, ("POST",))
        return Route("preupload", WRITE, {**base, "revision": unquote(args[0])})
    if action == "commit" and len(args) == 1:
        _method_check(method, ("POST",))
        return Route("commit", WRITE, {**base, "revision": unquote(args[0])})
    if action == "commits" and len(args) == 1:
        _method_check(method, ("GET",))
        return Route("commits", READ, {**base, "revision": unquote(args[0])})
    if action == "refs" and not args:
        _method_check(method, ("GET",))
        return Route("refs", READ, base)
    raise NoRoute(404, f"No repo API route {action!r}")


def _collections_route(method: str, segs: list[str]) -> Route:
    if not segs:
        _method_check(method, ("GET", "POST"))
        return Route("collections_list" if method == "GET" else "collection_create", READ if method == "GET" else WRITE)
    if len(segs) < 2:
        raise NoRoute(404, "Collection slugs look like {namespace}/{slug}")
    slug = f"{unquote(segs[0])}/{unquote(segs[1])}"
    rest = segs[2:]
    if not rest:
        _method_check(method, ("GET", "PATCH", "DELETE"))
        name = {"GET": "collection_get", "PATCH": "collection_update", "DELETE": "collection_delete"}[method]
        return Route(name, READ if method == "GET" else WRITE, {"slug": slug})
    if rest[0] in ("items", "item") and len(rest) == 1:
        _method_check(method, ("POST",))
        return Route("collection_item_add", WRITE, {"slug": slug})
    if rest[0] in ("items", "item") and len(rest) == 2:
        _method_check(method, ("PATCH", "DELETE"))
        name = "collection_item_update" if method == "PATCH" else "collection_item_delete"
        return Route(name, WRITE, {"slug": slug, "object_id": unquote(rest[1])})
    raise NoRoute(404, "No such collection route")
