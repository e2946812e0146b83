"""GGUF sources: dequantize with gguf-py and undo llama.cpp's layout changes.

llama.cpp's converter (a) permutes the rows of Llama's Q and K projections for its interleaved
RoPE and (b) stores Gemma's norm weights as ``1 + w``. Both are undone here, so a vindex holds the
model exactly as Hugging Face defines it, whatever the source.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from larql_edge.errors import SourceError, UnsupportedTensorType
from larql_edge.format.families import family_by_name
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
    import gguf

    try:
        reader = gguf.GGUFReader(str(path), "r")
    except Exception as e:  # gguf-py raises ValueError/IndexError/OSError on damaged files
        raise SourceError(f"{path}: truncated or corrupt GGUF ({type(e).__name__}: {e})") from None

    arch = _scalar(reader, "general.architecture")
    if not isinstance(arch, str):
        raise SourceError(f"{path}: GGUF has no general.architecture")
    fam = family_by_name(arch)
    p = f"{arch}."
    n_layers = int(_scalar(reader, p + "block_count"))
    hidden = int(_scalar(reader, p + "embedding_length"))
    n_head = int(_scalar(reader, p + "attention.head_count"))
    n_kv = int(_scalar(reader, p + "attention.head_count_kv", n_head))
    head_dim = int(_scalar(reader, p + "attention.key_length", hidden // n_head))
    tensors = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise SourceError(f"{path}: GGUF has no token_embd.weight")
    vocab = int(tensors["token_embd.weight"].shape[-1])
    tied = "output.weight" not in tensors
    cfg: dict[str, Any] = {
        "num_layers": n_layers,
        "hidden_size": hidden,
        "intermediate_size": int(_scalar(reader, p + "feed_forward_length")),
        "vocab_size": vocab,
        "head_dim": head_dim,
        "num_q_heads": n_head,
        "num_kv_heads": n_kv,
        "rope_base": float(_scalar(reader, p + "rope.freq_base", 10000.0)),
        "rms_norm_eps": float(_scalar(reader, p + "attention.layer_norm_rms_epsilon", 1e-6)),
        "max_position_embeddings": _scalar(reader, p + "context_length"),
        "sliding_window": _scalar(reader, p + "attention.sliding_window"),
        "final_logit_softcapping": _scalar(reader, p + "final_logit_softcapping"),
        "attn_logit_softcapping": _scalar(reader, p + "attn_logit_softcapping"),
        "bos_token_id": _scalar(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _scalar(reader, "tokenizer.ggml.eos_token_id"),
        "add_bos_token": bool(_scalar(reader, "tokenizer.ggml.add_bos_token", False)),
        "tie_word_embeddings": tied,
    }
    if fam.name == "gemma3":
        # Gemma 3 scales queries by query_pre_attn_scalar**-0.5, which equals head_dim for every size
        # that ships in GGUF; llama.cpp does not store it.
        cfg["query_pre_attn_scalar"] = head_dim
        cfg["rope_local_base"] = fam.default_rope_local_base
        cfg["sliding_window_pattern"] = fam.default_sliding_window_pattern

    # Normalized key -> (GGUF tensor, transform)
    mapping: dict[str, tuple[Any, str]] = {"embed_tokens.weight": (tensors["token_embd.weight"], "")}
    if "output_norm.weight" in tensors:
        mapping["norm.weight"] = (tensors["output_norm.weight"], "norm")
    if not tied:
        mapping["lm_head.weight"] = (tensors["output.weight"], "")
    for layer in range(n_layers):
        for suffix, key in fam.gguf_layer_tensors.items():
            t = tensors.get(f"blk.{layer}.{suffix}")
            if t is None:
                continue
            how = "norm" if key.endswith("norm.weight") else ""
            if fam.gguf_permutes_qk and key.endswith("q_proj.weight"):
                how = "permute_q"
            elif fam.gguf_permutes_qk and key.endswith("k_proj.weight"):
                how = "permute_k"
            mapping[f"layers.{layer}.{key}"] = (t, how)

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

    # Fail before any work when a tensor type cannot be handled.
    for key, (t, _) in mapping.items():
        if t.tensor_type.name not in SUPPORTED_TYPES:
            raise UnsupportedTensorType(f"{path}: tensor {t.name} has unsupported type {t.tensor_type.name}")

    def tokenizer_json() -> str:
        from larql_edge.tools.slicer.extract._gguf_tokenizer import read_gguf_metadata, tokenizer_from_gguf

        meta = read_gguf_metadata(reader, prefix="tokenizer.")
        try:
            return tokenizer_from_gguf(meta).to_str()
        except ValueError as e:
            raise SourceError(f"{path}: cannot build the tokenizer ({e})") from None

    # A Hub-style short name ("gemma-3-270m"), which titles and families are derived from.
    base, size = _scalar(reader, "general.basename"), _scalar(reader, "general.size_label")
    name = f"{base}-{size}".lower() if base and size else (_scalar(reader, "general.name") or path.stem)
    return ModelSource(
        family=fam,
        name=str(name),
        config=cfg,
        keys=set(mapping),
        get=get,
        tokenizer_json=tokenizer_json,
        tied=tied,
        info={"type": "gguf", "file": path.name, "architecture": arch},
    )
