from __future__ import annotations

import argparse

from larql_edge.config import Flags
from larql_edge.format.presets import DEFAULT_SLICES
from larql_edge.tools.slicer.commands._hubflags import add_hub_flags
from larql_edge.tools.slicer.publish import COLLECTION_LEVELS, DEFAULT_LIBRARY_TITLE, publish, render_report


def _list(text: str) -> list[str]:
    return [] if text.strip().lower() == "none" else [t.strip() for t in text.split(",") if t.strip()]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "publish",
        help="upload the full vindex and its preset slices as Hub repos, filed into collections",
        description="Publish SRC to REPO and each preset slice to a sibling repo, one commit per repo. "
        "Files whose sha256 equals the remote lfs.oid are skipped. The token comes from --hf-token(-file), "
        "HF_TOKEN or `hf auth login` and is never printed.",
    )
    p.add_argument("src", metavar="SRC")
    f = Flags(p)
    f.add("--repo", required=True, metavar="OWNER/NAME", help="the Hub repo of the full vindex")
    f.add("--slices", default=",".join(DEFAULT_SLICES), help="presets to publish as sibling repos, or none")
    f.toggle("--full", default=True, help="publish the full vindex to --repo (--no-full: only the slices)")
    f.add("--collections", default=",".join(COLLECTION_LEVELS), help="model,family,library or none")
    f.add("--model-title", help="override the model collection's title")
    f.add("--family", help="override the family collection's grouping")
    f.add("--library-title", default=DEFAULT_LIBRARY_TITLE, help="the library collection's title")
    f.switch("--force-upload", help="re-upload every file (no sha256 skip)")
    f.add("--tmp-dir", help="where to stage slices (default: beside SRC, so they are hard links)")
    f.switch("--dry-run", help="print the plan; create nothing, upload nothing")
    add_hub_flags(f)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    rep = publish(
        args.src, args.repo, slices=_list(args.slices), full=args.full,
        template=args.slice_repo_template, collections=_list(args.collections), model_title=args.model_title,
        family=args.family, library_title=args.library_title, repo_type=args.repo_type,
        force_upload=args.force_upload, dry_run=args.dry_run, endpoint=args.endpoint, token=args.hf_token,
        tmp_dir=args.tmp_dir,
    )
    for line in render_report(rep):
        print(line)
    return 0
