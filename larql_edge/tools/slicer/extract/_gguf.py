"""GGUF sources: dequantize with gguf-py and undo llama.cpp's layout changes.

llama.cpp's converter (a) permutes the rows of Llama's Q and K projections for its interleaved
RoPE and (b) stores Gemma's norm weights as ``1 + w``. Both are undone here, so a vindex holds the
model exactly as Hugging Face defines it, whatever the source.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from gguf import MODEL_TENSOR as MT

from larql_edge.errors import QuantError, SourceError, UnsupportedTensorType
from larql_edge.format.families import family_by_name, tensor_name
from larql_edge.format.quant import transcode_gguf
from larql_edge.tools.slicer.extract._source import ModelSource

# Tensor types we dequantize (the two packaged models use F32, F16, Q8_0, Q5_0, Q4_1, Q4_K, Q6_K).
SUPPORTED_TYPES = (
    "F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
)


def _scalar(reader: Any, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    if f is None:
        return default
    v = f.contents()
    return v


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's ``permute``: interleaved RoPE rows back to Hugging Face's halves."""
    out, inp = w.shape
    return w.reshape(n_head, out // n_head // 2, 2, inp).swapaxes(1, 2).reshape(out, inp)


def open_gguf(path: Path) -> ModelSource:
    try:
        reader = gguf.GGUFReader(str(path), "r")
    except Exception as e:  # gguf-py raises ValueError/IndexError/OSError on damaged files
        raise SourceError(f"{path}: truncated or corrupt GGUF ({type(e).__name__}: {e})") from None

    K = gguf.Keys
    arch = _scalar(reader, K.General.ARCHITECTURE)
    if not isinstance(arch, str):
        raise SourceError(f"{path}: GGUF has no {K.General.ARCHITECTURE}")
    fam = family_by_name(arch)

    def key(k: str, default: Any = None) -> Any:
        return _scalar(reader, k.format(arch=arch), default)

    n_layers = int(key(K.LLM.BLOCK_COUNT))
    hidden = int(key(K.LLM.EMBEDDING_LENGTH))
    n_head = int(key(K.Attention.HEAD_COUNT))
    n_kv = int(key(K.Attention.HEAD_COUNT_KV, n_head))
    head_dim = int(key(K.Attention.KEY_LENGTH, hidden // n_head))
    tensors = {t.name: t for t in reader.tensors}
    embd, output, output_norm = (tensor_name(t) for t in (MT.TOKEN_EMBD, MT.OUTPUT, MT.OUTPUT_NORM))
    if embd not in tensors:
        raise SourceError(f"{path}: GGUF has no {embd}")
    vocab = int(tensors[embd].shape[-1])
    tied = output not in tensors
    cfg: dict[str, Any] = {
        "num_layers": n_layers,
        "hidden_size": hidden,
        "intermediate_size": int(key(K.LLM.FEED_FORWARD_LENGTH)),
        "vocab_size": vocab,
        "head_dim": head_dim,
        "num_q_heads": n_head,
        "num_kv_heads": n_kv,
        "rope_base": float(key(K.Rope.FREQ_BASE, 10000.0)),
        "rms_norm_eps": float(key(K.Attention.LAYERNORM_RMS_EPS, 1e-6)),
        "max_position_embeddings": key(K.LLM.CONTEXT_LENGTH),
        "sliding_window": key(K.Attention.SLIDING_WINDOW),
        "final_logit_softcapping": key(K.LLM.FINAL_LOGIT_SOFTCAPPING),
        "attn_logit_softcapping": key(K.LLM.ATTN_LOGIT_SOFTCAPPING),
        "bos_token_id": _scalar(reader, K.Tokenizer.BOS_ID),
        "eos_token_id": _scalar(reader, K.Tokenizer.EOS_ID),
        "add_bos_token": bool(_scalar(reader, K.Tokenizer.ADD_BOS, False)),
        "tie_word_embeddings": tied,
    }
    if fam.name == "gemma3":
        # Gemma 3 scales queries by query_pre_attn_scalar**-0.5, which equals head_dim for every size
        # that ships in GGUF; llama.cpp does not store it.
        cfg["query_pre_attn_scalar"] = head_dim
        cfg["rope_local_base"] = fam.default_rope_local_base
        cfg["sliding_window_pattern"] = fam.default_sliding_window_pattern

    # Normalized key -> (GGUF tensor, transform)
    mapping: dict[str, tuple[Any, str]] = {"embed_tokens.weight": (tensors[embd], "")}
    if output_norm in tensors:
        mapping["norm.weight"] = (tensors[output_norm], "norm")
    if not tied:
        mapping["lm_head.weight"] = (tensors[output], "")
    for layer in range(n_layers):
        for kind, hf_key in fam.gguf_layer_tensors.items():
            t = tensors.get(tensor_name(kind, layer))
            if t is None:
                continue
            how = "norm" if hf_key.endswith("norm.weight") else ""
            if fam.gguf_permutes_qk and kind is MT.ATTN_Q:
                how = "permute_q"
            elif fam.gguf_permutes_qk and kind is MT.ATTN_K:
                how = "permute_k"
            mapping[f"layers.{layer}.{hf_key}"] = (t, how)

    def get(key: str) -> np.ndarray:
        t, how = mapping[key]
        qtype = t.tensor_type.name
        if qtype not in SUPPORTED_TYPES:
            raise UnsupportedTensorType(f"{path}: tensor {t.name} has unsupported type {qtype}")
        try:
            arr = gguf.quants.dequantize(t.data, t.tensor_type)
        except Exception as e:
            raise SourceError(f"{path}: cannot dequantize {t.name} ({type(e).__name__}: {e})") from None
        arr = np.asarray(arr, dtype=np.float32).reshape(tuple(int(d) for d in reversed(t.shape)))
        if how == "norm" and fam.gguf_norm_plus_one:
            arr = arr - np.float32(1.0)
        elif how == "permute_q":
            arr = unpermute_qk(arr, n_head)
        elif how == "permute_k":
            arr = unpermute_qk(arr, n_kv)
        return arr

    def blocks(key: str, target: str | None):
        """``key`` as ``target`` blocks: a Q4_K/Q6_K tensor of the GGUF is kept as it is (re-laid-out
        for LARQL's Q6_K), anything else is dequantized and quantized as LARQL does."""
        t, how = mapping[key]
        cols, rows = (int(s) for s in t.shape)
        order = None
        if how in ("permute_q", "permute_k"):  # undoing llama.cpp's row permutation is lossless on rows
            order = unpermute_qk(np.arange(rows)[:, None], n_head if how == "permute_q" else n_kv)[:, 0]
        try:
            qb, _ = transcode_gguf(t.tensor_type.name, t.data, rows, cols, target, row_order=order)
        except QuantError as e:
            raise SourceError(f"{path}: cannot convert {t.name} to {target} ({e})") from None
        return qb

    # Fail before any work when a tensor type cannot be handled.
    for t, _ in mapping.values():
        if t.tensor_type.name not in SUPPORTED_TYPES:
            raise UnsupportedTensorType(f"{path}: tensor {t.name} has unsupported type {t.tensor_type.name}")

    @functools.cache
    def tokenizer_meta() -> dict:
        from larql_edge.tools.slicer.extract._gguf_tokenizer import read_gguf_metadata

        return read_gguf_metadata(reader, prefix="tokenizer.")

    def tokenizer_json() -> str:
        from larql_edge.tools.slicer.extract._gguf_tokenizer import tokenizer_from_gguf

        meta = tokenizer_meta()
        try:
            return tokenizer_from_gguf(meta).to_str()
        except ValueError as e:
            raise SourceError(f"{path}: cannot build the tokenizer ({e})") from None

    def tokenizer_config() -> dict:
        """The chat template and special tokens llama.cpp's server renders chats with."""
        meta = tokenizer_meta()
        tokens = meta.get("tokenizer.ggml.tokens") or []

        def token(key: str) -> str | None:
            i = meta.get(f"tokenizer.ggml.{key}")
            return str(tokens[int(i)]) if isinstance(i, int) and 0 <= i < len(tokens) else None

        template = meta.get("tokenizer.chat_template")
        return {"chat_template": template if isinstance(template, str) and template.strip() else None,
                "bos_token": token("bos_token_id"), "eos_token": token("eos_token_id"),
                "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", cfg.get("add_bos_token", False)))}

    def generation_config() -> dict:
        meta = tokenizer_meta()
        # A chat model ends a turn with its end-of-turn token (Gemma's <end_of_turn>), not only EOS.
        ids = [meta.get(f"tokenizer.ggml.{k}") for k in ("eos_token_id", "eot_token_id", "eom_token_id")]
        out: dict = {"eos_token_id": sorted({int(i) for i in ids if isinstance(i, int)})}
        if isinstance(meta.get("tokenizer.ggml.bos_token_id"), int):
            out["bos_token_id"] = int(meta["tokenizer.ggml.bos_token_id"])
        return out

    # A Hub-style short name ("gemma-3-270m"), which titles and families are derived from.
    base, size = _scalar(reader, K.General.BASENAME), _scalar(reader, K.General.SIZE_LABEL)
    name = f"{base}-{size}".lower() if base and size else (_scalar(reader, K.General.NAME) or path.stem)
    return ModelSource(
        family=fam,
        name=str(name),
        config=cfg,
        keys=set(mapping),
        get=get,
        tokenizer_json=tokenizer_json,
        tokenizer_config=tokenizer_config,
        generation_config=generation_config,
        tied=tied,
        info={"type": "gguf", "file": path.name, "architecture": arch},
        blocks=blocks,
    )
