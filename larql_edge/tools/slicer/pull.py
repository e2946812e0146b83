"""larql-slicer pull: download a published vindex (or preset, all slices, a collection) completely.

Every file of a repo is hydrated, so a pulled preset is usable as it is. One commit is pulled: the
revision is resolved first and the listing and every download name that commit. The listing is
checked before anything is written (no absolute paths, no '..', nothing huggingface_hub's own path
guard would refuse midway). Pulls heal:

- **Every file is checked** after the downloads: its size against the listing, its content against
  the listing (``lfs.sha256``, or the git blob id of a git-stored file) and against ``index.json``'s
  sha256. A file that fails is removed, with huggingface_hub's metadata (an output folder) or its
  snapshot link and blob (the Hub cache), before the error that names it; the next pull fetches it.
- **Downloads resume** from the bytes on disk: LFS files through `Hub.fetch` (one partial per file
  and content, continued with an HTTP Range request by the next attempt or the next pull), git-stored
  files (under 10 MB) through ``hf_hub_download``. Partials huggingface_hub left behind (a killed
  process: its ``.incomplete`` files) and ours of other revisions are removed, each only when its
  lock is free; after a success none is left.
- **Ctrl-C stops within a second**: downloads run on daemon threads that stop at their next network
  read (huggingface_hub's through a progress-bar class that raises), the main thread waits
  `STOP_GRACE` for them and re-raises; what was fetched stays for the rerun.
"""

from __future__ import annotations

import os
import queue
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

from larql_edge.console import human
from larql_edge.errors import HubError, VindexError
from larql_edge.format.presets import DEFAULT_SLICES, canonical_preset
from larql_edge.format.vindex import INDEX, Vindex
from larql_edge.tools.slicer.hub import (
    Hub,
    HubCache,
    LocalFolder,
    RemoteFile,
    digest,
    file_lock,
    hub_errors,
    lock_is_free,
    safe_relpath,
    validate_repo_id,
)
from larql_edge.tools.slicer.publish import slice_repo_name
from larql_edge.wire.grid import check_url

WORKERS = 8  # parallel downloads, as huggingface_hub's snapshot_download
STOP_GRACE = 0.5  # seconds the main thread waits, after Ctrl-C, for the downloads to stop
PROGRESS_EVERY = 10.0  # seconds between progress lines of a long pull


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


# -- one repo -------------------------------------------------------------------------------------


