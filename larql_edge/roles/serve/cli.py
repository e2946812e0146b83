"""larql-serve VINDEX --ffn ROUTER_URL: an OpenAI-compatible API in front of a grid.

VINDEX is the ``attn`` preset (attention weights and norms; a full vindex works too) with its
tokenizer and, for chat, its ``tokenizer_config.json`` chat template. Attention and the KV caches run
here; the FFN of every layer comes from ``--ffn`` (a router, or routers failing over), embeddings and
logits from ``--embed`` (default: the router, which proxies the embed server). One scheduler steps
every active sequence together: one FFN request per layer and one logits request per step.
"""

from __future__ import annotations

import logging
import sys

from larql_edge.config import Flags, positional_list_from_env
from larql_edge.errors import LarqlError
from larql_edge.service import add_server_flags, pin_blas, serve, setup_logging, tls_settings

log = logging.getLogger("larql.serve")
MAX_STEP_TOKENS = 2048
MAX_SPEC_K = 16


def build_parser():
    import argparse

    from larql_edge.net.remote import add_path_flags
    from larql_edge.roles.serve.app import Limits

    d = Limits()
    p = argparse.ArgumentParser(prog="larql-serve", description="OpenAI-compatible completions and chat completions "
                                "(/v1/completions, /v1/chat/completions, /v1/models) in front of a larql-edge grid, "
                                "with continuous batching of every active sequence.")
    p.add_argument("vindex", nargs="*", metavar="VINDEX",
                   help="vindex folder: the attn preset (or a full vindex) [env LARQL_VINDEX]")
    f = Flags(p)
    f.add("--ffn", default=None, metavar="URL[,URL2]", help="the grid: router URL(s), replicas failing over (required)")
    f.add("--embed", default=None, metavar="URL", help="embed server for embeddings and logits (default: the --ffn router)")
    f.add("--max-active", type=int, default=d.max_active, help="sequences stepped together (each holds a KV cache)")
    f.add("--max-queue", type=int, default=d.max_queue, help="admitted sequences waiting for a slot; beyond: 429")
    f.add("--context", type=int, default=None,
          help=f"positions per sequence, prompt and completion (default: the model's, at most {d.context})")
    f.add("--kv-memory-mb", type=int, default=d.kv_memory_bytes >> 20,
          help="bound on all KV caches together; --max-active is lowered to fit (context x per-position bytes)")
    f.add("--prefix-cache-mb", type=int, default=None,
          help="bound on the prompt (prefix) cache of KV blocks shared across requests, LRU (default: what "
               "--kv-memory-mb leaves after --max-active sequences; 0: off)")
    f.add("--step-tokens", type=int, default=d.step_tokens,
          help=f"rows per step: decoding sequences take one each, prefills share the rest (chunked); at most {MAX_STEP_TOKENS}")
    f.add("--chat-template", default=None, metavar="FILE",
          help="a Jinja chat template overriding the vindex's tokenizer_config.json chat_template")
    f.add("--served-model-name", default=None, metavar="NAME[,ALIAS]",
          help="the model's name in /v1/models and in requests (default: the vindex's model name, always accepted too)")
    f.toggle("--speculate", default=True, help="n-gram speculative decoding: drafts from each sequence's own context, "
             "verified together in the step (same greedy tokens, same sampling distribution; k adapts per sequence, "
             "0 while drafts keep failing)")
    f.toggle("--spec-budget", default=True, help="a draft goes into a step only where it pays for its row: each "
             "sequence's record of kept drafts against the step's fixed and per-row cost, learnt from the steps "
             "(withheld drafts are checked against the tokens that come); off: every draft k allows")
    f.add("--spec-k", type=int, default=4, help=f"drafts per sequence per step at most (1..{MAX_SPEC_K})")
    f.add("--draft", default=None, metavar="VINDEX", help="draft with this small full vindex run whole here, one KV "
          "cache per sequence (same tokenizer as the served model; e.g. its q4k vindex) instead of n-gram lookup")
    f.add("--api-key", default=None, secret=True, metavar="KEY[,KEY2]",
          help="require Authorization: Bearer KEY on every route but /v1/health, /v1/ready, /metrics and "
               "/openapi.json; several keys: commas (or lines, in the file)")
    f.add("--timeout", type=float, default=60.0, help="seconds to wait for one grid reply")
    f.add("--retries", type=int, default=10, help="attempts beyond the first for a failed grid request (fail-over)")
    add_path_flags(f)
    add_server_flags(f, port=8000)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    setup_logging(args.log_level)
    paths = positional_list_from_env(args.vindex, "LARQL_VINDEX")
    if len(paths) != 1:
        parser.error("give exactly one VINDEX folder (or set LARQL_VINDEX)")
    if not args.ffn:
        parser.error("--ffn ROUTER_URL is required (or set LARQL_FFN)")
    if min(args.max_active, args.max_queue + 1, args.kv_memory_mb, args.step_tokens) < 1 or (
            args.context is not None and args.context < 2):
        parser.error("--max-active, --kv-memory-mb, --step-tokens must be >= 1, --max-queue >= 0, --context >= 2")
    if args.prefix_cache_mb is not None and args.prefix_cache_mb < 0:
        parser.error("--prefix-cache-mb must be >= 0 (0: no prompt cache)")
    if args.step_tokens > MAX_STEP_TOKENS:  # one step's ids are one /v1/embed request (the embed server takes 4096)
        parser.error(f"--step-tokens must be at most {MAX_STEP_TOKENS}")
    if not 1 <= args.spec_k <= MAX_SPEC_K:
        parser.error(f"--spec-k must be between 1 and {MAX_SPEC_K}")
    pin_blas(args.blas_threads)
    from larql_edge.format.vindex import Vindex
    from larql_edge.net.remote import RemoteSettings
    from larql_edge.roles.serve.app import (
        Limits,
        create_app,
        effective_limits,
        remote_engine,
        served_model,
    )
    from larql_edge.roles.serve.auth import parse_keys

    try:
        tls = tls_settings(args)
        vx = Vindex.open(paths[0])
        mc = vx.index.model_config
        model_ctx = (mc.max_position_embeddings if mc is not None else None) or Limits().context
        context = args.context or min(model_ctx, Limits().context)
        engine = remote_engine(vx, RemoteSettings(ffn=args.ffn, embed=args.embed, timeout=args.timeout, retries=args.retries,
                                                  direct=args.direct, hedge=args.hedge, hedge_budget=args.hedge_budget))
        prefix = None if args.prefix_cache_mb is None else args.prefix_cache_mb << 20
        limits = effective_limits(Limits(args.max_active, args.max_queue, context, args.kv_memory_mb << 20,
                                         args.step_tokens, prefix), engine.spec)
        if limits.max_active < 1:
            raise LarqlError(f"--kv-memory-mb {args.kv_memory_mb} holds no sequence of {context} positions: "
                             "raise it or lower --context")
        names = tuple(n.strip() for n in (args.served_model_name or "").split(",") if n.strip())
        served = served_model(vx, vx.load_tokenizer(), context, args.chat_template, names)
        served.grid = {"ffn": args.ffn.split(","), "embed": (args.embed or args.ffn).split(","),
                       "layers": engine.spec.num_layers}
        from larql_edge.model.speculative import Settings, open_draft

        if args.draft and not args.speculate:
            raise LarqlError("--draft drafts for speculative decoding: it cannot go with --no-speculate")
        draft = open_draft(args.draft, served.tokenizer, engine.spec.vocab_size) if args.draft else None
        speculation = Settings(enabled=args.speculate, max_k=args.spec_k, draft=draft, draft_name=args.draft,
                               budget=args.spec_budget)
    except LarqlError as e:
        print(f"larql-serve: error: {e}", file=sys.stderr)
        return e.exit_code

    keys = parse_keys(args.api_key)
    log.info("larql-serve: %s, context %d, %d active + %d queued, chat template %s, speculation %s; grid %s; "
             "API keys: %d; listening on %s://%s:%d", served.model_id, context, limits.max_active, limits.max_queue,
             "yes" if served.chat_template else "none",
             (f"k<={args.spec_k}" + (f", draft {args.draft}" if args.draft else "")) if args.speculate else "off", args.ffn,
             len(keys), "https" if tls.serving else "http", args.host, args.port)
    serve(lambda: create_app(engine, served, limits, api_keys=keys, speculation=speculation), args.host, args.port,
          access_log=args.access_log, drain=args.drain_seconds, tls=tls)
    return 0


if __name__ == "__main__":
    sys.exit(main())
