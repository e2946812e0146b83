"""larql-ffn VINDEX --layers A-B: serve the FFN of a range of layers over HTTP.

Loads only the FFN weights (gate, up, down) of its own layers. With ``--join ROUTER_URL
--grid-key KEY`` it registers with a larql-router (capability ``ffn``) and sends heartbeats.
"""

from __future__ import annotations

import argparse
import logging
import sys

from larql_edge.tools.slicer.errors import LarqlError

from larql_edge.config import Flags, positional_list_from_env
from larql_edge.format.layers import LayerRange
from larql_edge.service.membership import add_membership_flags, install_membership, membership_settings
from larql_edge.service.serving import add_server_flags, pin_blas, run, setup_logging

log = logging.getLogger("larql.ffn")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="larql-ffn", description="Serve the FFN layers of a vindex (POST /v1/walk-ffn).")
    p.add_argument("vindex", nargs="*", metavar="VINDEX", help="vindex folder (a full vindex or an ffn slice) [env LARQL_VINDEX]")
    f = Flags(p)
    f.add("--layers", default=None, metavar="A-B", help="inclusive layer range to serve (default: all layers)")
    add_server_flags(f, port=8080)
    add_membership_flags(f)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    setup_logging(args.log_level)
    paths = positional_list_from_env(args.vindex, "LARQL_VINDEX")
    if len(paths) != 1:
        parser.error("give exactly one VINDEX folder")
    try:
        layers = LayerRange.parse(args.layers) if args.layers else None
        grid = membership_settings(args, args.host, args.port)
    except ValueError as e:
        parser.error(str(e))
    pin_blas(args.blas_threads)
    try:
        from larql_edge.roles.ffn.server import create_app
        from larql_edge.roles.ffn.shard import Shard

        shard = Shard(paths[0], layers)
    except LarqlError as e:
        print(f"larql-ffn: error: {e}", file=sys.stderr)
        return 1
    app = create_app(shard)
    if grid:
        install_membership(app, grid["router_url"], grid["grid_key"], grid["public_url"], "ffn", shard.describe)
    log.info("larql-ffn: %s layers %s (%d of %d) loaded in %.2fs; listening on http://%s:%d",
             shard.model, shard.range, len(shard.range), shard.spec.num_layers, shard.load_seconds, args.host, args.port)
    run(app, args.host, args.port)
    return 0


if __name__ == "__main__":
    sys.exit(main())
