from __future__ import annotations

import argparse

from larql_edge.tools.slicer.publish import COLLECTION_LEVELS, DEFAULT_LIBRARY_TITLE, publish, render_report
from larql_edge.tools.slicer.slice import DEFAULT_SLICES
from larql_edge.tools.slicer.commands._hubflags import add_hub_flags


def _list(text: str) -> list[str]:
    return [] if text.strip().lower() == "none" else [t.strip() for t in text.split(",") if t.strip()]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "publish",
        help="upload the full vindex and its preset slices as Hub repos, filed into collections",
        description="Publish SRC to REPO and each preset slice to a sibling repo, one commit per repo. "
        "Files whose sha256 equals the remote lfs.oid are skipped. The token comes from HF_TOKEN or "
        "`hf auth login` and is never printed.",
    )
    p.add_argument("src", metavar="SRC")
    p.add_argument("--repo", required=True, metavar="OWNER/NAME")
    p.add_argument("--slices", default=",".join(DEFAULT_SLICES), help=f"presets to publish, or none (default {','.join(DEFAULT_SLICES)})")
    p.add_argument("--full", dest="full", action="store_true", default=True, help="publish the full vindex to --repo (default)")
    p.add_argument("--no-full", dest="full", action="store_false", help="do not publish the full vindex")
    p.add_argument("--collections", default=",".join(COLLECTION_LEVELS), help="model,family,library or none")
    p.add_argument("--model-title", help="override the model collection's title")
    p.add_argument("--family", help="override the family collection's grouping")
    p.add_argument("--library-title", default=DEFAULT_LIBRARY_TITLE)
    p.add_argument("--force-upload", action="store_true", help="re-upload every file (no sha256 skip)")
    p.add_argument("--tmp-dir", help="where to stage slices (default: beside SRC, so they are hard links)")
    p.add_argument("--dry-run", action="store_true", help="print the plan; create nothing, upload nothing")
    add_hub_flags(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    rep = publish(
        args.src, args.repo, slices=_list(args.slices), full=args.full, template=args.slice_repo_template,
        collections=_list(args.collections), model_title=args.model_title, family=args.family,
        library_title=args.library_title, repo_type=args.repo_type, force_upload=args.force_upload,
        dry_run=args.dry_run, endpoint=args.endpoint, tmp_dir=args.tmp_dir,
    )
    for line in render_report(rep):
        print(line)
    return 0
