"""larql: predict the next token or generate text with a vindex.

Local mode runs the whole model in this process. With ``--embed URL --ffn URL`` (the attention-only
client) attention runs here with a KV cache, embeddings and logits come from the embed server and
the FFN of each layer from the grid (one round trip per layer); tokens stream as they come.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

from larql_edge.config import Flags
from larql_edge.console import run_command
from larql_edge.errors import LarqlError
from larql_edge.roles.client._build import add_model_flags, build_model
from larql_edge.roles.client._stream import TextStream
from larql_edge.roles.client._timings import TokenTime, report


def _common(p: argparse.ArgumentParser) -> Flags:
    add_model_flags(p)
    f = Flags(p)
    f.add("--prompt", default=None, help="the prompt text (required)")
    f.switch("--json", help="machine-readable output")
    return f


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="larql", description="Run a LARQL vindex: next-token prediction and generation.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p = sub.add_parser("predict", help="top-k next tokens with probabilities")
    _common(p).add("--top-k", type=int, default=10, help="how many candidates")
    p.set_defaults(func=predict)
    g = sub.add_parser("generate", help="stream generated tokens (KV cache; stops at EOS)")
    f = _common(g)
    f.add("--max-tokens", type=int, default=32, help="at most this many new tokens")
    f.add("--temperature", type=float, default=0.0, help="0 = greedy; > 0 samples")
    f.add("--seed", type=int, default=None, help="sampling seed, for reproducible runs")
    f.toggle("--speculate", default=True, help="speculative decoding: draft tokens (from the context's own n-grams, or "
             "--draft), verify them all in one pass through the grid; the same greedy tokens, the same sampling "
             "distribution, k adapts (0 while drafts keep failing)")
    f.add("--spec-k", type=int, default=4, help=f"drafts per pass at most (1..{MAX_SPEC_K})")
    f.add("--draft", default=None, metavar="VINDEX", help="draft with this small full vindex run whole here (same "
          "tokenizer as --vindex; e.g. the q4k vindex of the same model) instead of n-gram lookup")
    f.switch("--timings", help="after the text, where each decoded token's time went: per hop (embed, every layer, "
             "logits) the server's compute and the network time, and what was computed here: attention, norms, "
             "sampling (with --json: per token)")
    f.add("--metrics-file", default=None, metavar="FILE", help="write the per-tier time split as Prometheus text "
          "(larql_client_*) to FILE at the end (a node_exporter textfile collector reads it)")
    g.set_defaults(func=generate)
    return parser


MAX_SPEC_K = 16


def _encode(tok, prompt: str) -> list[int]:
    ids = tok.encode(prompt).ids
    if not ids:
        raise LarqlError("the prompt encodes to no tokens")
    return ids


def predict(args: argparse.Namespace) -> int:
    from larql_edge.model.forward import top_k

    if args.top_k <= 0:
        raise LarqlError("--top-k must be a positive integer")
    model, tok = build_model(args)
    ids = _encode(tok, args.prompt)
    logits = model.next_logits(ids)
    rows = [
        {"id": i, "text": tok.decode([i]), "logprob": lp, "prob": math.exp(lp)}
        for i, lp in top_k(logits, min(args.top_k, logits.size))
    ]
    if args.json:
        print(json.dumps({"prompt": args.prompt, "prompt_ids": ids, "top_k": rows}, ensure_ascii=False))
        return 0
    print(f"Prompt: {args.prompt!r} ({len(ids)} tokens)")
    for r in rows:
        print(f"  {r['prob']:7.2%}  {r['logprob']:9.4f}  {r['id']:>7}  {r['text']!r}")
    return 0


def generate(args: argparse.Namespace) -> int:
    if args.max_tokens <= 0:
        raise LarqlError("--max-tokens must be a positive integer")
    if not math.isfinite(args.temperature) or args.temperature < 0:
        raise LarqlError("--temperature must be a finite number >= 0")
    if not 1 <= args.spec_k <= MAX_SPEC_K:
        raise LarqlError(f"--spec-k must be between 1 and {MAX_SPEC_K}")
    if args.draft and not args.speculate:
        raise LarqlError("--draft drafts for speculative decoding: it cannot go with --no-speculate")
    from larql_edge.model import speculative
    from larql_edge.net.hops import HopLog

    timed = args.timings or bool(args.metrics_file)
    hops = HopLog() if timed else None
    model, tok = build_model(args, hops)
    ids = _encode(tok, args.prompt)
    drafter = speculative.ModelDrafter(speculative.open_draft(args.draft, tok, model.spec.vocab_size)) if args.draft else None
    out: list[int] = []
    stream = TextStream(tok)
    stats = speculative.SpecStats()
    times: list[TokenTime] = []
    t0 = time.perf_counter()
    if not args.json:
        sys.stdout.write(args.prompt)
        sys.stdout.flush()
    drafted = lambda: drafter.seconds if drafter is not None else 0.0  # noqa: E731
    last, local, draft = t0, model.local_s, drafted()
    # With speculation a pass may yield several tokens: its time goes to the first, the rest cost ~0.
    tokens = (speculative.generate(model, ids, args.max_tokens, args.temperature, args.seed, drafter=drafter,
                                   max_k=args.spec_k, stats=stats)
              if args.speculate else model.generate(ids, args.max_tokens, args.temperature, args.seed))
    try:
        for t in tokens:
            if hops is not None:
                now = time.perf_counter()
                times.append(TokenTime(now - last, model.local_s - local, hops.drain(), drafted() - draft))
            out.append(t)
            if not args.json:
                sys.stdout.write(stream.push(t))
                sys.stdout.flush()
            if hops is not None:
                last, local, draft = time.perf_counter(), model.local_s, drafted()
    except BaseException:
        if not args.json:  # the error (or ^C) goes on a line of its own, not glued to the text
            sys.stdout.write(stream.flush() + "\n")
            sys.stdout.flush()
        raise
    dt = time.perf_counter() - t0
    hedger = getattr(model.ffn_provider, "hedger", None)
    hedges = hedger.stats() if hedger is not None else None
    if args.metrics_file:
        _write_metrics(args.metrics_file, times, hedges)
    if args.json:
        spec = ({"drafter": "model" if args.draft else "ngram", "passes": stats.passes, "drafted": stats.drafted,
                 "accepted": stats.accepted, "draft_seconds": round(drafted(), 3)} if args.speculate else None)
        body = {"prompt": args.prompt, "prompt_ids": ids, "generated_ids": out, "text": tok.decode(out),
                "seconds": round(dt, 3), "speculation": spec}
        if args.timings:
            body["timings"] = {"tokens": [t.as_json() for t in times], "hedges": hedges}
        print(json.dumps(body, ensure_ascii=False))
    else:
        sys.stdout.write(stream.flush() + "\n")
        extra = (f", {stats.accepted}/{stats.drafted} drafts accepted, {stats.passes + 1} passes"
                 if args.speculate else "")
        print(f"[{len(out)} tokens in {dt:.2f}s, {len(out) / dt:.1f} tok/s{extra}]", file=sys.stderr)
        if args.timings:
            print(report(times, hedges), file=sys.stderr)
    return 0


def _write_metrics(path: str, times: list[TokenTime], hedges: dict | None) -> None:
    from larql_edge.service.metrics import HopMetrics, Metrics

    m = Metrics("client")
    hm = HopMetrics(m)
    for t in times:
        hm.record(t.hops, t.local_s, t.draft_s if t.draft_s else None)
    if hedges:
        hm.hedged(hedges["hedges_sent"], hedges["hedges_won"])
    try:
        with open(path, "wb") as f:
            f.write(m.render())
    except OSError as e:
        raise LarqlError(f"--metrics-file {path}: {e.strerror or e}") from None


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.prompt:
        parser.error("--prompt is required (or set LARQL_PROMPT)")
    return run_command("larql", args)


if __name__ == "__main__":
    sys.exit(main())
