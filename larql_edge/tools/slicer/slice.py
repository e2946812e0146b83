"""Carve a built vindex into deployment presets without re-extracting (ADR-0007, DESIGN.md §1).

Pure file I/O plus an ``index.json`` rewrite: files are hard-linked when source and destination
share a filesystem (vindex files are never modified in place, so links are safe), copied otherwise.
"""

from __future__ import annotations

import errno
import fnmatch
import os
import shutil
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from larql_edge.tools.slicer.errors import SliceError
from larql_edge.format.vindex import INDEX, Vindex, checksum_folder, level_rank, staged_output, write_index

# Part -> file name patterns (the ADR-0007 catalogue).
PARTS: dict[str, tuple[str, ...]] = {
    "embed": ("embeddings.bin",),
    "norms": ("norms.bin",),
    "attn": ("attn_weights*.bin", "attn_weights*.json"),
    "gate": ("gate_vectors.bin", "gate_vectors_q4.bin"),
    "down_meta": ("down_meta.bin", "down_meta.jsonl"),
    "ffn": ("interleaved*.bin", "interleaved*.json", "up_weights.bin", "down_weights.bin", "up_features.bin", "down_features.bin"),
    "lm_head": ("lm_head*.bin",),
    "router": ("router_weights.bin",),
    "tokenizer": ("tokenizer.json",),
    "manifest": ("weight_manifest.json",),
    "labels": ("feature_labels.json", "feature_clusters.jsonl", "relation_clusters.json"),
    "readme": ("README.md",),
}

PRESETS: dict[str, tuple[str, ...]] = {
    # 2-tier: the client holds the embeddings itself.
    "client": ("embed", "norms", "attn", "tokenizer", "manifest", "labels"),
    # 3-tier client (ADR-0008): attention and norms only. larql-edge adds the tokenizer so the
    # client can encode prompts and stream text without a round trip per token.
    "attn": ("norms", "attn", "tokenizer", "manifest", "labels"),
    # Embed server: larql-edge adds what /v1/logits needs (final norm via norms + manifest, lm_head
    # when untied), so this preset alone serves every embed-server endpoint.
    "embed": ("embed", "tokenizer", "labels", "norms", "manifest", "lm_head"),
    "server": ("embed", "norms", "gate", "down_meta", "ffn", "tokenizer", "manifest", "labels"),
    "browse": ("embed", "gate", "down_meta", "tokenizer", "labels", "readme"),
    "router": ("router", "tokenizer", "manifest", "labels", "readme"),
    "all": tuple(PARTS),
}
ALIASES = {"attention": "attn", "embed-server": "embed", "ffn": "server"}
DEFAULT_SLICES = ("client", "attn", "embed", "server", "browse")


def canonical_preset(name: str) -> str:
    name = ALIASES.get(name, name)
    if name not in PRESETS:
        known = ", ".join(sorted(set(PRESETS) | set(ALIASES)))
        raise SliceError(f"unknown preset {name!r} (known: {known})")
    return name


def resolve_parts(preset: str | None, parts: Iterable[str] = ()) -> list[str]:
    """The union of a preset's parts and explicit parts, in catalogue order."""
    chosen: set[str] = set(PRESETS[canonical_preset(preset)]) if preset else set()
    for p in parts:
        p = p.strip()
        if not p:
            continue
        if p not in PARTS:
            raise SliceError(f"unknown part {p!r} (known: {', '.join(PARTS)})")
        chosen.add(p)
    if not chosen:
        raise SliceError("nothing to slice: give --preset and/or --parts")
    return [p for p in PARTS if p in chosen]


def part_of(filename: str) -> str | None:
    for part, patterns in PARTS.items():
        if any(fnmatch.fnmatchcase(filename, pat) for pat in patterns):
            return part
    return None


def level_for(present_parts: set[str], source_level: str, kept_everything: bool) -> str:
    """The strongest tier the kept files support, never above the source's."""
    if kept_everything:
        return source_level
    if {"attn", "norms"} <= present_parts:
        level = "inference" if {"gate", "ffn"} <= present_parts else "attention"
    else:
        level = "browse"
    return level if level_rank(level) <= level_rank(source_level) else source_level


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
    kept, skipped = [], []
    for f in vx.files():
        if f.name == INDEX or f.name.startswith("."):
            continue
        entry = (f.name, f.stat().st_size)
        (kept if part_of(f.name) in parts else skipped).append(entry)
    present = {part_of(n) for n, _ in kept} - {None}
    src_level = str(vx.index.get("extract_level", "all"))
    return SlicePlan(
        src=vx.path,
        dst=Path(dst),
        parts=parts,
        files=kept,
        skipped=skipped,
        level_from=src_level,
        level_to=level_for(present, src_level, kept_everything=not skipped),
        has_model_weights=bool(present & {"attn", "ffn"}),
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
        index = dict(vx.index)
        index["extract_level"] = plan.level_to
        index["has_model_weights"] = plan.has_model_weights
        index["checksums"] = {n: d for n, d in vx.checksums.items() if (tmp / n).is_file()} or checksum_folder(tmp)
        missing = [n for n, _ in plan.files if n not in index["checksums"]]
        if missing:  # files the source never checksummed (e.g. a README added by hand)
            index["checksums"].update({n: d for n, d in checksum_folder(tmp).items() if n in missing})
        write_index(tmp, index)
    return plan


def describe(plan: SlicePlan, dry_run: bool = False) -> list[str]:
    from larql_edge.tools.slicer.commands.inspect import human

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
