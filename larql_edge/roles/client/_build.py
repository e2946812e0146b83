"""Builds the model a `larql` command runs: the tokenizer, and the providers for each tier.

Local mode (no ``--embed``/``--ffn``) runs the whole model in this process. Remote mode runs
attention here with a KV cache and loads only the attention weights and norms of the vindex
(the ``attn``/``client`` slice carries no more); embeddings and logits come from ``--embed`` (or
from ``--ffn`` when it is a router, which proxies the embed server), the FFN of each layer from
``--ffn``. ``--embed`` alone keeps the FFN local.
"""

from __future__ import annotations

import argparse
import sys

from larql_edge.config import Flags
from larql_edge.errors import VindexError
from larql_edge.format.vindex import Vindex
from larql_edge.model.forward import Transformer
from larql_edge.net.hops import HopLog
from larql_edge.net.remote import RemoteSettings, add_path_flags, build_tiers
from larql_edge.net.tls import add_tls_flags, settings_from_args


def add_model_flags(p: argparse.ArgumentParser) -> None:
    f = Flags(p)
    f.add("--vindex", required=False, help="vindex folder (a full vindex, or the attn/client slice with --embed/--ffn)")
    f.add("--blas-threads", type=int, default=None,
          help="BLAS threads for this process (with --embed/--ffn the default is 1: the client's share of the "
          "math is small, and spare BLAS threads spinning beside local grid roles slow everything down)")
    f.add("--embed", default=None, metavar="URL", help="embed server (or router) for embeddings and logits; "
          "comma-separated URLs are replicas (default: the --ffn router)")
    f.add("--ffn", default=None, metavar="URL", help='FFN: a router or shard URL, replicas "URL1,URL2", '
          'or shards by layer range "0-8=URL,9-17=URL"')
    f.switch("--ffn-f16", help="ask for f16 FFN replies (half the bytes; not bit-exact)")
    f.add("--timeout", type=float, default=30.0, help="seconds to wait for one remote reply")
    f.add("--logits-top-k", type=int, default=64,
          help="with an embed server that answers top-k JSON only (LARQL's): how many candidates to ask for")
    f.add("--retries", type=int, default=10, help="attempts beyond the first for a failed remote request "
          "(on the next replica, with exponential backoff capped at 2 s: ~15 s in all by default)")
    add_tls_flags(f, server=False)
    add_path_flags(f)


def settings(args: argparse.Namespace) -> RemoteSettings:
    return RemoteSettings(ffn=args.ffn, embed=args.embed, ffn_f16=args.ffn_f16, timeout=args.timeout,
                          retries=args.retries, logits_top_k=args.logits_top_k, direct=args.direct, hedge=args.hedge,
                          hedge_budget=args.hedge_budget)


def _patience() -> dict:
    """A command line: a grid that is not up is an error at once, and every retry wait is a line on
    stderr (the default budget spans ~15 s, which silent looks like a hang)."""

    def say(line: str) -> None:
        print(f"larql: {line}", file=sys.stderr, flush=True)

    return {"on_retry": say, "refused_first_is_fatal": True}


def build_model(args: argparse.Namespace, hops: HopLog | None = None):
    if not args.vindex:
        raise VindexError("--vindex is required (or set LARQL_VINDEX)")
    remote = bool(args.embed or args.ffn)
    threads = args.blas_threads or (1 if remote else None)
    if threads:
        from larql_edge.service.serving import pin_blas

        # BLAS and the kernels' threads together (one knob): a remote client's graphs at the CPU count
        # spin ggml's barrier per node beside the grid's roles (measured: 2.1 vs 6.7 tok/s for the
        # previous code's client on a loaded 2-core box, benchmarks/results/grid.txt)
        pin_blas(threads)
    vx = Vindex.open(args.vindex)
    if remote:
        settings_from_args(args)  # https:// tiers: verified against --tls-ca, with --tls-cert for mutual TLS
        return build_remote(vx, settings(args), hops), vx.load_tokenizer()
    return Transformer.local(vx), vx.load_tokenizer()


def build_remote(vx: Vindex, s: RemoteSettings, hops: HopLog | None = None) -> Transformer:
    """Attention (and norms) from ``vx``; embeddings, logits and FFN from the remote tiers (the FFN
    stays local without ``--ffn``)."""
    from larql_edge.model.backend import get_backend
    from larql_edge.model.forward import LocalFfn, load_attention
    from larql_edge.model.spec import ModelSpec

    spec = ModelSpec.from_index(vx.index)
    be = get_backend()
    tiers = build_tiers(s, spec.hidden_size, spec.num_layers, spec.vocab_size,
                        notice=lambda text: print(f"larql: {text}", file=sys.stderr), hops=hops, **_patience())
    return Transformer(spec=spec, attn=load_attention(vx, spec, be), embedder=tiers.embedder,
                       ffn_provider=tiers.ffn if tiers.ffn is not None else LocalFfn(vx, spec, backend=be),
                       head=tiers.head, backend=be)
