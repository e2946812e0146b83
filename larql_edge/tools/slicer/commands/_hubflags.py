from __future__ import annotations

from larql_edge.config import Flags
from larql_edge.tools.slicer.hub import REPO_TYPES


def add_hub_flags(f: Flags) -> None:
    f.choice("--repo-type", choices=REPO_TYPES, default="dataset",
             help="Hub repo type for every repo and collection item")
    f.add("--endpoint", default=None, env="HF_ENDPOINT",
          help="a Hub-compatible server (default: the public Hub)")
    f.add("--hf-token", default=None, secret=True, metavar="TOKEN",
          help="Hub token (default: HF_TOKEN or the token of `hf auth login`)")
    f.add("--slice-repo-template", default="{repo}-{preset}",
          help='sibling naming; {repo} and {preset} substitute')
