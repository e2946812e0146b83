"""larql-slicer pull: download a published vindex (or preset, all slices, a collection) completely.

Every file of a repo is hydrated, so a pulled preset is usable as it is. The remote listing is
checked before anything is written (no absolute paths, no '..'), downloads resume through
huggingface_hub's ``.incomplete`` files, and ``index.json`` checksums are verified afterwards.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from larql_edge.errors import HubError
from larql_edge.format.presets import DEFAULT_SLICES, canonical_preset
from larql_edge.format.vindex import Vindex
from larql_edge.tools.slicer.hub import Hub, hub_errors, safe_relpath, validate_repo_id
from larql_edge.tools.slicer.publish import slice_repo_name


@dataclass
class PullResult:
    repo: str
    path: Path | None = None
    error: str | None = None
    files: int = 0


@dataclass
class PullReport:
    results: list[PullResult] = field(default_factory=list)
    siblings: list[tuple[str, str]] = field(default_factory=list)  # (flag, repo)


def split_sibling_suffix(repo: str, template: str = "{repo}-{preset}") -> tuple[str, str | None]:
    """'o/m-vindex-client' -> ('o/m-vindex', 'client'); a repo without a known suffix maps to itself."""
    for preset in DEFAULT_SLICES:
        suffix = slice_repo_name(template, "", preset)
        if suffix and repo.endswith(suffix) and len(repo) > len(suffix):
            return repo[: -len(suffix)], preset
    return repo, None


def resolve_targets(hub: Hub, repo: str | None, preset: str | None, all_slices: bool, collection: str | None,
                    template: str) -> list[str]:
    if collection:
        with hub_errors(f"collection {collection}"):
            c = hub.api.get_collection(collection)
        repos = [i.item_id for i in c.items if i.item_type == hub.repo_type]
        if not repos:
            raise HubError(f"collection {collection} holds no {hub.repo_type} repos")
        return [validate_repo_id(r) for r in repos]
    if not repo:
        raise HubError("give a REPO, or --collection SLUG")
    validate_repo_id(repo)
    if preset:
        return [validate_repo_id(slice_repo_name(template, repo, canonical_preset(preset)))]
    if all_slices:
        return [repo] + [validate_repo_id(slice_repo_name(template, repo, p)) for p in DEFAULT_SLICES]
    return [repo]


def pull_one(hub: Hub, repo_id: str, output: Path | None, revision: str | None) -> PullResult:
    from huggingface_hub import snapshot_download

    res = PullResult(repo=repo_id)
    listing = hub.remote_files(repo_id, revision=revision)
    if not listing:
        raise HubError(f"{repo_id}: the repo holds no files")
    for name in listing:
        safe_relpath(name)
    if "index.json" not in listing:
        raise HubError(f"{repo_id}: no index.json: not a vindex repo")
    with hub_errors(f"download {repo_id}"):
        folder = snapshot_download(
            repo_id,
            repo_type=hub.repo_type,
            revision=revision,
            local_dir=str(output) if output else None,
            endpoint=hub.endpoint,
            token=hub.token,
        )
    path = Path(str(folder))
    missing = [f for f in listing if not (path / f).is_file()]
    if missing:
        raise HubError(f"{repo_id}: incomplete download, missing {', '.join(sorted(missing))}")
    Vindex.open(path).verify_or_raise()
    res.path, res.files = path, len(listing)
    return res


def sibling_hints(hub: Hub, repo: str, template: str) -> list[tuple[str, str]]:
    base, own = split_sibling_suffix(repo, template)
    hints: list[tuple[str, str]] = []
    if own is not None and hub.exists(base):
        hints.append(("(full)", base))
    for p in DEFAULT_SLICES:
        if p == own:
            continue
        name = slice_repo_name(template, base, p)
        if name != repo and hub.exists(name):
            hints.append((f"--preset {p}", name))
    return hints


def pull(
    repo: str | None,
    *,
    preset: str | None = None,
    all_slices: bool = False,
    collection: str | None = None,
    output: str | Path | None = None,
    revision: str | None = None,
    repo_type: str = "dataset",
    template: str = "{repo}-{preset}",
    endpoint: str | None = None,
    token: str | None = None,
    hints: bool = True,
    log: Callable[[str], None] = print,
) -> PullReport:
    if sum(bool(x) for x in (preset, all_slices, collection)) > 1:
        raise HubError("choose one of --preset, --all-slices and --collection")
    hub = Hub(endpoint=endpoint, token=token, repo_type=repo_type)
    targets = resolve_targets(hub, repo, preset, all_slices, collection, template)
    report = PullReport()
    out = Path(output) if output else None
    several = len(targets) > 1
    for t in targets:
        dest = (out / t.split("/")[1] if several else out) if out else None
        log(f"Pulling {hub.url(t)} ...")
        try:
            r = pull_one(hub, t, dest, revision)
            log(f"  {r.files} files verified at {r.path}")
        except HubError as e:
            if not several:
                raise
            # One unavailable sibling must not fail a whole collection or --all-slices pull.
            r = PullResult(repo=t, error=str(e))
            log(f"  failed: {e}")
        report.results.append(r)
    if hints and len(targets) == 1 and not collection:
        report.siblings = sibling_hints(hub, targets[0], template)
    failed = [r for r in report.results if r.error]
    if failed and len(failed) == len(report.results):
        raise HubError(f"every pull failed ({len(failed)}): {failed[0].error}")
    return report