class _Target:
    """Where one repo's files go (an output folder, or the Hub cache), and how they get there."""

    def __init__(self, hub: Hub, repo_id: str, commit: str, output: Path | None, cache_dir: Path,
                 stop: threading.Event, log: Callable[[str], None]):
        self.hub, self.repo_id, self.commit, self.stop, self.log = hub, repo_id, commit, stop, log
        self.cache = HubCache(cache_dir, repo_id, hub.repo_type, commit)
        self.local = LocalFolder(output) if output else None
        self.root = output if output else self.cache.root
        self.verified: dict[str, str] = {}  # path -> sha256 of the bytes checked in this pull
        self.fresh_blobs: set[str] = set()  # Hub cache blobs fetched and checked in this pull
        self.fetched = 0  # bytes over the network in this pull (LFS files)
        self._count = threading.Lock()

    def file(self, name: str) -> Path:
        return self.local.file(name) if self.local else self.cache.file(name)

    def count(self, n: int) -> None:
        with self._count:
            self.fetched += n

    # -- git-stored files: huggingface_hub as it is --------------------------------------------------

    def fetch_git(self, rf: RemoteFile) -> dict[str, str]:
        self.hub.download(self.repo_id, rf.path, revision=self.commit, cache_dir=self.cache.cache_dir,
                          local_dir=self.local.root if self.local else None, stop=self.stop)
        return {}

    # -- LFS files: resumable ----------------------------------------------------------------------

    def fetch_lfs(self, group: list[RemoteFile]) -> dict[str, str]:
        """Files of one content (a vindex links lm_head.bin to embeddings.bin): fetched once. Returns
        path -> problem for a file whose bytes came wrong (removed already)."""
        problems: dict[str, str] = {}
        for rf in group:
            problem = self._place_local(rf, group) if self.local else self._place_cached(rf)
            if problem:
                problems[rf.path] = problem
        return problems

    def _place_local(self, rf: RemoteFile, group: list[RemoteFile]) -> str | None:
        assert self.local is not None and rf.lfs_sha256
        sha, dest = rf.lfs_sha256, self.local.file(rf.path)
        if _complete(dest, rf.size):
            if self.local.recorded(rf.path, sha):
                return None  # as huggingface_hub left it; checked with every file after the downloads
            if digest(dest, sha256=True, git=False)[0] == sha:  # placed by hand, or metadata lost: adopt it
                self.local.record(rf.path, self.commit, sha)
                self.verified[rf.path] = sha
                return None
        self.local.forget(rf.path)  # another revision's content, or damaged
        with file_lock(self.local.lock(rf.path), self.stop):
            part = self.local.partial(rf.path, sha)
            # A copy already here (a file of the same content, the Hub cache) beats the network; _fill checks it.
            copies = [self.local.file(o.path) for o in group if o is not rf] + [self.cache.blob(sha)]
            problem = self._fill(rf, part, copies)
            if problem:
                return problem
            dest.parent.mkdir(parents=True, exist_ok=True)
            os.replace(part, dest)
        self.local.record(rf.path, self.commit, sha)  # takes the same lock: huggingface_hub's order too
        self.verified[rf.path] = sha
        return None

    def _place_cached(self, rf: RemoteFile) -> str | None:
        assert rf.lfs_sha256
        sha, pointer, blob = rf.lfs_sha256, self.cache.file(rf.path), self.cache.blob(rf.lfs_sha256)
        if _complete(pointer, rf.size):
            return None  # checked with every file after the downloads
        if not _complete(blob, rf.size):
            with file_lock(self.cache.lock(sha), self.stop):
                if not _complete(blob, rf.size):  # another pull may have finished it meanwhile
                    part = self.cache.partial(sha)
                    problem = self._fill(rf, part, [])
                    if problem:
                        return problem
                    os.replace(part, blob)
                    self.fresh_blobs.add(sha)
        if pointer.is_symlink() or pointer.exists():
            pointer.unlink()  # a link to a blob removed as damaged, or a wrong copy: huggingface_hub would keep it
        self.fetch_git(rf)  # huggingface_hub links the snapshot to the blob now in place, and records the ref
        if sha in self.fresh_blobs:
            self.verified[rf.path] = sha
        return None

    def _fill(self, rf: RemoteFile, part: Path, copies: list[Path]) -> str | None:
        """Make ``part`` the file's exact bytes: from a copy, else from the Hub (continuing ``part``).
        Returns the problem when the bytes fetched are not the Hub's (the partial is removed)."""
        sha = rf.lfs_sha256 or ""
        if not part.exists():
            for src in copies:
                if _complete(src, rf.size):
                    part.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copyfile(src, part)
                    if digest(part, sha256=True, git=False)[0] == sha:
                        return None
                    part.unlink()
                    if src.parent == self.cache.blobs:
                        src.unlink(missing_ok=True)  # a damaged blob in the Hub cache: gone, so nobody copies it again
        had = part.stat().st_size if part.exists() else 0
        got = self.hub.fetch(self.repo_id, rf.path, revision=self.commit, part=part, size=rf.size, stop=self.stop,
                             progress=self.count)
        if got:
            self.log(f"  {rf.path}: {human(got)}" + (f" (resumed at {human(had)})" if had else ""))
        have = digest(part, sha256=True, git=False)[0] or ""
        if have != sha:
            part.unlink(missing_ok=True)
            return f"{rf.path}: downloaded bytes do not match the Hub's sha256 ({have[:12]}…, the Hub lists {sha[:12]}…)"
        return None

    # -- checks and healing ------------------------------------------------------------------------

    def verify(self, listing: dict[str, RemoteFile], skip: set[str]) -> tuple[dict[str, str], list[str]]:
        """Check every file (but ``skip``); return (damaged: path -> problem, the repo's own inconsistencies)."""
        damaged: dict[str, str] = {}
        inconsistent: list[str] = []
        sums: dict[str, str] = {}
        index = self._check(listing[INDEX], None)
        if index:
            damaged[INDEX] = index[0]
        else:
            sums = Vindex.open(self.root).checksums
            inconsistent += [f"{INDEX} lists {n}, which the repo does not hold" for n in sorted(set(sums) - set(listing))]
        for name, rf in sorted(listing.items()):
            if name == INDEX or name in skip:
                continue
            found = self._check(rf, sums.get(name))
            if found and found[1]:
                damaged[name] = found[0]
            elif found:
                inconsistent.append(found[0])
        return damaged, inconsistent

    def _check(self, rf: RemoteFile, index_sha: str | None) -> tuple[str, bool] | None:
        """None when the file is right, else (its problem, whether our copy is damaged: False when the
        bytes are the Hub's and the repo's own index.json disagrees with them)."""
        path = self.file(rf.path)
        if not path.is_file():
            return f"{rf.path}: missing", True
        size = path.stat().st_size
        if size != rf.size:
            return f"{rf.path}: {size} bytes, the Hub lists {rf.size}", True
        known = self.verified.get(rf.path)
        need256 = (rf.lfs_sha256 or index_sha) is not None and known is None
        needgit = rf.lfs_sha256 is None and rf.blob_id is not None
        sha, git = digest(path, sha256=need256, git=needgit) if (need256 or needgit) else (None, None)
        sha = sha or known or ""
        if rf.lfs_sha256 and sha != rf.lfs_sha256:
            return f"{rf.path}: sha256 {sha[:12]}…, the Hub lists {rf.lfs_sha256[:12]}…", True
        if rf.blob_id and needgit and git != rf.blob_id:
            return f"{rf.path}: git blob {(git or '')[:12]}…, the Hub lists {rf.blob_id[:12]}…", True
        if index_sha and sha != index_sha:
            vouched = bool(rf.lfs_sha256 or needgit)  # the Hub's listing vouches for these bytes
            return f"{rf.path}: sha256 {sha[:12]}…, {INDEX} records {index_sha[:12]}…", not vouched
        return None

    def forget(self, name: str, rf: RemoteFile | None) -> None:
        """Remove a damaged file and whatever would hand it out again (metadata, cached blob)."""
        etag = rf.etag if rf else None
        if self.local:
            self.local.forget(name)
            blob = self.cache.blob(etag) if etag else None
            if blob is not None and blob.is_file() and rf is not None:  # a copy source huggingface_hub would reuse
                sha, git = digest(blob, sha256=rf.lfs_sha256 is not None, git=rf.lfs_sha256 is None)
                if (sha or git) != etag:
                    blob.unlink(missing_ok=True)
        else:
            self.cache.forget(name, etag)

    def sweep(self, listing: dict[str, RemoteFile], keep_resumable: bool) -> None:
        """Remove partials nobody will continue: huggingface_hub's (``.incomplete``: a process that died
        while downloading) and ours of other contents; each only when its lock is free. With
        ``keep_resumable``, our partials of this listing stay (the downloads continue them)."""
        lfs = [(rf.path, rf.lfs_sha256) for rf in listing.values() if rf.lfs_sha256]
        if self.local:
            local = self.local
            keep = {local.partial(name, sha) for name, sha in lfs} if keep_resumable else set()
            lock_of = {local.partial(name, sha): local.lock(name) for name, sha in lfs}
            lock_of.update({p: local.lock(rf.path) for rf in listing.values() if rf.etag
                            for p in local.incomplete_of(rf.path, rf.etag)})
            for p in local.partials():  # one of no listed file: another revision's, nobody continues it
                if p not in keep and (p not in lock_of or lock_is_free(lock_of[p])):
                    p.unlink(missing_ok=True)
        keep = {self.cache.partial(sha) for _, sha in lfs} if keep_resumable else set()
        for p in self.cache.partials():
            if p not in keep and lock_is_free(self.cache.lock(p.name.split(".")[0])):
                p.unlink(missing_ok=True)


