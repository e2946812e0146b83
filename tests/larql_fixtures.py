"""Vindexes laid out exactly as LARQL's extractor writes them, written without larql-edge's code.

An independent writer, so that larql-edge's readers and writers are checked against LARQL's layout
rather than against themselves. Everything here was written from LARQL's source (commit c880fb7):

- ``larql extract MODEL -o OUT [--quant q4k] [--f32] [--level L] [--drop-gate-vectors]`` runs the
  streaming extractor (``crates/larql-vindex/src/extract/streaming/{mod,context}.rs`` and
  ``stages/*.rs``): gate_vectors -> embeddings -> down_meta -> tokenizer -> index.json -> model
  weights (``format/weights/write_f32.rs`` or ``write_q4k/*.rs``) -> checksums
  (``format/checksums.rs``), then copies the HF metadata files (``extract/metadata.rs``).
- The block encoders are scalar, line-by-line ports of LARQL's ``quantize_q4_k`` / ``quantize_q6_k``
  and its two f32->f16 encoders (``larql-compute/src/cpu/ops/q4_common.rs``,
  ``larql-models/src/quant/half.rs``), written separately from ``larql_edge.format.quant``.

Known, documented differences from a real LARQL run: ``down_meta.bin`` logits come from numpy's f32
matmul (LARQL's summation order may differ in the last bit), ``checksums`` is written in sorted order
(LARQL's is a HashMap), and ``extracted_at`` is the run's clock.
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
import struct
import time
from pathlib import Path
from typing import Any

import numpy as np

F = np.float32
LARQL_VERSION = "0.1.0"  # CARGO_PKG_VERSION of larql-vindex at c880fb7 (workspace version)


# -- LARQL's scalar encoders ---------------------------------------------------------------------


def _bits(v: float) -> int:
    return struct.unpack("<I", struct.pack("<f", v))[0]


def f16_kquant(v) -> int:
    """``q4_common.rs::f32_to_f16`` (K-quant scales): truncation, f16 subnormals kept."""
    bits = _bits(float(v))
    sign = (bits >> 16) & 0x8000
    exp = (bits >> 23) & 0xFF
    mant = bits & 0x7FFFFF
    if exp == 0:
        return sign
    if exp == 255:
        return sign | 0x7C00 | (mant >> 13)
    new_exp = exp - 127 + 15
    if new_exp >= 31:
        return sign | 0x7C00
    if new_exp <= 0:
        shift = 1 - new_exp
        if 13 + shift >= 24:
            return sign
        return sign | ((mant | 0x800000) >> (13 + shift))
    return sign | (new_exp << 10) | (mant >> 13)


def f16_side(v) -> int:
    """``half.rs::f32_to_f16`` (f16 side files: embeddings, gate, float weights): truncation, FTZ."""
    bits = _bits(float(v))
    sign = (bits >> 16) & 0x8000
    exp = (bits >> 23) & 0xFF
    mant = bits & 0x7FFFFF
    if exp == 255:
        return sign | 0x7C00 | (0x0200 if mant else 0)
    exp16 = exp - 127 + 15
    if exp16 >= 31:
        return sign | 0x7C00
    if exp16 <= 0:
        return sign
    return sign | (exp16 << 10) | (mant >> 13)


def encode_floats(data: np.ndarray, dtype: str) -> bytes:
    """``config/dtype.rs::encode_floats``."""
    flat = np.asarray(data, dtype=F).reshape(-1)
    if dtype == "f32":
        return flat.astype("<f4").tobytes()
    return struct.pack(f"<{flat.size}H", *(f16_side(v) for v in flat.tolist()))


def f16_array(a: np.ndarray) -> np.ndarray:
    """``a`` as LARQL's f16 side files hold it (``<f2``, same shape)."""
    a = np.asarray(a, dtype=F)
    return np.frombuffer(encode_floats(a, "f16"), dtype="<f2").reshape(a.shape)


def rust_round(v) -> F:
    """``f32::round``: half away from zero (exact for f32 inputs computed in double)."""
    x = float(v)
    return F(math.copysign(math.floor(abs(x) + 0.5), x))


def _clamp(v, lo, hi):
    return max(lo, min(hi, v))


