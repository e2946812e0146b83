"""Builds the model a `larql` command runs: the tokenizer, and the providers for each tier."""

from __future__ import annotations

import argparse
from pathlib import Path

from slicer.errors import VindexError
from slicer.vindex import Vindex

from ..config import Flags
from ..model.forward import Transformer


def add_model_flags(p: argparse.ArgumentParser) -> None:
    f = Flags(p)
    f.add("--vindex", required=False, help="vindex folder (a full vindex, or the attn/client slice with --embed/--ffn)")
    f.add("--blas-threads", type=int, default=None, help="BLAS threads for this process")


def load_tokenizer(vx: Vindex):
    from tokenizers import Tokenizer

    path: Path = vx.tokenizer_path
    if not path.is_file():
        raise VindexError(f"{vx.path}: no tokenizer.json")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises its own Exception type
        raise VindexError(f"{path}: unreadable tokenizer ({e})") from None


def build_model(args: argparse.Namespace):
    if not args.vindex:
        raise VindexError("--vindex is required (or set LARQL_VINDEX)")
    if args.blas_threads:
        from threadpoolctl import threadpool_limits

        threadpool_limits(args.blas_threads)
    vx = Vindex.open(args.vindex)
    return Transformer.local(vx), load_tokenizer(vx)
