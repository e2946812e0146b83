"""Build a LARQL v2 vindex from a GGUF file, a Hugging Face folder, or a packaged model alias."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path

from tqdm.auto import tqdm

from larql_edge.errors import SourceError
from larql_edge.format.index import QUANTS, ModelConfig, VindexIndex, level_rank
from larql_edge.format.q4k import ATTN_FORMATS, ATTN_PROJ, FFN_PROJ, NORM_SUFFIXES, Q4kWriter, ffn_formats
from larql_edge.format.vindex import (
    ATTN,
    DOWN,
    GENERATION_CONFIG,
    LM_HEAD,
    NORMS,
    TOKENIZER,
    TOKENIZER_CONFIG,
    UP,
    VindexWriter,
    staged_output,
)
from larql_edge.tools.slicer.extract._source import PACKAGED, ModelSource, open_source, resolve

__all__ = ["EXTRACTOR_REVISION", "extract", "open_source", "resolve", "PACKAGED", "ModelSource"]

# Fields copied from the source config into index.json.model_config (LARQL names).
# Bumped whenever extraction writes different files or bytes for the same source (the vindex cache
# keys on it). 2: tokenizer_config.json and generation_config.json (the chat template, stop ids).
EXTRACTOR_REVISION = 2

_MODEL_CONFIG_FIELDS = (
    "head_dim", "num_q_heads", "num_kv_heads", "rope_base", "sliding_window", "layer_types",
    "rope_local_base", "sliding_window_pattern", "query_pre_attn_scalar", "final_logit_softcapping",
    "attn_logit_softcapping", "rms_norm_eps", "bos_token_id", "eos_token_id", "add_bos_token",
    "max_position_embeddings", "tie_word_embeddings",
)


def extract(
    source: str,
    out: str | Path,
    level: str = "all",
    dtype: str = "f16",
    force: bool = False,
    progress: bool = True,
    log: Callable[[str], None] = print,
    quant: str = "none",
) -> VindexIndex:
    """Extract ``source`` into the vindex folder ``out``; returns the written index.

    ``quant="q4k"`` writes LARQL's quantized layout (attention and FFN as Q4_K/Q6_K blocks, an untied
    lm_head as Q4_K, norms f32, embeddings f16): a GGUF's own Q4_K/Q6_K tensors are kept as they are,
    others are requantized as LARQL does. ``quant="gguf"`` (larql-edge's own, LARQL refuses it) is the
    same layout with every tensor in its GGUF block type: no requantization at all.
    """
    rank = level_rank(level)
    if quant not in QUANTS:
        raise SourceError(f"unknown quant {quant!r} ({', '.join(QUANTS)})")
    if quant != "none":
        if rank < level_rank("inference"):
            raise SourceError(f"--quant {quant} holds attention and FFN weights: use --level inference or all")
        dtype = "f16"  # LARQL's q4k writer keeps the float side files (embeddings, gate vectors) f16
    t0 = time.perf_counter()
    src = open_source(source)
    if quant == "gguf" and src.blocks is None:
        raise SourceError(f"--quant gguf keeps a GGUF file's own blocks; {source} is not a GGUF source (use --quant q4k)")
    log(f"Extracting {src.name} ({src.family.name}, {src.info.get('type')}) -> {out} "
        f"[level={level}, dtype={dtype}, quant={quant}]")
    with staged_output(out, force=force) as tmp:
        w = VindexWriter(tmp, dtype=dtype)
        n_layers = src.config["num_layers"]

        # A bar per stage on a terminal; elsewhere (a pipe, a log file, CI) a line per stage, because
        # tqdm's carriage-return updates show nothing there until the end.
        bars = progress and sys.stderr.isatty()

        def stage(name: str, total: int):
            if progress and not bars:
                log(f"  [{time.perf_counter() - t0:5.1f}s] {name} ({total} step{'s' * (total != 1)})")
            return tqdm(total=total, desc=f"{name:<11}", unit="t", disable=not bars, leave=False)

        with stage("embeddings", 1) as bar:
            w.write_embeddings(src.get("embed_tokens.weight"))
            bar.update()
        with stage("tokenizer", 1) as bar:
            (tmp / TOKENIZER).write_text(src.tokenizer_json())
            # Beside it, as LARQL's extractor copies them: the chat template and end-of-turn ids a
            # chat front door (larql-serve) renders and stops with.
            for name, content in ((TOKENIZER_CONFIG, src.tokenizer_config()),
                                  (GENERATION_CONFIG, src.generation_config())):
                (tmp / name).write_text(json.dumps(content, indent=2, ensure_ascii=False) + "\n")
            bar.update()
        with stage("gate", n_layers) as bar:
            for i in range(n_layers):
                w.add_gate(i, _need(src, f"layers.{i}.mlp.gate_proj.weight"))
                bar.update()
        if quant != "none":
            fields = _write_q4k(tmp, src, n_layers, stage, quant)
        else:
            fields = {}
            _write_float_weights(w, src, n_layers, rank, stage)
        cfg = src.config
        model_config = ModelConfig.from_json(
            {"model_type": src.family.model_type} | {k: cfg[k] for k in _MODEL_CONFIG_FIELDS if cfg.get(k) is not None}
        )
        index = VindexIndex(
            model=src.name,
            family=src.family.name,
            num_layers=n_layers,
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            vocab_size=cfg["vocab_size"],
            embed_scale=src.family.embed_scale(cfg["hidden_size"]),
            extract_level=level,
            has_model_weights=rank >= level_rank("attention"),
            down_top_k=0,
            model_config=model_config,
            lm_head_tied=src.tied,
            # LARQL's loader refuses an index.json whose source lacks these two strings.
            source=src.info | {"extracted_by": "larql-edge", "larql_version": f"larql-edge {_version()}",
                               "extracted_at": datetime.now(timezone.utc).isoformat(timespec="seconds")},
        )
        if fields:
            index = index.replace(quant=fields["quant"], has_model_weights=fields["has_model_weights"])
        written = w.finish(index)
    log(f"Wrote {out} in {time.perf_counter() - t0:.1f}s ({len(written.checksums)} files)")
    return written


def _write_float_weights(w: VindexWriter, src: ModelSource, n_layers: int, rank: int, stage) -> None:
    fam = src.family
    if rank >= level_rank("attention"):
        with stage("attention", n_layers) as bar:
            for i in range(n_layers):
                for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
                    w.add(ATTN, f"layers.{i}.self_attn.{proj}.weight", _need(src, f"layers.{i}.self_attn.{proj}.weight"))
                if fam.qk_norm:
                    for n in ("q_norm", "k_norm"):
                        w.add(ATTN, f"layers.{i}.self_attn.{n}.weight", _need(src, f"layers.{i}.self_attn.{n}.weight"))
                bar.update()
        with stage("norms", n_layers + 1) as bar:
            for i in range(n_layers):
                for key in _layer_norm_keys(fam, i):
                    w.add(NORMS, key, _need(src, key))
                bar.update()
            w.add(NORMS, "norm.weight", _need(src, "norm.weight"))
            bar.update()
    if rank >= level_rank("inference"):
        with stage("ffn", n_layers) as bar:
            for i in range(n_layers):
                w.add(UP, f"layers.{i}.mlp.up_proj.weight", _need(src, f"layers.{i}.mlp.up_proj.weight"))
                w.add(DOWN, f"layers.{i}.mlp.down_proj.weight", _need(src, f"layers.{i}.mlp.down_proj.weight"))
                bar.update()
        if src.tied:
            # LARQL's embed-only server needs an lm_head.bin; a tied model's is the embeddings.
            w.link_tied_lm_head(src.config["vocab_size"], src.config["hidden_size"])
        else:
            w.add(LM_HEAD, "lm_head.weight", _need(src, "lm_head.weight"))


def _layer_norm_keys(fam, i: int) -> list[str]:
    return [k for k in (fam.pre_attn_norm_key(i), fam.post_attn_norm_key(i), fam.pre_ffn_norm_key(i),
                        fam.post_ffn_norm_key(i)) if k is not None]


def _write_q4k(folder: Path, src: ModelSource, n_layers: int, stage, quant: str) -> dict:
    """LARQL's q4k files (`larql_edge.format.q4k`): per layer attention (Q4_K; V Q6_K) and FFN (gate,
    up Q4_K; down Q6_K), norms f32 in LARQL's order, an untied lm_head Q4_K. In ``gguf`` every
    tensor keeps its own GGUF type instead."""
    fam = src.family

    def weight(key: str, fmt: str):
        _need_key(src, key)
        if src.blocks is None:
            return src.get(key)
        return src.blocks(key, None if quant == "gguf" else fmt)

    with Q4kWriter(folder, n_layers, src.config["hidden_size"], quant=quant) as qw:
        with stage("attention", n_layers) as bar:
            for i in range(n_layers):
                qw.add_attn(i, *(weight(f"layers.{i}.self_attn.{p}.weight", f) for p, f in zip(ATTN_PROJ, ATTN_FORMATS, strict=True)))
                bar.update()
        with stage("ffn", n_layers) as bar:
            for i in range(n_layers):
                qw.add_ffn(i, *(weight(f"layers.{i}.mlp.{p}.weight", f) for p, f in zip(FFN_PROJ, ffn_formats(), strict=True)))
                bar.update()
        with stage("norms", n_layers + 1) as bar:
            for i in range(n_layers):
                present = set(_layer_norm_keys(fam, i))
                if fam.qk_norm:
                    present |= {f"layers.{i}.self_attn.q_norm.weight", f"layers.{i}.self_attn.k_norm.weight"}
                for suffix in NORM_SUFFIXES:  # LARQL's order within a layer
                    key = f"layers.{i}.{suffix}"
                    if key in present:
                        qw.add_norm(key, _need(src, key))
                bar.update()
            qw.add_norm("norm.weight", _need(src, "norm.weight"))
            bar.update()
        if not src.tied:
            with stage("lm_head", 1) as bar:
                qw.add_lm_head(weight("lm_head.weight", "Q4_K"))
                bar.update()
        return qw.finish()


def _version() -> str:
    try:
        return metadata.version("larql-edge")
    except metadata.PackageNotFoundError:
        return "dev"


def _need_key(src: ModelSource, key: str) -> None:
    if key not in src.keys:
        raise SourceError(f"source has no tensor {key!r} (incomplete or unsupported checkpoint)")


def _need(src: ModelSource, key: str):
    _need_key(src, key)
    return src.get(key)