def _complete(path: Path, size: int) -> bool:
    return path.is_file() and path.stat().st_size == size


def _run(jobs: list[Callable[[], dict[str, str]]], stop: threading.Event, progress: Callable[[], None]) -> dict[str, str]:
    """Run ``jobs`` on daemon threads (a thread pool's workers are joined at exit: after Ctrl-C the
    process would wait for every download in flight); return the problems they report; re-raise the
    first error (after it, the others stop too, keeping what they fetched)."""
    pending: queue.SimpleQueue[Callable[[], dict[str, str]]] = queue.SimpleQueue()
    for job in jobs:
        pending.put(job)
    problems: dict[str, str] = {}
    errors: list[BaseException] = []

    def work() -> None:
        while not stop.is_set():
            try:
                job = pending.get_nowait()
            except queue.Empty:
                return
            try:
                problems.update(job())
            except Exception as e:  # handed to the main thread, which raises it
                errors.append(e)
                stop.set()
                return
            except BaseException:  # the Hub boundary's cancellation: the pull is stopping
                return

    threads = [threading.Thread(target=work, name=f"pull-{i}", daemon=True) for i in range(min(WORKERS, len(jobs)))]
    for t in threads:
        t.start()
    try:
        next_line = time.monotonic() + PROGRESS_EVERY
        for t in threads:
            while t.is_alive():
                t.join(0.1)
                if time.monotonic() >= next_line:
                    progress()
                    next_line += PROGRESS_EVERY
    except KeyboardInterrupt:
        stop.set()
        deadline = time.monotonic() + STOP_GRACE
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        raise
    if errors:
        raise errors[0]
    return problems


