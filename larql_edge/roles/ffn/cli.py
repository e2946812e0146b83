"""larql-ffn VINDEX --layers A-B: serve the FFN of a range of layers over HTTP.

Loads only the FFN weights (gate, up, down) of its own layers. With ``--join ROUTER_URL
--grid-key KEY`` it registers with the grid's routers (capability ``ffn``) and sends heartbeats.
"""

from __future__ import annotations

import argparse
import logging
import sys

from larql_edge.config import Flags, positional_list_from_env
from larql_edge.errors import LarqlError
from larql_edge.format.layers import LayerRange
from larql_edge.service import add_server_flags, pin_blas, serve, setup_logging, tls_settings
from larql_edge.service.identity import add_verify_flag
from larql_edge.service.membership import add_membership_flags, install_membership, membership_settings

log = logging.getLogger("larql.ffn")


def build_parser() -> argparse.ArgumentParser:
    from larql_edge.roles.ffn.shard import Limits

    p = argparse.ArgumentParser(prog="larql-ffn", description="Serve the FFN layers of a vindex (POST /v1/walk-ffn).")
    p.add_argument("vindex", nargs="*", metavar="VINDEX", help="vindex folder (a full vindex or an ffn slice) [env LARQL_VINDEX]")
    f = Flags(p)
    f.add("--layers", default=None, metavar="A-B", help="inclusive layer range to serve (default: all layers)")
    d = Limits()
    f.add("--max-rows", type=int, default=d.max_rows, help="most positions per request (413 above)")
    f.add("--max-reply-bytes", type=int, default=d.max_reply_bytes, help="largest reply a request may ask for (413 above)")
    add_server_flags(f, port=8080)
    add_verify_flag(f)
    add_membership_flags(f)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    setup_logging(args.log_level)
    paths = positional_list_from_env(args.vindex, "LARQL_VINDEX")
    if len(paths) != 1:
        parser.error("give exactly one VINDEX folder (or set LARQL_VINDEX)")
    if args.max_rows < 1 or args.max_reply_bytes < 1:
        parser.error("--max-rows and --max-reply-bytes must be >= 1")
    try:
        layers = LayerRange.parse(args.layers) if args.layers else None
        tls = tls_settings(args)
        grid = membership_settings(args, args.host, args.port)
    except (ValueError, LarqlError) as e:
        parser.error(str(e))
    pin_blas(args.blas_threads)
    from larql_edge.roles.ffn.app import create_app
    from larql_edge.roles.ffn.shard import Limits, Shard

    try:
        shard = Shard(paths[0], layers, limits=Limits(max_rows=args.max_rows, max_reply_bytes=args.max_reply_bytes),
                      verify=args.verify_weights)
    except LarqlError as e:
        print(f"larql-ffn: error: {e}", file=sys.stderr)
        return e.exit_code

    def factory():
        app = create_app(shard)
        install_membership(app, grid, "ffn", lambda: shard.describe(app.ctx.compute.inflight))
        return app

    log.info("larql-ffn: %s layers %s (%d of %d) loaded in %.2fs; listening on %s://%s:%d",
             shard.model, shard.range, len(shard.range), shard.spec.num_layers, shard.load_seconds,
             "https" if tls.serving else "http", args.host, args.port)
    serve(factory, args.host, args.port, access_log=args.access_log, drain=args.drain_seconds, tls=tls)
    return 0


if __name__ == "__main__":
    sys.exit(main())
