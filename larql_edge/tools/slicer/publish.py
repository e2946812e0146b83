"""larql-slicer publish: the full vindex and its preset slices as Hub repos, filed into collections.

One commit per repo. Skip-if-unchanged: a file whose local sha256 equals the remote ``lfs.oid``
is left out of the commit (small, git-tracked files are always re-sent: they carry no lfs.oid and
cost a few KB). Collections are found by case-insensitive title or created, and items are added
idempotently (the Hub's 409 "already in collection" counts as success).
"""

from __future__ import annotations

import re
import shutil
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from larql_edge.console import human
from larql_edge.errors import HubError, HubUnauthorized
from larql_edge.format.presets import DEFAULT_SLICES, canonical_preset
from larql_edge.format.vindex import INDEX, Vindex, sha256_file
from larql_edge.tools.slicer.hub import Hub, hub_errors, validate_repo_id
from larql_edge.tools.slicer.slice import slice_vindex

COLLECTION_LEVELS = ("model", "family", "library")
DEFAULT_LIBRARY_TITLE = "LARQL Vindex Library"


# -- names --------------------------------------------------------------------------------------


def short_model_name(model: str) -> str:
    """'google/gemma-4-31b-it', '.../models--google--gemma-4-31B-it/snapshots/abc/' or 'gemma-3-4b-it' -> the name."""
    parts = [p for p in model.replace("\\", "/").split("/") if p]
    for p in reversed(parts):
        if p.startswith("models--"):
            return p.split("--")[-1]
    if len(parts) >= 2 and parts[-2] == "snapshots":
        parts = parts[:-2]
    return parts[-1] if parts else model


def _segments(model: str) -> list[str]:
    return [s for s in re.split(r"[-_\s]+", short_model_name(model)) if s]


def default_model_title(model: str) -> str:
    """'gemma-4-31b-it' -> 'Gemma 4 31B It'."""
    return " ".join(s.upper() if s[0].isdigit() else s[:1].upper() + s[1:] for s in _segments(model))


def default_family(model: str) -> str:
    """Title-cased segments up to the first that starts with a digit: 'gemma-4-31b-it' -> 'Gemma'."""
    out = []
    for s in _segments(model):
        if s[0].isdigit():
            break
        out.append(s[:1].upper() + s[1:])
    return " ".join(out) or default_model_title(model)


def slice_repo_name(template: str, repo: str, preset: str) -> str:
    if "{repo}" not in template or "{preset}" not in template:
        raise HubError(f"--slice-repo-template {template!r} must contain {{repo}} and {{preset}}")
    return template.replace("{repo}", repo).replace("{preset}", preset)


# -- the report ---------------------------------------------------------------------------------


@dataclass
class RepoResult:
    repo: str
    preset: str | None
    uploaded: list[tuple[str, int]] = field(default_factory=list)
    skipped: list[tuple[str, int]] = field(default_factory=list)
    commit: str | None = None

    @property
    def uploaded_bytes(self) -> int:
        return sum(s for _, s in self.uploaded)

    @property
    def skipped_bytes(self) -> int:
        return sum(s for _, s in self.skipped)


@dataclass
class PublishReport:
    repos: list[RepoResult] = field(default_factory=list)
    collections: dict[str, str] = field(default_factory=dict)  # level -> URL
    dry_run: bool = False


# -- publishing ---------------------------------------------------------------------------------


def plan_targets(repo: str, slices: Sequence[str], full: bool, template: str) -> list[tuple[str, str | None]]:
    validate_repo_id(repo)
    targets: list[tuple[str, str | None]] = [(repo, None)] if full else []
    for s in slices:
        p = canonical_preset(s)
        targets.append((validate_repo_id(slice_repo_name(template, repo, p)), p))
    if not targets:
        raise HubError("nothing to publish: --no-full with --slices none")
    return targets


def require_token(token: str | None) -> None:
    """Uploading needs a token: say so before any network (it used to retry for ~27 s without one,
    then blame the network)."""
    from huggingface_hub import get_token

    if not token and not get_token():
        raise HubUnauthorized("publishing needs a Hub token with write access: --hf-token / --hf-token-file, "
                              "HF_TOKEN, or `hf auth login` (--dry-run needs none)")