def pull_one(hub: Hub, repo_id: str, output: Path | None, revision: str | None, *, cache_dir: Path | None = None,
             stop: threading.Event | None = None, log: Callable[[str], None] = print) -> PullResult:
    from huggingface_hub import constants as hf_constants

    stop = stop or threading.Event()
    res = PullResult(repo=repo_id)
    commit = hub.resolve_commit(repo_id, revision)
    listing = hub.remote_files(repo_id, revision=commit)
    if not listing:
        raise HubError(f"{repo_id}: the repo holds no files")
    for name in listing:
        safe_relpath(name)
    if INDEX not in listing:
        raise HubError(f"{repo_id}: no {INDEX}: not a vindex repo")
    t = _Target(hub, repo_id, commit, output, Path(cache_dir or hf_constants.HF_HUB_CACHE), stop, log)
    t.sweep(listing, keep_resumable=True)

    groups: dict[str, list[RemoteFile]] = {}
    for rf in listing.values():
        if rf.lfs_sha256:
            groups.setdefault(rf.lfs_sha256, []).append(rf)
    jobs: list[Callable[[], dict[str, str]]] = [partial(t.fetch_lfs, g) for g in groups.values()]
    jobs += [partial(t.fetch_git, rf) for rf in listing.values() if not rf.lfs_sha256]
    failed = _run(jobs, stop, lambda: log(f"  ... {human(t.fetched)} fetched"))  # path -> problem, removed already

    damaged, inconsistent = t.verify(listing, skip=set(failed))
    for name in damaged:
        t.forget(name, listing.get(name))
    problems = [failed[n] for n in sorted(failed)] + [damaged[n] for n in sorted(damaged)]
    if problems:
        raise HubError(f"{repo_id}: {len(problems)} file(s) failed verification and were removed, pull again to"
                       f" fetch them: {'; '.join(problems)}")
    if inconsistent:
        raise VindexError(f"{repo_id}: the published repo is inconsistent: {'; '.join(inconsistent)}")
    t.sweep(listing, keep_resumable=False)
    res.path, res.files = t.root, len(listing)
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
    mirror: str | None = None,
    hints: bool = True,
    cache_dir: str | Path | None = None,
    log: Callable[[str], None] = print,
) -> PullReport:
    """Pull one repo, a preset's sibling, all of them, or a collection; into ``output`` or the Hub cache
    (``cache_dir``, default huggingface_hub's). Raises `HubError` (a repo of several that failed is
    reported in its result instead); KeyboardInterrupt stops the downloads within `STOP_GRACE`."""
    if sum(bool(x) for x in (preset, all_slices, collection)) > 1:
        raise HubError("choose one of --preset, --all-slices and --collection")
    if mirror:
        mirror = check_url(mirror, "--mirror")
    hub = Hub(endpoint=endpoint, token=token, repo_type=repo_type, mirror=mirror)
    targets = resolve_targets(hub, repo, preset, all_slices, collection, template)
    report = PullReport()
    out = Path(output) if output else None
    several = len(targets) > 1
    for t in targets:
        dest = (out / t.split("/")[1] if several else out) if out else None
        log(f"Pulling {hub.url(t)} ...")
        try:
            r = pull_one(hub, t, dest, revision, cache_dir=Path(cache_dir) if cache_dir else None, log=log)
            log(f"  {r.files} files verified at {r.path}")
        except (HubError, VindexError) as e:
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
