"""Carve a built vindex into deployment presets without re-extracting (ADR-0007, DESIGN.md §1).

Pure file I/O plus an ``index.json`` rewrite: files are hard-linked when source and destination
share a filesystem (vindex files are never modified in place, so links are safe), copied otherwise.
"""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from larql_edge.console import human
from larql_edge.errors import SliceError
from larql_edge.format.presets import level_for, part_of, resolve_parts
from larql_edge.format.vindex import INDEX, Vindex, checksum_folder, staged_output, write_index


@dataclass
class SlicePlan:
    src: Path
    dst: Path
    parts: list[str]
    files: list[tuple[str, int]]  # kept (name, size)
    skipped: list[tuple[str, int]]
    level_from: str
    level_to: str
    has_model_weights: bool
    actions: dict[str, str] = field(default_factory=dict)  # name -> "linked" | "copied"

    @property
    def bytes(self) -> int:
        return sum(s for _, s in self.files)


def plan_slice(src: str | os.PathLike[str], dst: str | os.PathLike[str], parts: list[str]) -> SlicePlan:
    vx = Vindex.open(src)
    src_p, dst_p = vx.path.resolve(), Path(dst).resolve()
    if dst_p == src_p or src_p in dst_p.parents:
        raise SliceError(f"destination {dst} is the source or inside it")
    kept: list[tuple[str, int]] = []
    skipped: list[tuple[str, int]] = []
    for f in vx.files():
        if f.name == INDEX or f.name.startswith("."):
            continue
        entry = (f.name, f.stat().st_size)
        (kept if part_of(f.name) in parts else skipped).append(entry)
    present = {p for n, _ in kept if (p := part_of(n)) is not None}
    src_level = vx.index.extract_level
    return SlicePlan(
        src=vx.path,
        dst=Path(dst),
        parts=parts,
        files=kept,
        skipped=skipped,
        level_from=src_level,
        level_to=level_for(present, src_level, kept_everything=not skipped),
        # LARQL's weight loaders (its embed-only server's included) refuse a vindex without it: true
        # whenever any weight beyond the embeddings is kept.
        has_model_weights=bool(present & {"attn", "ffn", "norms", "lm_head"}),
    )


def _place(src: Path, dst: Path) -> str:
    try:
        os.link(src, dst)
        return "linked"
    except OSError as e:
        if e.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP, errno.EACCES):
            raise
    shutil.copy2(src, dst)
    return "copied"


def slice_vindex(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    preset: str | None = None,
    parts: Iterable[str] = (),
    force: bool = False,
    dry_run: bool = False,
    log: Callable[[str], None] = print,
) -> SlicePlan:
    """Make ``dst`` hold the chosen parts of ``src`` plus a rewritten index.json."""
    plan = plan_slice(src, dst, resolve_parts(preset, parts))
    if dry_run:
        return plan
    vx = Vindex.open(plan.src)
    with staged_output(plan.dst, force=force) as tmp:
        for name, _ in plan.files:
            plan.actions[name] = _place(plan.src / name, tmp / name)
        sums = {n: d for n, d in vx.checksums.items() if (tmp / n).is_file()} or checksum_folder(tmp)
        missing = [n for n, _ in plan.files if n not in sums]
        if missing:  # files the source never checksummed (e.g. a README added by hand)
            sums.update({n: d for n, d in checksum_folder(tmp).items() if n in missing})
        write_index(tmp, vx.index.replace(extract_level=plan.level_to, has_model_weights=plan.has_model_weights,
                                          checksums=sums))
    return plan


def describe(plan: SlicePlan, dry_run: bool = False) -> list[str]:
    lines = []
    verb = "would keep" if dry_run else None
    for name, size in plan.files:
        lines.append(f"  {verb or plan.actions.get(name, 'kept'):<10} {name:<26} {human(size):>10}")
    for name, size in plan.skipped:
        lines.append(f"  {'skipped':<10} {name:<26} {human(size):>10}")
    change = plan.level_from if plan.level_from == plan.level_to else f"{plan.level_from} -> {plan.level_to}"
    lines.append(f"  level {change}; has_model_weights={str(plan.has_model_weights).lower()}; "
                 f"{len(plan.files)} files, {human(plan.bytes)}")
    return lines
