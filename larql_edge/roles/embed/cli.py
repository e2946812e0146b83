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
import logging
import os
import sys
from functools import partial
from pathlib import Path

from larql_edge.config import Flags, positional_list_from_env

from larql_edge.roles.embed.config import EmbedConfig, Limits, ModelSource, check_model_id, model_id_for

BLAS_ENV = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")


def build_parser() -> argparse.ArgumentParser:
    from larql_edge.tools.slicer.cache import cache_dir

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
    f.add("--host", default="0.0.0.0", help="address to listen on")
    f.add("--port", type=int, default=8082, help="port to listen on")
    f.add("--workers", type=int, default=1, help="worker processes (each maps the same files; metrics add up)")
    f.add("--hot-cache", type=int, default=5000, help="rows of the L1 cache of the most used ids, per worker (0: off)")
    f.add("--blas-threads", type=int, default=0, help="BLAS threads per worker (0: cores / workers)")
    f.add("--batch-wait-ms", type=float, default=d.batch_wait_ms, help="longest wait of an idle logits batcher for company (it ends after 1 ms without a new request)")
    f.add("--max-batch", type=int, default=d.max_batch, help="most residuals in one lm_head product")
    f.add("--max-tokens", type=int, default=d.max_tokens, help="most token ids per request")
    f.add("--max-body", type=int, default=d.max_body, help="largest request body in bytes (413 above)")
    f.add("--max-top-k", type=int, default=d.max_top_k, help="largest top_k of /v1/logits")
    f.add("--max-text-chars", type=int, default=d.max_text_chars, help="longest text to encode, in characters")
    f.add(
        "--lm-head-cache",
        default=str(cache_dir() / "lm-head"),
        help="folder of the shared f32 lm_head compute copies ('' keeps the copy in process memory)",
    )
    f.switch("--access-log", help="log every request")
    f.add("--log-level", default="INFO", help="log level")
    from larql_edge.service.membership import add_membership_flags

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
    workers = max(1, args.workers)
    blas = args.blas_threads if args.blas_threads > 0 else max(1, (os.cpu_count() or 1) // workers)
    return EmbedConfig(
        models=tuple(sources),
        host=args.host,
        port=args.port,
        workers=workers,
        hot_cache=max(0, args.hot_cache),
        blas_threads=blas,
        lm_head_cache=args.lm_head_cache or None,
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


def _setup_logging(level: str) -> None:
    # Our own loggers only: Sanic configures (and prints) its own, a root handler would double them.
    h = logging.StreamHandler()
    h.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    lg = logging.getLogger("larql")
    lg.addHandler(h)
    lg.setLevel(level.upper())
    lg.propagate = False


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    _setup_logging(args.log_level)
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
        sources = _sources(items)
    except Exception as e:  # an unreadable folder or a bad id: say it before binding anything
        print(f"larql-embed: {e}", file=sys.stderr)
        return 2
    problems = _check(sources)
    if problems:
        print("larql-embed: cannot serve:\n  " + "\n  ".join(problems), file=sys.stderr)
        return 2
    from larql_edge.service.membership import membership_settings

    try:
        grid = membership_settings(args, args.host, args.port)  # None without --join; messages never hold the key
    except ValueError as e:
        parser.error(str(e))
    cfg = dataclasses.replace(config_from_args(args, sources), grid=grid)

    # Workers are spawned processes: what they inherit must be in the environment before they start.
    for name in BLAS_ENV:
        os.environ[name] = str(cfg.blas_threads)
    from larql_edge.service.metrics import prepare_multiprocess

    prepare_multiprocess("embed")
    return serve(cfg)


def serve(cfg: EmbedConfig) -> int:
    from sanic import Sanic
    from sanic.worker.loader import AppLoader

    from larql_edge.roles.embed.app import create_app

    loader = AppLoader(factory=partial(create_app, cfg))
    app = loader.load()
    app.prepare(host=cfg.host, port=cfg.port, workers=cfg.workers, access_log=cfg.access_log, motd=False)
    Sanic.serve(primary=app, app_loader=loader)
    return 0


if __name__ == "__main__":
    sys.exit(main())
