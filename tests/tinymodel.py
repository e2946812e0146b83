"""Tiny random models of each family, written as Hugging Face safetensors folders, plus an
independent reference forward pass over the source tensors.

The reference is deliberately written differently from `app.model` (per-head loops, explicit
causal masks, HF tensor names) so that agreement between the two means something.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

WORDS = (
    "the a capital of france is paris city river big small red blue green one two three and or not "
    "hello world def return if else for while in on at to from by with as be was were has have"
).split()

SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>"]
# The tiny Llama is a "chat" model (its tokenizer_config.json and GGUF carry this template); the
# tiny Gemma has none, as the packaged Gemma 3 GGUF has none.
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ m['role'] }} {{ m['content'] }}{{ eos_token }}{% endfor %}"
                 "{% if add_generation_prompt %}assistant{% endif %}")


def build_tokenizer(add_bos: bool) -> Tokenizer:
    vocab = {t: i for i, t in enumerate(SPECIALS + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok.add_special_tokens(SPECIALS)
    if add_bos:
        from tokenizers import processors

        tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 2)])
    return tok


VOCAB = len(SPECIALS) + len(WORDS)


def make_tiny_model(folder: Path, family: str, seed: int = 0, tied: bool | None = None, gguf_compatible: bool = False) -> Path:
    """Write a 2-layer random model of ``family`` ("gemma3" or "llama") into ``folder``.

    ``gguf_compatible`` keeps to what llama.cpp's Gemma 3 metadata can express (query scale from
    head_dim, every 6th layer global, no softcap), for tests that convert the model to GGUF.
    """
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    hidden, inter, n_layers, nq, nkv, hd = 32, 64, 2, 4, 2, 8
    tied = (family == "gemma3") if tied is None else tied

    def w(*shape, scale=0.2):
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    t: dict[str, np.ndarray] = {"model.embed_tokens.weight": w(VOCAB, hidden, scale=0.5)}
    for i in range(n_layers):
        p = f"model.layers.{i}."
        t[p + "self_attn.q_proj.weight"] = w(nq * hd, hidden)
        t[p + "self_attn.k_proj.weight"] = w(nkv * hd, hidden)
        t[p + "self_attn.v_proj.weight"] = w(nkv * hd, hidden)
        t[p + "self_attn.o_proj.weight"] = w(hidden, nq * hd)
        t[p + "mlp.gate_proj.weight"] = w(inter, hidden)
        t[p + "mlp.up_proj.weight"] = w(inter, hidden)
        t[p + "mlp.down_proj.weight"] = w(hidden, inter)
        t[p + "input_layernorm.weight"] = w(hidden, scale=0.1) + (0 if family == "gemma3" else 1)
        t[p + "post_attention_layernorm.weight"] = w(hidden, scale=0.1) + (0 if family == "gemma3" else 1)
        if family == "gemma3":
            t[p + "pre_feedforward_layernorm.weight"] = w(hidden, scale=0.1)
            t[p + "post_feedforward_layernorm.weight"] = w(hidden, scale=0.1)
            t[p + "self_attn.q_norm.weight"] = w(hd, scale=0.1)
            t[p + "self_attn.k_norm.weight"] = w(hd, scale=0.1)
    t["model.norm.weight"] = w(hidden, scale=0.1) + (0 if family == "gemma3" else 1)
    if not tied:
        t["lm_head.weight"] = w(VOCAB, hidden)
    save_file(t, str(folder / "model.safetensors"))

    common = {
        "hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": n_layers,
        "num_attention_heads": nq, "num_key_value_heads": nkv, "head_dim": hd, "vocab_size": VOCAB,
        "rms_norm_eps": 1e-6, "bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0,
        "tie_word_embeddings": tied, "max_position_embeddings": 128,
    }
    if family == "gemma3":
        cfg = common | {
            "model_type": "gemma3_text", "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0,
            "sliding_window": 4, "layer_types": ["sliding_attention", "full_attention"],
            "query_pre_attn_scalar": 16, "final_logit_softcapping": 30.0, "attn_logit_softcapping": None,
            "hidden_activation": "gelu_pytorch_tanh",
        }
        if gguf_compatible:
            cfg |= {"query_pre_attn_scalar": hd, "final_logit_softcapping": None,
                    "layer_types": ["sliding_attention"] * n_layers}
    elif family == "llama":
        cfg = common | {"model_type": "llama", "rope_theta": 10_000.0, "hidden_act": "silu"}
    else:
        cfg = common | {"model_type": family}
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    build_tokenizer(add_bos=family == "gemma3").save(str(folder / "tokenizer.json"))
    if family == "llama":
        (folder / "tokenizer_config.json").write_text(json.dumps(
            {"add_bos_token": False, "bos_token": "<bos>", "eos_token": {"content": "<eos>", "special": True},
             "chat_template": CHAT_TEMPLATE}, indent=2))
    return folder


# -- the independent reference -------------------------------------------------------------------


def reference_logits(folder: Path, ids: list[int]) -> np.ndarray:
    """Logits ``[seq, vocab]`` from the safetensors folder, computed from first principles."""
    from safetensors.numpy import load_file

    cfg = json.loads((folder / "config.json").read_text())
    t = {k.removeprefix("model."): v.astype(np.float64) for k, v in load_file(str(folder / "model.safetensors")).items()}
    gemma = cfg["model_type"] == "gemma3_text"
    hd, nq, nkv = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    eps = cfg["rms_norm_eps"]

    def norm(x, wt):
        r = x / np.sqrt((x * x).mean(-1, keepdims=True) + eps)
        return r * ((1.0 + wt) if gemma else wt)

    def rope(x, pos, base):  # x [seq, hd]
        out = np.empty_like(x)
        half = hd // 2
        for s, p in enumerate(pos):
            for i in range(half):
                theta = p / base ** (2 * i / hd)
                c, sn = np.cos(theta), np.sin(theta)
                a, b = x[s, i], x[s, i + half]
                out[s, i], out[s, i + half] = a * c - b * sn, b * c + a * sn
        return out

    seq = len(ids)
    h = t["embed_tokens.weight"][ids] * (np.sqrt(cfg["hidden_size"]).astype(np.float32) if gemma else 1.0)
    pos = list(range(seq))
    for L in range(cfg["num_hidden_layers"]):
        p = f"layers.{L}."
        x = norm(h, t[p + "input_layernorm.weight"])
        sliding = gemma and cfg["layer_types"][L] == "sliding_attention"
        base = cfg["rope_local_base_freq"] if sliding else cfg["rope_theta"]
        heads = []
        for qh in range(nq):
            kh = qh // (nq // nkv)
            q = x @ t[p + "self_attn.q_proj.weight"][qh * hd : (qh + 1) * hd].T
            k = x @ t[p + "self_attn.k_proj.weight"][kh * hd : (kh + 1) * hd].T
            v = x @ t[p + "self_attn.v_proj.weight"][kh * hd : (kh + 1) * hd].T
            if gemma:
                q, k = norm(q, t[p + "self_attn.q_norm.weight"]), norm(k, t[p + "self_attn.k_norm.weight"])
            q, k = rope(q, pos, base), rope(k, pos, base)
            scale = cfg["query_pre_attn_scalar"] ** -0.5 if gemma else hd**-0.5
            sc = (q @ k.T) * scale
            for i in range(seq):
                for j in range(seq):
                    if j > i or (sliding and i - j >= cfg["sliding_window"]):
                        sc[i, j] = -np.inf
            pr = np.exp(sc - sc.max(-1, keepdims=True))
            pr /= pr.sum(-1, keepdims=True)
            heads.append(pr @ v)
        a = np.concatenate(heads, -1) @ t[p + "self_attn.o_proj.weight"].T
        if gemma:
            a = norm(a, t[p + "post_attention_layernorm.weight"])
            h = h + a
            x = norm(h, t[p + "pre_feedforward_layernorm.weight"])
        else:
            h = h + a
            x = norm(h, t[p + "post_attention_layernorm.weight"])
        g = x @ t[p + "mlp.gate_proj.weight"].T
        act = 0.5 * g * (1 + np.tanh(np.sqrt(2 / np.pi) * (g + 0.044715 * g**3))) if gemma else g / (1 + np.exp(-g))
        f = (act * (x @ t[p + "mlp.up_proj.weight"].T)) @ t[p + "mlp.down_proj.weight"].T
        if gemma:
            f = norm(f, t[p + "post_feedforward_layernorm.weight"])
        h = h + f
    x = norm(h, t["norm.weight"])
    head = t.get("lm_head.weight", t["embed_tokens.weight"])
    logits = x @ head.T
    cap = cfg.get("final_logit_softcapping")
    if cap:
        logits = np.tanh(logits / cap) * cap
    return logits
