"""larql-router --grid-key KEY [--shards "0-8=URL,9-17=URL"] [--embed URL]: the grid's front door.

Members (larql-ffn, larql-embed) join with ``--join ROUTER_URL --grid-key KEY``; ``--shards`` and
``--embed`` add static members that are probed instead of heartbeating. Several routers can serve
one grid: members join all of them, clients fail over between them.
"""

from __future__ import annotations

import argparse
import logging
import sys

from larql_edge.config import Flags
from larql_edge.errors import LarqlError
from larql_edge.service import add_server_flags, pin_blas, serve, setup_logging, tls_settings
from larql_edge.wire.grid import check_url, parse_targets

log = logging.getLogger("larql.router")


def build_parser() -> argparse.ArgumentParser:
    from larql_edge.roles.router.app import Limits

    p = argparse.ArgumentParser(prog="larql-router",
                                description="Route FFN layers to shards and proxy the embed server; members join with the grid key.")
    f = Flags(p)
    d = Limits()
    f.add("--grid-key", default=None, secret=True, metavar="KEY", help="shared key members must present to join (required)")
    f.add("--shards", default="", metavar="SPEC", help='static FFN shards: "0-8=URL,9-17=URL" (a bare URL serves all layers)')
    f.add("--embed", default="", metavar="URL", help="static embed server URL(s), comma-separated")
    f.add("--heartbeat-interval", type=float, default=2.0, help="seconds between member heartbeats")
    f.add("--evict-after", type=float, default=None, help="evict a member silent this long (default: 3 heartbeat intervals)")
    f.add("--upstream-timeout", type=float, default=d.upstream_timeout, help="seconds to wait for a member's reply")
    f.add("--upstream-ms-per-row", type=float, default=d.upstream_ms_per_row,
          help="milliseconds added to --upstream-timeout per row x layer a request asks a member to compute")
    f.add("--upstream-max-wait", type=float, default=d.upstream_max_wait,
          help="seconds a member that still heartbeats is waited for past that deadline when no other replica "
               "can answer (slow is not failed; a static member's deadline is a failure)")
    f.add("--max-body", type=int, default=d.max_body, help="largest walk-ffn request body in bytes (413 above)")
    f.add("--max-reply-bytes", type=int, default=d.max_reply_bytes,
          help="largest reply one walk-ffn request may ask for (rows x layers x hidden x 4; 413 above)")
    add_server_flags(f, port=9090)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    setup_logging(args.log_level)
    if not args.grid_key:
        parser.error("--grid-key is required (or --grid-key-file, LARQL_GRID_KEY, LARQL_GRID_KEY_FILE)")
    if args.heartbeat_interval <= 0 or (args.evict_after is not None and args.evict_after <= 0):
        parser.error("--heartbeat-interval and --evict-after must be positive")
    if (args.upstream_timeout <= 0 or args.max_body < 1 or args.max_reply_bytes < 1 or args.upstream_ms_per_row < 0
            or args.upstream_max_wait <= 0):
        parser.error("--upstream-timeout, --upstream-max-wait, --max-body and --max-reply-bytes must be positive, "
                     "--upstream-ms-per-row >= 0")
    try:
        tls = tls_settings(args)
        shards = parse_targets(args.shards, "--shards")
        embeds = [check_url(u.strip(), "--embed") for u in args.embed.split(",") if u.strip()]
    except (ValueError, LarqlError) as e:
        parser.error(str(e))
    pin_blas(args.blas_threads)

    from larql_edge.roles.router.app import Limits, create_app
    from larql_edge.roles.router.registry import Registry

    registry = Registry(heartbeat_interval=args.heartbeat_interval, evict_after=args.evict_after)
    for t in shards:
        registry.add_static("ffn", t.url, t.layers)
    for url in embeds:
        registry.add_static("embed", url)
    limits = Limits(max_body=args.max_body, max_reply_bytes=args.max_reply_bytes, upstream_timeout=args.upstream_timeout,
                    upstream_ms_per_row=args.upstream_ms_per_row, upstream_max_wait=args.upstream_max_wait)
    log.info("larql-router listening on %s://%s:%d (%d static shards, %d static embed)",
             "https" if tls.serving else "http", args.host, args.port, len(shards), len(embeds))
    serve(lambda: create_app(registry, args.grid_key, limits), args.host, args.port, access_log=args.access_log,
          drain=args.drain_seconds, tls=tls)
    return 0


if __name__ == "__main__":
    sys.exit(main())
