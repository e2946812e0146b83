"""Hugging Face model folders: config.json, *.safetensors (single or sharded), tokenizer.json."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import numpy as np

from larql_edge.errors import SourceError, UnsupportedTensorType
from larql_edge.format.families import family_for_hf_model_type
from larql_edge.tools.slicer.extract._source import ModelSource

_NUMPY_DTYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64}


def _read_json(p: Path) -> Any:
    try:
        return json.loads(p.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SourceError(f"{p}: unreadable JSON ({e})") from None


class _SafetensorsFile:
    """Reads tensors straight from a .safetensors file's header and data (incl. BF16, which numpy lacks)."""

    def __init__(self, path: Path):
        self.path = path
        try:
            with open(path, "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(n))
        except (OSError, struct.error, ValueError) as e:
            raise SourceError(f"{path}: truncated or corrupt safetensors file ({e})") from None
        self.data_start = 8 + n
        header.pop("__metadata__", None)
        self.header: dict[str, dict[str, Any]] = header

    def get(self, name: str) -> np.ndarray:
        h = self.header[name]
        start, end = h["data_offsets"]
        dtype = h["dtype"]
        mm = np.memmap(self.path, dtype=np.uint8, mode="r")
        raw = mm[self.data_start + start : self.data_start + end]
        if raw.size != end - start:
            raise SourceError(f"{self.path}: tensor {name} is truncated")
        if dtype == "BF16":
            arr = (raw.view("<u2").astype(np.uint32) << 16).view(np.float32)
        elif dtype in _NUMPY_DTYPES:
            arr = raw.view(np.dtype(_NUMPY_DTYPES[dtype]).newbyteorder("<"))
        else:
            raise UnsupportedTensorType(f"{self.path}: tensor {name} has unsupported dtype {dtype}")
        return np.asarray(arr, dtype=np.float32).reshape(h["shape"])


def open_hf(folder: Path) -> ModelSource:
    cfg_all = _read_json(folder / "config.json")
    cfg = cfg_all.get("text_config") or cfg_all
    model_type = cfg.get("model_type") or cfg_all.get("model_type") or ""
    fam = family_for_hf_model_type(model_type)

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise SourceError(f"{folder}: no *.safetensors files")
    idx = folder / "model.safetensors.index.json"
    if idx.is_file():
        weight_map = _read_json(idx).get("weight_map", {})
        missing = sorted({f for f in weight_map.values() if not (folder / f).is_file()})
        if missing:
            raise SourceError(f"{folder}: sharded checkpoint is missing {', '.join(missing)}")
    readers = [_SafetensorsFile(f) for f in files]
    # Normalized key -> (file, name inside it)
    names = {_strip(n): (r, n) for r in readers for n in r.header}
    if "embed_tokens.weight" not in names:
        raise SourceError(f"{folder}: no embed_tokens.weight tensor")
    r0, n0 = names["embed_tokens.weight"]
    vocab, hidden = (int(s) for s in r0.header[n0]["shape"])
    n_layers = int(cfg["num_hidden_layers"])
    n_head = int(cfg["num_attention_heads"])
    head_dim = int(cfg.get("head_dim") or hidden // n_head)
    tie_default = fam.name == "gemma3"
    tied = bool(cfg.get("tie_word_embeddings", cfg_all.get("tie_word_embeddings", tie_default))) or (
        "lm_head.weight" not in names
    )
    rope_params = cfg.get("rope_parameters") or {}
    rope_base = cfg.get("rope_theta") or (rope_params.get("full_attention") or rope_params).get("rope_theta", 10000.0)
    local_base = cfg.get("rope_local_base_freq") or (rope_params.get("sliding_attention") or {}).get("rope_theta")
    tok_cfg_path = folder / "tokenizer_config.json"
    tok_cfg = _read_json(tok_cfg_path) if tok_cfg_path.is_file() else {}
    conf: dict[str, Any] = {
        "num_layers": n_layers,
        "hidden_size": int(cfg.get("hidden_size", hidden)),
        "intermediate_size": int(cfg["intermediate_size"]),
        "vocab_size": vocab,
        "head_dim": head_dim,
        "num_q_heads": n_head,
        "num_kv_heads": int(cfg.get("num_key_value_heads", n_head)),
        "rope_base": float(rope_base),
        "rms_norm_eps": float(cfg.get("rms_norm_eps", 1e-6)),
        "max_position_embeddings": cfg.get("max_position_embeddings"),
        "sliding_window": cfg.get("sliding_window"),
        "final_logit_softcapping": cfg.get("final_logit_softcapping"),
        "attn_logit_softcapping": cfg.get("attn_logit_softcapping"),
        "bos_token_id": cfg.get("bos_token_id", cfg_all.get("bos_token_id")),
        "eos_token_id": cfg.get("eos_token_id", cfg_all.get("eos_token_id")),
        "add_bos_token": bool(tok_cfg.get("add_bos_token", fam.name == "gemma3")),
        "tie_word_embeddings": tied,
    }
    if fam.name == "gemma3":
        conf["query_pre_attn_scalar"] = cfg.get("query_pre_attn_scalar", head_dim)
        conf["rope_local_base"] = float(local_base or fam.default_rope_local_base or 10000.0)
        conf["sliding_window_pattern"] = cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern")
        if cfg.get("layer_types"):
            conf["layer_types"] = list(cfg["layer_types"])

    tok_path = folder / "tokenizer.json"

    def tokenizer_json() -> str:
        if not tok_path.is_file():
            raise SourceError(f"{folder}: no tokenizer.json")
        return tok_path.read_text()

    def get(key: str) -> np.ndarray:
        reader, name = names[key]
        return reader.get(name)

    def tokenizer_config() -> dict[str, Any]:
        template = tok_cfg.get("chat_template")
        if isinstance(template, list):  # named templates: the one called "default" renders chats
            template = next((t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"),
                            None)
        jinja = folder / "chat_template.jinja"  # transformers >= 4.43 may save the template beside
        if template is None and jinja.is_file():
            template = jinja.read_text()
        return {"chat_template": template if isinstance(template, str) and template.strip() else None,
                "bos_token": _token_text(tok_cfg.get("bos_token")), "eos_token": _token_text(tok_cfg.get("eos_token")),
                "add_bos_token": conf["add_bos_token"]}

    def generation_config() -> dict[str, Any]:
        gen_path = folder / "generation_config.json"
        gen = _read_json(gen_path) if gen_path.is_file() else {}
        eos = gen.get("eos_token_id", conf.get("eos_token_id"))
        out = {k: v for k, v in gen.items() if k in ("bos_token_id", "pad_token_id")}
        out["eos_token_id"] = sorted({int(i) for i in (eos if isinstance(eos, list) else [eos]) if isinstance(i, int)})
        return out

    return ModelSource(
        family=fam,
        name=str(cfg_all.get("_name_or_path") or folder.name),
        config=conf,
        keys=set(names),
        get=get,
        tokenizer_json=tokenizer_json,
        tokenizer_config=tokenizer_config,
        generation_config=generation_config,
        tied=tied,
        info={"type": "safetensors", "folder": folder.name, "model_type": model_type},
    )


def _token_text(token: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(token, dict):
        token = token.get("content")
    return token if isinstance(token, str) else None


def _strip(name: str) -> str:
    for prefix in ("language_model.model.", "model.language_model.", "model."):
        if name.startswith(prefix):
            return name[len(prefix) :]
    return name