def publish(
    src: str | Path,
    repo: str,
    *,
    slices: Sequence[str] = DEFAULT_SLICES,
    full: bool = True,
    template: str = "{repo}-{preset}",
    collections: Sequence[str] = COLLECTION_LEVELS,
    model_title: str | None = None,
    family: str | None = None,
    library_title: str = DEFAULT_LIBRARY_TITLE,
    repo_type: str = "dataset",
    force_upload: bool = False,
    dry_run: bool = False,
    endpoint: str | None = None,
    token: str | None = None,
    tmp_dir: str | Path | None = None,
    log: Callable[[str], None] = print,
) -> PublishReport:
    vx = Vindex.open(src)
    for c in collections:
        if c not in COLLECTION_LEVELS:
            raise HubError(f"unknown collection level {c!r} (model, family, library or none)")
    targets = plan_targets(repo, slices, full, template)
    if not dry_run:
        require_token(token)
    hub = Hub(endpoint=endpoint, token=token, repo_type=repo_type)
    report = PublishReport(dry_run=dry_run)
    # Slices are staged beside the source by default, so they are hard links, not copies.
    stage_root = Path(tempfile.mkdtemp(prefix=".larql-publish-", dir=tmp_dir or vx.path.parent))
    try:
        for repo_id, preset in targets:
            folder = vx.path
            if preset is not None:
                folder = stage_root / preset
                slice_vindex(vx.path, folder, preset=preset, log=lambda m: None)
            report.repos.append(_publish_one(hub, folder, repo_id, preset, force_upload, dry_run, log))
    finally:
        shutil.rmtree(stage_root, ignore_errors=True)

    if collections and not dry_run:
        title = model_title or f"{default_model_title(vx.model)} — LARQL Vindex"
        fam = family or default_family(vx.model)
        titles = {
            "model": title,
            "family": f"{fam} Family — LARQL Vindexes",
            "library": library_title,
        }
        owner = repo.split("/")[0]
        for level in collections:
            report.collections[level] = ensure_collection(
                hub, owner, titles[level], f"LARQL vindexes ({level}) published by larql-edge", [r.repo for r in report.repos]
            )
    elif collections:
        for level in collections:
            report.collections[level] = "(dry run: not created)"
    return report


def _publish_one(hub: Hub, folder: Path, repo_id: str, preset: str | None, force: bool, dry_run: bool, log) -> RepoResult:
    from huggingface_hub import CommitOperationAdd

    res = RepoResult(repo=repo_id, preset=preset)
    vx = Vindex.open(folder)
    sums = vx.checksums
    remote = {} if force else hub.lfs_oids(repo_id)  # read-only; {} for a new repo
    ops = []
    for f in sorted(p for p in folder.iterdir() if p.is_file() and not p.name.startswith(".")):
        size = f.stat().st_size
        local = sums.get(f.name) if f.name != INDEX else None
        if local is not None and remote.get(f.name) == local:
            res.skipped.append((f.name, size))
            continue
        if local is None and f.name in remote:
            local = sha256_file(f)
            if remote[f.name] == local:
                res.skipped.append((f.name, size))
                continue
        res.uploaded.append((f.name, size))
        ops.append(CommitOperationAdd(path_in_repo=f.name, path_or_fileobj=str(f)))
    what = f"preset {preset}" if preset else "full vindex"
    if dry_run:
        log(f"[dry run] {hub.url(repo_id)} ({what}): would upload {len(res.uploaded)} files, skip {len(res.skipped)}")
        return res
    hub.create_repo(repo_id)
    log(f"Publishing {what} -> {hub.url(repo_id)}: {len(res.uploaded)} to upload, {len(res.skipped)} unchanged")
    with hub_errors(f"commit to {repo_id}"):
        info = hub.api.create_commit(
            repo_id,
            ops,
            commit_message=f"larql-edge publish ({what})",
            repo_type=hub.repo_type,
        )
    res.commit = getattr(info, "oid", None)
    return res


def ensure_collection(hub: Hub, owner: str, title: str, description: str, repos: Sequence[str]) -> str:
    """Find the owner's collection by case-insensitive title (or create it); add each repo once."""
    from huggingface_hub.errors import HfHubHTTPError

    with hub_errors(f"collections of {owner}"):
        slug = None
        for c in hub.api.list_collections(owner=owner, limit=100):
            if (c.title or "").casefold() == title.casefold():
                slug = c.slug
                break
        if slug is None:
            slug = hub.api.create_collection(title, namespace=owner, description=description, exists_ok=True).slug
        for r in repos:
            try:
                hub.api.add_collection_item(slug, item_id=r, item_type=hub.repo_type,  # type: ignore[arg-type]
                                        exists_ok=True)
            except HfHubHTTPError as e:
                if getattr(getattr(e, "response", None), "status_code", None) != 409:
                    raise
    return f"{hub.endpoint}/collections/{slug}"


def render_report(rep: PublishReport) -> list[str]:

    lines = [f"{'repo':<48} {'preset':<8} {'uploaded':>12} {'skipped':>12}"]
    for r in rep.repos:
        lines.append(f"{r.repo:<48} {r.preset or 'full':<8} {human(r.uploaded_bytes):>12} {human(r.skipped_bytes):>12}")
    total_up = sum(r.uploaded_bytes for r in rep.repos)
    total_sk = sum(r.skipped_bytes for r in rep.repos)
    lines.append(f"{'total':<48} {'':<8} {human(total_up):>12} {human(total_sk):>12}")
    for level, url in rep.collections.items():
        lines.append(f"collection {level:<8} {url}")
    return lines
