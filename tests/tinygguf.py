"""Write a tiny HF folder (tests/tinymodel.py) as a GGUF file the way llama.cpp's converter does:
Llama Q/K rows permuted for interleaved RoPE, Gemma norms stored as 1 + w, F32 tensors, and a
minimal sentencepiece-style tokenizer. Lets tests exercise the GGUF path without the real models.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
from safetensors.numpy import load_file

from tests.tinymodel import CHAT_TEMPLATE, SPECIALS, WORDS

_GGUF_NAMES = {
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
}
_GEMMA = {
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
}
_LLAMA = {"post_attention_layernorm.weight": "ffn_norm.weight"}


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.LlamaModel.permute."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_to_gguf(folder: Path, out: Path, arch: str | None = None, bad_tensor: str | None = None,
               qtypes: dict[str, str] | None = None) -> Path:
    """Convert; ``arch`` overrides general.architecture, ``bad_tensor`` names a tensor written as TQ1_0,
    ``qtypes`` maps GGUF tensor kinds (``attn_q``, ``ffn_down``, ``token_embd``, ...) to a block type
    gguf-py can quantize to (Q8_0, Q5_0, Q4_1, ...; the tiny model's widths are multiples of 32)."""
    cfg = json.loads((folder / "config.json").read_text())
    fam = "gemma3" if cfg["model_type"] == "gemma3_text" else "llama"
    arch = arch or fam
    t = load_file(str(folder / "model.safetensors"))
    w = gguf.GGUFWriter(str(out), arch)
    w.add_name("tiny-" + fam)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    w.add_rope_freq_base(cfg["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    if fam == "gemma3":
        w.add_sliding_window(cfg["sliding_window"])
    # A sentencepiece-style vocabulary (merges are derived from it); ids match tests/tinymodel.py.
    w.add_tokenizer_model("llama")
    w.add_token_list(SPECIALS + ["\u2581" + x for x in WORDS])
    w.add_token_scores([0.0] * len(SPECIALS) + [-float(i) for i in range(len(WORDS))])
    w.add_token_types([gguf.TokenType.CONTROL] * len(SPECIALS) + [gguf.TokenType.NORMAL] * len(WORDS))
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_add_bos_token(fam == "gemma3")
    if fam == "llama":
        w.add_chat_template(CHAT_TEMPLATE)
    names = _GGUF_NAMES | (_GEMMA if fam == "gemma3" else _LLAMA)
    for name, arr in t.items():
        key = name.removeprefix("model.")
        if key == "embed_tokens.weight":
            gname = "token_embd.weight"
        elif key == "norm.weight":
            gname = "output_norm.weight"
        elif key == "lm_head.weight":
            gname = "output.weight"
        else:
            layer, rest = key.removeprefix("layers.").split(".", 1)
            gname = f"blk.{layer}.{names[rest]}"
        arr = arr.astype(np.float32)
        if fam == "llama" and key.endswith("q_proj.weight"):
            arr = permute(arr, cfg["num_attention_heads"])
        if fam == "llama" and key.endswith("k_proj.weight"):
            arr = permute(arr, cfg["num_key_value_heads"])
        if fam == "gemma3" and key.endswith("norm.weight"):
            arr = arr + 1.0
        if gname == bad_tensor:
            # TQ1_0 is a real GGML type we do not dequantize: 54 bytes per 256 values.
            raw = np.zeros((arr.shape[0], (arr.shape[1] // 256 + 1) * 54), dtype=np.uint8)
            w.add_tensor(gname, raw, raw_dtype=gguf.GGMLQuantizationType.TQ1_0)
            continue
        kind = gname.split(".")[-2] if gname.startswith("blk.") else gname.removesuffix(".weight")
        if qtypes and kind in qtypes:
            qt = gguf.GGMLQuantizationType[qtypes[kind]]
            w.add_tensor(gname, gguf.quants.quantize(arr, qt), raw_dtype=qt)
            continue
        w.add_tensor(gname, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def tiny_gguf_vindex(root: Path, family: str, seed: int, qtypes: dict[str, str]) -> Path:
    """A tiny GGUF-compatible model of ``family`` written as a GGUF with ``qtypes`` (tensor name ->
    block type) and extracted to a `gguf` vindex under ``root``: compact weights in ggml's own blocks."""
    from larql_edge.tools.slicer.extract import extract
    from tests.tinymodel import make_tiny_model

    hf = make_tiny_model(root / "hf", family, seed=seed, gguf_compatible=True)
    out = root / "v"
    extract(str(hf_to_gguf(hf, root / "m.gguf", qtypes=qtypes)), out, quant="gguf", progress=False, log=lambda m: None)
    return out
