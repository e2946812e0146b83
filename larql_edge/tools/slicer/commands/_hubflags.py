from __future__ import annotations

import argparse
import os

from larql_edge.tools.slicer.hub import REPO_TYPES


def add_hub_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--repo-type", choices=REPO_TYPES, default=os.environ.get("LARQL_REPO_TYPE", "dataset"),
                   help="Hub repo type for every repo and collection item (default: dataset) [env LARQL_REPO_TYPE]")
    p.add_argument("--endpoint", default=os.environ.get("HF_ENDPOINT") or None,
                   help="a Hub-compatible server (default: HF_ENDPOINT, else the public Hub)")
    p.add_argument("--slice-repo-template", default="{repo}-{preset}",
                   help='sibling naming; {repo} and {preset} substitute (default "{repo}-{preset}")')