def quantize_q4_k(data: np.ndarray) -> bytes:
    """Scalar port of LARQL's ``quantize_q4_k`` (144-byte GGUF block)."""
    vals = [F(x) for x in np.asarray(data, dtype=F).reshape(-1).tolist()]
    assert len(vals) % 256 == 0
    out = bytearray()
    for sb in range(len(vals) // 256):
        block = vals[sb * 256 : (sb + 1) * 256]
        sub_mins, sub_maxs = [], []
        for j in range(8):
            sub = block[j * 32 : (j + 1) * 32]
            sub_mins.append(min(min(sub), F(0.0)))
            sub_maxs.append(max(max(sub), F(0.0)))
        global_max_range = F(0.0)
        for a, b in zip(sub_maxs, sub_mins, strict=True):
            global_max_range = max(global_max_range, F(a - b))
        global_min = min(sub_mins)
        d = F(global_max_range / F(F(15.0) * F(63.0))) if global_max_range > 0 else F(0.0)
        dmin = F(-global_min / F(63.0)) if global_min < 0 else F(0.0)
        out += struct.pack("<HH", f16_kquant(d), f16_kquant(dmin))
        q_scales, q_mins = [], []
        for j in range(8):
            rng = F(sub_maxs[j] - sub_mins[j])
            q_scales.append(int(_clamp(rust_round(rng / F(F(15.0) * d)), 0, 63)) if d > 0 else 0)
            q_mins.append(int(_clamp(rust_round(F(-sub_mins[j]) / dmin), 0, 63)) if dmin > 0 else 0)
        packed = [0] * 12
        for j in range(4):
            packed[j] = (q_scales[j] & 0x3F) | (((q_scales[j + 4] >> 4) & 0x03) << 6)
            packed[j + 4] = (q_mins[j] & 0x3F) | (((q_mins[j + 4] >> 4) & 0x03) << 6)
            packed[j + 8] = (q_scales[j + 4] & 0x0F) | ((q_mins[j + 4] & 0x0F) << 4)
        out += bytes(packed)
        for g in range(4):
            lo_i, hi_i = 2 * g, 2 * g + 1
            sc_lo, sc_hi = F(d * F(q_scales[lo_i])), F(d * F(q_scales[hi_i]))
            mn_lo, mn_hi = F(dmin * F(q_mins[lo_i])), F(dmin * F(q_mins[hi_i]))
            inv_lo = F(F(1.0) / sc_lo) if sc_lo > 0 else F(0.0)
            inv_hi = F(F(1.0) / sc_hi) if sc_hi > 0 else F(0.0)
            for j in range(32):
                lo = int(_clamp(rust_round(F(F(block[lo_i * 32 + j] + mn_lo) * inv_lo)), 0, 15))
                hi = int(_clamp(rust_round(F(F(block[hi_i * 32 + j] + mn_hi) * inv_hi)), 0, 15))
                out.append(lo | (hi << 4))
    return bytes(out)


def quantize_q6_k(data: np.ndarray) -> bytes:
    """Scalar port of LARQL's ``quantize_q6_k`` (210-byte block, LARQL's linear bit layout)."""
    vals = [F(x) for x in np.asarray(data, dtype=F).reshape(-1).tolist()]
    assert len(vals) % 256 == 0
    out = bytearray()
    for sb in range(len(vals) // 256):
        block = vals[sb * 256 : (sb + 1) * 256]
        amax = F(0.0)
        for v in block:
            amax = max(amax, F(abs(v)))
        d = F(amax / F(F(31.0) * F(127.0)))
        sub_scales = []
        for j in range(16):
            sub_max = F(0.0)
            for v in block[j * 16 : (j + 1) * 16]:
                sub_max = max(sub_max, F(abs(v)))
            sc = F(sub_max / F(F(31.0) * d)) if d > 0 else F(0.0)
            sub_scales.append(int(_clamp(rust_round(sc), -128, 127)))
        q6 = [0] * 256
        for j, s in enumerate(sub_scales):
            sc = F(d * F(s))
            inv = F(F(1.0) / sc) if abs(sc) > F(1e-10) else F(0.0)
            for i in range(16):
                q = int(_clamp(rust_round(F(block[j * 16 + i] * inv)), -32, 31))
                q6[j * 16 + i] = q + 32
        out += bytes((q6[2 * i] & 0x0F) | ((q6[2 * i + 1] & 0x0F) << 4) for i in range(128))
        qh = [0] * 64
        for i, v in enumerate(q6):
            qh[i // 4] |= ((v >> 4) & 0x03) << ((i % 4) * 2)
        out += bytes(qh)
        out += bytes(s & 0xFF for s in sub_scales)
        out += struct.pack("<H", f16_kquant(d))
    return bytes(out)


def pad_rows_to_block(w: np.ndarray) -> tuple[np.ndarray, int]:
    rows, cols = w.shape
    pcols = (cols + 255) // 256 * 256
    out = np.zeros((rows, pcols), dtype=F)
    out[:, :cols] = w
    return out, pcols


# -- source model (a Hugging Face safetensors folder, as tests/tinymodel.py writes) --------------


class _Source:
    def __init__(self, folder: Path):
        from safetensors.numpy import load_file

        self.folder = folder
        self.config = json.loads((folder / "config.json").read_text())
        raw = {}
        for f in sorted(folder.glob("*.safetensors")):
            raw.update(load_file(str(f)))
        # normalize_key: strip the first matching prefix of ("language_model.model.", "model.")
        self.t = {}
        for k, v in raw.items():
            for p in ("language_model.model.", "model."):
                if k.startswith(p):
                    k = k[len(p) :]
                    break
            self.t[k] = v.astype(F)
        mt = self.config.get("model_type", "")
        self.family = "gemma3" if mt.startswith("gemma3") else mt
        self.is_gemma = mt.startswith("gemma")
        self.num_layers = int(self.config["num_hidden_layers"])
        self.hidden = int(self.config["hidden_size"])
        self.inter = int(self.config["intermediate_size"])

    def get(self, key: str) -> np.ndarray | None:
        return self.t.get(key)

    def model_config(self) -> dict[str, Any]:
        """``VindexModelConfig`` as serde writes it (``config/model.rs``; values per ``detect/parser.rs``)."""
        c = self.config
        nq = c.get("num_attention_heads", 8)
        out: dict[str, Any] = {
            "model_type": c.get("model_type", ""),
            "head_dim": c.get("head_dim", 256 if self.is_gemma else self.hidden // nq),
            "num_q_heads": nq,
            "num_kv_heads": c.get("num_key_value_heads", 4),
            "rope_base": float(c.get("rope_theta", 1_000_000.0 if self.is_gemma else 10_000.0)),
            "sliding_window": c.get("sliding_window"),
            "moe": None,
        }
        if c.get("sliding_window_pattern") is not None:
            out["sliding_window_pattern"] = c["sliding_window_pattern"]
        if c.get("layer_types") is not None:
            out["layer_types"] = list(c["layer_types"])
        out["attention_k_eq_v"] = bool(c.get("attention_k_eq_v", False))
        for ours, theirs in (("rope_local_base", "rope_local_base_freq"), ("query_pre_attn_scalar", "query_pre_attn_scalar"),
                             ("final_logit_softcapping", "final_logit_softcapping")):
            if c.get(theirs) is not None:
                out[ours] = float(c[theirs])
        return out


def chrono_now(secs: int | None = None) -> str:
    """``extract/build_helpers/timestamp.rs::chrono_now`` (its approximate calendar included)."""
    s = int(time.time()) if secs is None else secs
    days = s // 86400
    year = 1970 + days // 365
    rem = days % 365
    month, day = min(rem // 30 + 1, 12), min(rem % 30 + 1, 31)
    return f"{year:04}-{month:02}-{day:02}T{(s % 86400) // 3600:02}:{(s % 3600) // 60:02}:{s % 60:02}Z"


def _f32_repr(v: float) -> str:
    """How serde_json prints an f32 (shortest round-trip decimal, ``.0`` kept)."""
    r = str(np.float32(v))
    return r if any(ch in r for ch in ".en") else r + ".0"


def _pretty(obj: Any, f32_fields: dict[str, float] | None = None) -> str:
    text = json.dumps(obj, indent=2, ensure_ascii=False)
    for name, value in (f32_fields or {}).items():
        text = text.replace(f'"@f32:{name}@"', _f32_repr(value))
    return text


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# -- the writer -----------------------------------------------------------------------------------

LEVELS = ("browse", "attention", "inference", "all")


def write_larql_vindex(
    src_folder: Path,
    out: Path,
    *,
    quant: str = "none",
    dtype: str = "f16",
    level: str = "inference",
    model_name: str | None = None,
    down_top_k: int = 10,
    drop_gate_vectors: bool = False,
    down_q4k: bool = False,
    tied_lm_head: str = "none",
    declare_tied: bool = False,
) -> Path:
    """Write ``out`` as ``larql extract`` would from the HF folder ``src_folder``.

    ``tied_lm_head`` only matters for tied float vindexes: ``"none"`` is what ``larql extract`` writes
    (no lm_head file), ``"copy"`` what LARQL's in-RAM ``build_vindex`` path writes (the embeddings
    again as lm_head.bin), ``"link"`` the form larql-edge adopts (lm_head.bin a hard link to
    embeddings.bin, with the same manifest entry). ``declare_tied`` adds larql-edge's
    ``lm_head_tied`` key (LARQL ignores unknown keys).
    """
    from tokenizers import Tokenizer

    assert quant in ("none", "q4k") and dtype in ("f16", "f32") and level in LEVELS
    if quant == "q4k":
        dtype = "f16"  # the CLI forces f16 side files with --quant q4k
    src = _Source(Path(src_folder))
    name = model_name or str(src_folder)
    out.mkdir(parents=True, exist_ok=False)
    L, H = src.num_layers, src.hidden

    # 1. gate_vectors.bin (streaming/stages/gate_vectors.rs)
    layers, offset, gate_bytes = [], 0, bytearray()
    for i in range(L):
        g = src.get(f"layers.{i}.mlp.gate_proj.weight")
        b = encode_floats(g, dtype)
        layers.append({"layer": i, "num_features": int(g.shape[0]), "offset": offset, "length": len(b)})
        offset += len(b)
        gate_bytes += b
    if not drop_gate_vectors:
        (out / "gate_vectors.bin").write_bytes(bytes(gate_bytes))

    # 2. embeddings.bin (stages/embeddings.rs): raw, unscaled
    embed = src.get("embed_tokens.weight")
    vocab = int(embed.shape[0])
    (out / "embeddings.bin").write_bytes(encode_floats(embed, dtype))

    # 3. down_meta.bin (stages/down_meta.rs + format/down_meta.rs)
    tok = Tokenizer.from_file(str(src.folder / "tokenizer.json"))
    _write_down_meta(out / "down_meta.bin", src, embed, tok, down_top_k)

    # 4. tokenizer.json (stages/tokenizer.rs: tokenizer.to_string(pretty=true))
    (out / "tokenizer.json").write_text(tok.to_str(pretty=True))

    # 5. index.json (stages/index_json.rs), completed by the weight writer and finalize()
    index: dict[str, Any] = {
        "version": 2,
        "model": name,
        "family": src.family,
        "source": {
            "huggingface_repo": name,
            "huggingface_revision": None,
            "safetensors_sha256": None,
            "extracted_at": chrono_now(),
            "larql_version": LARQL_VERSION,
        },
        "checksums": None,
        "num_layers": L,
        "hidden_size": H,
        "intermediate_size": src.inter,
        "vocab_size": vocab,
        "embed_scale": "@f32:embed_scale@",
        "extract_level": level,
        "dtype": dtype,
        "quant": quant,
        "layer_bands": None,  # LayerBands::for_family: no band table below 8 layers
        "layers": layers,
        "down_top_k": down_top_k,
        "has_model_weights": False,
        "model_config": src.model_config(),
    }
    embed_scale = math.sqrt(H) if src.is_gemma else 1.0

    # 6. model weights (stages/model_weights.rs): q4k always writes them, float from level attention
    if quant == "q4k":
        _write_q4k(out, src, down_q4k)
        index["has_model_weights"] = True
    elif LEVELS.index(level) >= 1:
        _write_float(out, src, dtype, level, tied_lm_head)
        index["has_model_weights"] = True
    if declare_tied:
        index["lm_head_tied"] = src.get("lm_head.weight") is None

    # 7. finalize (context.rs): checksums of LARQL's fixed file list, then HF metadata snapshot
    listed = ("gate_vectors.bin", "embeddings.bin", "down_meta.bin", "down_meta.jsonl", "attn_weights.bin",
              "up_weights.bin", "down_weights.bin", "norms.bin", "lm_head.bin")
    index["checksums"] = {n: _sha256(out / n) for n in sorted(listed) if (out / n).is_file()}
    (out / "index.json").write_text(_pretty(index, {"embed_scale": embed_scale}))
    for meta in ("tokenizer_config.json", "special_tokens_map.json", "generation_config.json", "chat_template.jinja"):
        if (src.folder / meta).is_file():
            shutil.copyfile(src.folder / meta, out / meta)
    return out


def _write_down_meta(path: Path, src: _Source, embed: np.ndarray, tok, top_k: int) -> None:
    """Header ``magic 0x444D4554, version 1, num_layers, top_k``; per layer ``num_features`` then per
    feature ``top_token_id, c_score, top_k x (token_id, logit)``, zero padded. Tokens whose decoded
    text (special tokens skipped, trimmed) is empty are dropped from the list before padding."""
    buf = bytearray(struct.pack("<4I", 0x444D4554, 1, src.num_layers, top_k))
    for i in range(src.num_layers):
        down = src.get(f"layers.{i}.mlp.down_proj.weight")  # [hidden, inter]
        logits = embed @ down  # [vocab, inter]
        buf += struct.pack("<I", down.shape[1])
        for f in range(down.shape[1]):
            col = logits[:, f]
            k = min(top_k, col.size)
            order = np.argsort(-col, kind="stable")[:k]
            entries = []
            for idx in order.tolist():
                text = tok.decode([idx], skip_special_tokens=True).strip()
                if text:
                    entries.append((idx, float(col[idx])))
            top_id, c = entries[0] if entries else (0, 0.0)
            buf += struct.pack("<If", top_id, c)
            for j in range(top_k):
                tid, lg = entries[j] if j < len(entries) else (0, 0.0)
                buf += struct.pack("<If", tid, lg)
    path.write_bytes(bytes(buf))


class _Bin:
    def __init__(self, path: Path):
        self.path, self.data = path, bytearray()

    def add(self, b: bytes) -> tuple[int, int]:
        off = len(self.data)
        self.data += b
        return off, len(b)

    def save(self) -> None:
        self.path.write_bytes(bytes(self.data))


def _entry(key, kind, shape, off, length, file):
    return {"key": key, "kind": kind, "shape": list(shape), "offset": off, "length": length, "file": file}


def _write_float(out: Path, src: _Source, dtype: str, level: str, tied_lm_head: str) -> None:
    """``format/weights/write_f32.rs::write_model_weights_with_opts``."""
    rank = LEVELS.index(level)
    entries: list[dict[str, Any]] = []
    attn = _Bin(out / "attn_weights.bin")
    for i in range(src.num_layers):
        for p in ("q_proj", "k_proj", "v_proj", "o_proj"):
            key = f"layers.{i}.self_attn.{p}.weight"
            w = src.get(key)
            off, n = attn.add(encode_floats(w, dtype))
            entries.append(_entry(key, "tensor", w.shape, off, n, "attn_weights.bin"))
        if src.family == "gemma3":  # attn_q_norm_key / attn_k_norm_key are Some only for Gemma
            for nname in ("q_norm", "k_norm"):
                key = f"layers.{i}.self_attn.{nname}.weight"
                v = src.get(key)
                if v is not None:
                    off, n = attn.add(encode_floats(v, dtype))
                    entries.append(_entry(key, "vector", v.shape, off, n, "attn_weights.bin"))
    attn.save()
    if rank >= 2:
        up, down = _Bin(out / "up_weights.bin"), _Bin(out / "down_weights.bin")
        for i in range(src.num_layers):
            for b, p, file in ((up, "up_proj", "up_weights.bin"), (down, "down_proj", "down_weights.bin")):
                key = f"layers.{i}.mlp.{p}.weight"
                w = src.get(key)
                off, n = b.add(encode_floats(w, dtype))
                entries.append(_entry(key, "tensor", w.shape, off, n, file))
        up.save()
        down.save()
    norms = _Bin(out / "norms.bin")
    for i in range(src.num_layers):
        for s in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm"):
            key = f"layers.{i}.{s}.weight"
            v = src.get(key)
            if v is not None:
                off, n = norms.add(encode_floats(v, dtype))
                entries.append(_entry(key, "vector", v.shape, off, n, "norms.bin"))
    v = src.get("norm.weight")
    off, n = norms.add(encode_floats(v, dtype))
    entries.append(_entry("norm.weight", "vector", v.shape, off, n, "norms.bin"))
    norms.save()
    if rank >= 2:
        head = src.get("lm_head.weight")
        if head is not None:
            b = encode_floats(head, dtype)
            (out / "lm_head.bin").write_bytes(b)
            entries.append(_entry("lm_head.weight", "tensor", head.shape, 0, len(b), "lm_head.bin"))
        elif tied_lm_head in ("copy", "link"):
            emb = out / "embeddings.bin"
            if tied_lm_head == "copy":
                shutil.copyfile(emb, out / "lm_head.bin")
            else:
                (out / "lm_head.bin").hardlink_to(emb)
            shape = src.get("embed_tokens.weight").shape
            entries.append(_entry("lm_head.weight", "tensor", shape, 0, emb.stat().st_size, "lm_head.bin"))
    (out / "weight_manifest.json").write_text(_pretty(entries))


def _write_q4k(out: Path, src: _Source, down_q4k: bool) -> None:
    """``format/weights/write_q4k/{attn,ffn,norms,lm_head,mod}.rs``."""
    def q_entry(key, w, fmt, b):
        padded, pcols = pad_rows_to_block(w)
        data = quantize_q6_k(padded) if fmt == "Q6_K" else quantize_q4_k(padded)
        off, n = b.add(data)
        return {"key": key, "shape": [int(w.shape[0]), pcols], "format": fmt, "offset": off, "length": n}

    attn, am = _Bin(out / "attn_weights_q4k.bin"), []
    for i in range(src.num_layers):
        for j, p in enumerate(("q_proj", "k_proj", "v_proj", "o_proj")):
            key = f"layers.{i}.self_attn.{p}.weight"
            am.append(q_entry(key, src.get(key), "Q6_K" if j == 2 else "Q4_K", attn))
    attn.save()
    (out / "attn_weights_q4k_manifest.json").write_text(_pretty(am))

    ffn, fm = _Bin(out / "interleaved_q4k.bin"), []
    for i in range(src.num_layers):
        for j, p in enumerate(("gate_proj", "up_proj", "down_proj")):
            key = f"layers.{i}.mlp.{p}.weight"
            fm.append(q_entry(key, src.get(key), "Q6_K" if j == 2 and not down_q4k else "Q4_K", ffn))
    ffn.save()
    (out / "interleaved_q4k_manifest.json").write_text(_pretty(fm))

    norms, entries = _Bin(out / "norms.bin"), []
    keys = []
    for i in range(src.num_layers):
        keys += [f"layers.{i}.{s}" for s in (
            "input_layernorm.weight", "post_attention_layernorm.weight", "pre_feedforward_layernorm.weight",
            "post_feedforward_layernorm.weight")]
        if src.family == "gemma3":
            keys += [f"layers.{i}.self_attn.q_norm.weight", f"layers.{i}.self_attn.k_norm.weight"]
    keys.append("norm.weight")
    for key in keys:
        v = src.get(key)
        if v is not None:
            off, n = norms.add(encode_floats(v, "f32"))  # always f32 in the q4k writer
            entries.append(_entry(key, "vector", v.shape, off, n, "norms.bin"))
    norms.save()

    head = src.get("lm_head.weight")  # StreamingWeights::lm_head: None for tied models
    if head is not None:
        padded, pcols = pad_rows_to_block(head)
        data = quantize_q4_k(padded)
        (out / "lm_head_q4.bin").write_bytes(data)
        entries.append(_entry("lm_head.weight", "tensor_q4k", [head.shape[0], pcols], 0, len(data), "lm_head_q4.bin"))
    (out / "weight_manifest.json").write_text(_pretty(entries))


def make_fixture(root: Path, family: str, *, quant: str = "none", tied: bool | None = None, seed: int = 0, **kw) -> tuple[Path, Path]:
    """A tiny random model of ``family`` and its LARQL-layout vindex; returns (hf_folder, vindex)."""
    from tests.tinymodel import make_tiny_model

    t = "tied" if (tied if tied is not None else family == "gemma3") else "untied"
    tag = f"{family}-{t}-{quant}-{kw.get('dtype', 'f16')}-{seed}"
    hf = root / f"{tag}-hf"
    if not hf.exists():
        make_tiny_model(hf, family, seed=seed, tied=tied)
    vx = root / f"{tag}.vindex"
    if vx.exists():
        shutil.rmtree(vx)
    return hf, write_larql_vindex(hf, vx, quant=quant, **kw)
