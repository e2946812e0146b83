"""``larql-embed``: serve embeddings, lm_head and tokenizer of one or more vindexes (ADR-0008).

    larql-embed VINDEX [VINDEX ...] [--embed-only] [--host 0.0.0.0] [--port 8082] [--workers N]
                [--hot-cache N] [--blas-threads N] [--batch-wait-ms MS] [--max-batch N] ...

Each VINDEX is a folder (any preset from ``embed`` up), optionally named ``ID=PATH``; the first
one is the default model. Every flag has a ``LARQL_`` environment twin (``--hot-cache`` ->
``LARQL_HOT_CACHE``; the vindex list -> ``LARQL_VINDEX``, whitespace-separated).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from functools import partial
from pathlib import Path

from larql_edge.config import Flags, cache_dir, export_blas_threads, positional_list_from_env
from larql_edge.errors import LarqlError
from larql_edge.model.lm_head import HEAD_FORMATS
from larql_edge.roles.embed.config import EmbedConfig, Limits, ModelSource, check_model_id, model_id_for
from larql_edge.service import add_server_flags, serve, setup_logging, tls_settings
from larql_edge.service.identity import add_verify_flag, verify_weights
from larql_edge.service.membership import add_membership_flags, membership_settings


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="larql-embed",
        description="Serve the embeddings, lm_head and tokenizer of vindexes over HTTP (the embed server).",
    )
    p.add_argument("vindex", nargs="*", metavar="VINDEX", help="vindex folder, or ID=PATH [env LARQL_VINDEX]")
    f = Flags(p)
    d = Limits()
    f.switch(
        "--embed-only",
        help="LARQL compatibility: larql-embed always runs in embed-service mode and never loads attention or FFN weights",
    )
    add_server_flags(f, port=8082, workers=True)
    f.add("--hot-cache", type=int, default=5000, help="rows of the L1 cache of the most used ids, per worker (0: off)")
    f.add("--batch-wait-ms", type=float, default=d.batch_wait_ms,
          help="longest wait of an idle logits batcher for company (it ends after 1 ms without a new request)")
    f.add("--max-batch", type=int, default=d.max_batch, help="most residuals in one lm_head product")
    f.add("--max-tokens", type=int, default=d.max_tokens, help="most token ids per request")
    f.add("--max-body", type=int, default=d.max_body, help="largest request body in bytes (413 above)")
    f.add("--max-top-k", type=int, default=d.max_top_k, help="largest top_k of /v1/logits")
    f.add("--max-text-chars", type=int, default=d.max_text_chars, help="longest text to encode, in characters")
    f.add("--lm-head-cache", default=str(cache_dir() / "lm-head"),
          help="folder of the shared lm_head compute copies ('' keeps a copy in process memory)")
    f.choice("--lm-head-format", choices=HEAD_FORMATS, default="auto",
             help="form the lm_head is multiplied in: auto = as stored (a quantized vindex's tied head as Q8_0), "
                  "or a q8_0 / f16 / f32 copy")
    add_verify_flag(f)
    add_membership_flags(f)  # --join, --grid-key (secret), --public-url: register as capability "embed"
    return p


def _sources(items: list[str]) -> list[ModelSource]:
    from larql_edge.format.vindex import Vindex

    out = []
    for item in items:
        mid, _, rest = item.partition("=")
        if rest and not Path(item).exists():
            path, given = rest, mid
        else:
            path, given = item, None
        vx = Vindex.open(path)
        mid = given or model_id_for(path, vx.model)
        check_model_id(mid)
        out.append(ModelSource(id=mid, path=str(Path(path).resolve())))
    return out


def _check(sources: list[ModelSource]) -> list[str]:
    from larql_edge.format.vindex import Vindex
    from larql_edge.roles.embed.model import check_files

    problems = []
    for s in sources:
        problems += [f"{s.path}: {p}" for p in check_files(Vindex.open(s.path))]
    ids = [s.id for s in sources]
    problems += [f"model id {i!r} is given twice (name them apart with ID=PATH)" for i in sorted(set(ids)) if ids.count(i) > 1]
    return problems


def config_from_args(args: argparse.Namespace, sources: list[ModelSource]) -> EmbedConfig:
    return EmbedConfig(
        models=tuple(sources),
        host=args.host,
        port=args.port,
        workers=max(1, args.workers),
        hot_cache=max(0, args.hot_cache),
        blas_threads=max(1, args.blas_threads),
        lm_head_cache=args.lm_head_cache or None,
        lm_head_format=args.lm_head_format,
        embed_only=args.embed_only,
        access_log=args.access_log,
        limits=Limits(
            max_tokens=args.max_tokens,
            max_body=args.max_body,
            max_top_k=args.max_top_k,
            max_text_chars=args.max_text_chars,
            batch_wait_ms=args.batch_wait_ms,
            max_batch=args.max_batch,
        ),
    )


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    setup_logging(args.log_level)
    items = positional_list_from_env(args.vindex, "LARQL_VINDEX")
    if not items:
        parser.error("give at least one VINDEX (or set LARQL_VINDEX)")
    for name, value in (("--max-batch", args.max_batch), ("--max-tokens", args.max_tokens), ("--max-body", args.max_body),
                        ("--max-top-k", args.max_top_k), ("--max-text-chars", args.max_text_chars)):  # fmt: skip
        if value < 1:
            parser.error(f"{name} must be >= 1")
    if args.batch_wait_ms < 0:
        parser.error("--batch-wait-ms must be >= 0")
    try:
        tls = tls_settings(args)
        if tls.serving and args.workers > 1:
            raise ValueError("TLS with --workers > 1 is not supported: run one worker per process")
        grid = membership_settings(args, args.host, args.port)  # None without --join; messages never hold the key
        sources = _sources(items)
    except (LarqlError, ValueError) as e:  # an unreadable folder or a bad id: say it before binding anything
        print(f"larql-embed: {e}", file=sys.stderr)
        return 2
    problems = _check(sources)
    if problems:
        print("larql-embed: cannot serve:\n  " + "\n  ".join(problems), file=sys.stderr)
        return 2
    from larql_edge.format.vindex import Vindex

    try:  # before binding: a damaged file is refused at start, never served
        weights = {s.id: verify_weights(Vindex.open(s.path), args.verify_weights).as_json() for s in sources}
    except LarqlError as e:
        print(f"larql-embed: {e}", file=sys.stderr)
        return e.exit_code
    cfg = dataclasses.replace(config_from_args(args, sources), grid=grid, weights=weights)
    # Workers are spawned processes: what they inherit must be in the environment before they start.
    export_blas_threads(cfg.blas_threads)
    from larql_edge.service.metrics import prepare_multiprocess

    try:
        prepare_multiprocess("embed")
    except LarqlError as e:
        print(f"larql-embed: {e}", file=sys.stderr)
        return e.exit_code
    from larql_edge.roles.embed.app import create_app

    serve(partial(create_app, cfg), cfg.host, cfg.port, workers=cfg.workers, access_log=cfg.access_log,
          drain=args.drain_seconds, tls=tls)
    return 0


if __name__ == "__main__":
    sys.exit(main())
