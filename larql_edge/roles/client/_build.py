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




def build_model(args: argparse.Namespace):
    if not args.vindex:
        raise VindexError("--vindex is required (or set LARQL_VINDEX)")
    remote = bool(getattr(args, "embed", None) or getattr(args, "ffn", None))
    threads = args.blas_threads or (1 if remote else None)
    if threads:
        from threadpoolctl import threadpool_limits

        threadpool_limits(threads)
    vx = Vindex.open(args.vindex)
    if remote:
        settings_from_args(args)  # https:// tiers: verified against --tls-ca, with --tls-cert for mutual TLS
        return build_remote(vx, args), vx.load_tokenizer()
    return Transformer.local(vx), vx.load_tokenizer()


def build_remote(vx: Vindex, args: argparse.Namespace) -> Transformer:
    """Attention (and norms) from ``vx``; embeddings, logits and FFN from the remote tiers."""
    from larql_edge.model.backend import get_backend
    from larql_edge.model.forward import LocalFfn, load_attention
    from larql_edge.model.spec import ModelSpec
    from larql_edge.roles.client.remote import (
        RemoteEmbed,
        RemoteError,
        RemoteFfn,
        RemoteHead,
        Replicas,
        make_client,
        parse_targets,
    )

    spec = ModelSpec.from_index(vx.index)
    be = get_backend()
    client = make_client(args.timeout)
    ffn_targets = parse_targets(args.ffn) if args.ffn else []
    embed_urls = [t.url for t in parse_targets(args.embed)] if args.embed else [t.url for t in ffn_targets if t.layers is None]
    if not embed_urls:
        raise RemoteError("--embed URL is needed when --ffn names shards by layer range (a router URL serves both)")
    if args.ffn:
        remote_ffn = RemoteFfn(Replicas(client, args.retries, what="FFN"), ffn_targets, spec.hidden_size, spec.num_layers,
                               f16=args.ffn_f16)
        missing = remote_ffn.missing_layers()
        if missing:
            from larql_edge.format.layers import gaps

            holes = ", ".join(str(g) for g in gaps(set(range(spec.num_layers)) - set(missing), spec.num_layers))
            raise RemoteError(f"no --ffn target serves layers {holes} (the model has {spec.num_layers} layers)")
        ffn: RemoteFfn | LocalFfn = remote_ffn
    else:
        ffn = LocalFfn(vx, spec, backend=be)
    embed_replicas = Replicas(client, args.retries, what="embed server")
    return Transformer(
        spec=spec,
        attn=load_attention(vx, spec, be),
        embedder=RemoteEmbed(embed_replicas, embed_urls, spec.hidden_size),
        ffn_provider=ffn,
        head=RemoteHead(embed_replicas, embed_urls, spec.hidden_size, spec.vocab_size, top_k=args.logits_top_k,
                        notice=lambda text: print(f"larql: {text}", file=sys.stderr)),
        backend=be,
    )
