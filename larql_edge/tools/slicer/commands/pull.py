from __future__ import annotations

import argparse
import sys

from larql_edge.config import Flags
from larql_edge.console import INTERRUPTED
from larql_edge.tools.slicer.commands._hubflags import add_hub_flags
from larql_edge.tools.slicer.pull import pull


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "pull",
        help="download a published vindex, a preset, all slices or a collection (complete and verified)",
    )
    p.add_argument("repo", nargs="?", metavar="REPO", help="OWNER/NAME (not with --collection)")
    f = Flags(p)
    g = p.add_mutually_exclusive_group()
    fg = Flags(g, owner=p)
    fg.add("--preset", help="pull the sibling repo of this preset")
    fg.switch("--all-slices", help="pull the full repo and every standard sibling")
    fg.add("--collection", metavar="SLUG", help="pull every repo of a collection")
    f.add("--output", "-o", metavar="PATH", help="folder to hydrate (default: the Hub cache)")
    f.add("--revision", help="branch, tag or commit")
    add_hub_flags(f)
    f.add("--mirror", default=None, metavar="URL",
          help="fetch file contents through this cache of the Hub (deploy/nginx/hub-mirror.conf: it keeps "
               "/resolve/COMMIT/ URLs, which never change); the listing still comes from --endpoint")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        rep = pull(args.repo, preset=args.preset, all_slices=args.all_slices, collection=args.collection,
                   output=args.output, revision=args.revision, repo_type=args.repo_type,
                   template=args.slice_repo_template, endpoint=args.endpoint, token=args.hf_token,
                   mirror=args.mirror)
    except KeyboardInterrupt:
        # The downloads have stopped (pull waits for them briefly; what still runs is a daemon thread that
        # dies with the process). One line, and what to do next.
        print("larql-slicer pull: interrupted; what was downloaded is kept: run the same command again to finish",
              file=sys.stderr, flush=True)
        return INTERRUPTED
    ok = [r for r in rep.results if not r.error]
    print(f"Pulled {len(ok)}/{len(rep.results)} repos")
    for r in rep.results:
        print(f"  {r.repo:<48} {'FAILED: ' + r.error if r.error else r.path}")
    if rep.siblings:
        print("\n  Also available:")
        for flag, name in rep.siblings:
            print(f"    {flag:<16} -> {name}")
        print("  Use `larql-slicer pull <repo> --all-slices` to grab them all.")
    return 0 if len(ok) == len(rep.results) else 1
