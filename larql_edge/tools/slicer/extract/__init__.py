"""Build a LARQL v2 vindex from a GGUF file, a Hugging Face folder, or a packaged model alias."""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path

from tqdm.auto import tqdm

from larql_edge.errors import SourceError
from larql_edge.format.index import ModelConfig, VindexIndex, level_rank
from larql_edge.format.vindex import ATTN, DOWN, LM_HEAD, NORMS, TOKENIZER, UP, VindexWriter, staged_output
from larql_edge.tools.slicer.extract._source import PACKAGED, ModelSource, open_source, resolve

__all__ = ["extract", "open_source", "resolve", "PACKAGED", "ModelSource"]

# Fields copied from the source config into index.json.model_config (LARQL names).
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
) -> VindexIndex:
    """Extract ``source`` into the vindex folder ``out``; returns the written index."""
    rank = level_rank(level)
    t0 = time.perf_counter()
    src = open_source(source)
    log(f"Extracting {src.name} ({src.family.name}, {src.info.get('type')}) -> {out} [level={level}, dtype={dtype}]")
    with staged_output(out, force=force) as tmp:
        w = VindexWriter(tmp, dtype=dtype)
        n_layers = src.config["num_layers"]

        def stage(name: str, total: int):
            return tqdm(total=total, desc=f"{name:<11}", unit="t", disable=not progress, leave=False)

        with stage("embeddings", 1) as bar:
            w.write_embeddings(src.get("embed_tokens.weight"))
            bar.update()
        with stage("tokenizer", 1) as bar:
            (tmp / TOKENIZER).write_text(src.tokenizer_json())
            bar.update()
        with stage("gate", n_layers) as bar:
            for i in range(n_layers):
                w.add_gate(i, _need(src, f"layers.{i}.mlp.gate_proj.weight"))
                bar.update()
        if rank >= level_rank("attention"):
            fam = src.family
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
                    for key in (fam.pre_attn_norm_key(i), fam.post_attn_norm_key(i), fam.pre_ffn_norm_key(i), fam.post_ffn_norm_key(i)):
                        if key is not None:
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
        written = w.finish(index)
    log(f"Wrote {out} in {time.perf_counter() - t0:.1f}s ({len(written.checksums)} files)")
    return written


def _version() -> str:
    try:
        return metadata.version("larql-edge")
    except metadata.PackageNotFoundError:
        return "dev"


def _need(src: ModelSource, key: str):
    if key not in src.keys:
        raise SourceError(f"source has no tensor {key!r} (incomplete or unsupported checkpoint)")
    return src.get(key)

