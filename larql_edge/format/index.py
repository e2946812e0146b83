"""``index.json`` as typed values: `VindexIndex` and its `ModelConfig`, validated on read.

Field names and meanings are LARQL's (``VindexConfig`` / ``VindexModelConfig``; see
/work/shared/larql-format.md §2 and DESIGN.md §1). Every reader of a vindex goes through these
classes; nobody else parses the JSON. Keys this version does not know are kept in ``extra`` and
written back unchanged, so a newer writer's fields survive a rewrite (slice, publish).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace
from typing import Any

from larql_edge.errors import VindexError

FORMAT_VERSION = 2
EXTRACT_LEVELS = ("browse", "attention", "inference", "all")
DTYPES = ("f16", "f32")
QUANTS = ("none", "q4k", "gguf")  # gguf: larql-edge's own (format/q4k.py); LARQL knows none and q4k


def level_rank(level: str) -> int:
    try:
        return EXTRACT_LEVELS.index(level)
    except ValueError:
        raise VindexError(f"unknown extract_level {level!r} (one of {', '.join(EXTRACT_LEVELS)})") from None


def _positive_int(d: dict[str, Any], key: str, where: str, minimum: int = 1, maximum: int | None = None) -> int:
    v = d.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise VindexError(f"{where}: {key} must be an integer >= {minimum}, got {v!r}")
    if maximum is not None and v > maximum:
        raise VindexError(f"{where}: {key} {v} is beyond this format's limit of {maximum}")
    return v


# Shapes beyond any model the format describes (the largest today: ~130 layers, hidden 16,384, vocab
# 262,144): an index.json claiming more contradicts its files, and a role would size work by it
# (larql-ffn on num_layers 10**9 never became ready and grew without bound).
MAX_LAYERS = 4096
MAX_HIDDEN = 1 << 17
MAX_VOCAB = 1 << 23
MAX_INTERMEDIATE = 1 << 20


def _file_name(name: Any, where: str) -> str:
    """A checksums key: a file of the vindex folder itself, never a path out of it."""
    if (not isinstance(name, str) or not name or name in (".", "..") or "/" in name or "\\" in name
            or "\0" in name):
        raise VindexError(f"{where}: checksums names {str(name)[:80]!r}, not a file of the vindex folder")
    return name


def _opt_number(d: dict[str, Any], key: str, where: str) -> float | None:
    v = d.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise VindexError(f"{where}: {key} must be a finite number, got {v!r}")
    return float(v)


def _opt_int(d: dict[str, Any], key: str, where: str) -> int | None:
    v = d.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise VindexError(f"{where}: {key} must be an integer, got {v!r}")
    return v


@dataclass(frozen=True)
class ModelConfig:
    """``index.json.model_config``: what the forward pass needs beyond the shapes."""

    model_type: str
    head_dim: int
    num_q_heads: int
    num_kv_heads: int
    rope_base: float = 10000.0
    sliding_window: int | None = None
    layer_types: tuple[str, ...] | None = None
    rope_local_base: float | None = None
    sliding_window_pattern: int | None = None
    query_pre_attn_scalar: float | None = None
    final_logit_softcapping: float | None = None
    attn_logit_softcapping: float | None = None
    rms_norm_eps: float | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    add_bos_token: bool = False
    max_position_embeddings: int | None = None
    tie_word_embeddings: bool | None = None
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    _KNOWN = (
        "model_type", "head_dim", "num_q_heads", "num_kv_heads", "rope_base", "sliding_window", "layer_types",
        "rope_local_base", "sliding_window_pattern", "query_pre_attn_scalar", "final_logit_softcapping",
        "attn_logit_softcapping", "rms_norm_eps", "bos_token_id", "eos_token_id", "add_bos_token",
        "max_position_embeddings", "tie_word_embeddings",
    )  # fmt: skip

    @classmethod
    def from_json(cls, d: Any, where: str = "index.json model_config") -> "ModelConfig":
        if not isinstance(d, dict):
            raise VindexError(f"{where}: not an object")
        for key in ("head_dim", "num_q_heads", "num_kv_heads"):
            if key not in d:
                raise VindexError(f"{where} is incomplete (no {key})")
        layer_types = d.get("layer_types")
        if layer_types is not None and (
            not isinstance(layer_types, list) or not all(isinstance(t, str) for t in layer_types)
        ):
            raise VindexError(f"{where}: layer_types must be a list of strings")
        eos = d.get("eos_token_id")
        if isinstance(eos, list):
            if not all(isinstance(e, int) and not isinstance(e, bool) for e in eos):
                raise VindexError(f"{where}: eos_token_id must be an integer or a list of integers")
            eos_ids = tuple(eos)
        else:
            e = _opt_int(d, "eos_token_id", where)
            eos_ids = () if e is None else (e,)
        window = _opt_int(d, "sliding_window", where)
        return cls(
            model_type=str(d.get("model_type") or ""),
            head_dim=_positive_int(d, "head_dim", where),
            num_q_heads=_positive_int(d, "num_q_heads", where),
            num_kv_heads=_positive_int(d, "num_kv_heads", where),
            rope_base=_opt_number(d, "rope_base", where) or 10000.0,
            sliding_window=window or None,
            layer_types=tuple(layer_types) if layer_types else None,
            rope_local_base=_opt_number(d, "rope_local_base", where),
            sliding_window_pattern=_opt_int(d, "sliding_window_pattern", where),
            query_pre_attn_scalar=_opt_number(d, "query_pre_attn_scalar", where),
            final_logit_softcapping=_opt_number(d, "final_logit_softcapping", where),
            attn_logit_softcapping=_opt_number(d, "attn_logit_softcapping", where),
            rms_norm_eps=_opt_number(d, "rms_norm_eps", where),
            bos_token_id=_opt_int(d, "bos_token_id", where),
            eos_token_ids=eos_ids,
            add_bos_token=bool(d.get("add_bos_token", False)),
            max_position_embeddings=_opt_int(d, "max_position_embeddings", where),
            tie_word_embeddings=d.get("tie_word_embeddings") if isinstance(d.get("tie_word_embeddings"), bool) else None,
            extra={k: v for k, v in d.items() if k not in cls._KNOWN},
        )

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in fields(self):
            if f.name in ("extra", "eos_token_ids"):
                continue
            v = getattr(self, f.name)
            if f.name == "layer_types" and v is not None:
                v = list(v)
            if v is not None:
                out[f.name] = v
        if self.eos_token_ids:
            out["eos_token_id"] = self.eos_token_ids[0] if len(self.eos_token_ids) == 1 else list(self.eos_token_ids)
        return out | self.extra


@dataclass(frozen=True)
class LayerInfo:
    """Where a layer's gate vectors lie in ``gate_vectors.bin`` (bytes)."""

    layer: int
    num_features: int
    offset: int
    length: int
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    @classmethod
    def from_json(cls, d: Any, where: str) -> "LayerInfo":
        if not isinstance(d, dict):
            raise VindexError(f"{where}: a layers entry is not an object")
        known = ("layer", "num_features", "offset", "length")
        return cls(
            layer=_positive_int(d, "layer", where, 0),
            num_features=_positive_int(d, "num_features", where, 0),
            offset=_positive_int(d, "offset", where, 0),
            length=_positive_int(d, "length", where, 0),
            extra={k: v for k, v in d.items() if k not in known},
        )

    def to_json(self) -> dict[str, Any]:
        return {"layer": self.layer, "num_features": self.num_features, "offset": self.offset, "length": self.length} | self.extra


@dataclass(frozen=True)
class VindexIndex:
    """``index.json``: the model's shapes, what the folder holds, and how it was made."""

    num_layers: int
    hidden_size: int
    vocab_size: int
    model: str = ""
    family: str = ""
    intermediate_size: int = 0
    embed_scale: float = 1.0
    extract_level: str = "browse"
    dtype: str = "f32"  # LARQL's default when the field is absent
    quant: str = "none"
    has_model_weights: bool = False
    layers: tuple[LayerInfo, ...] = ()
    down_top_k: int = 0
    model_config: ModelConfig | None = None
    checksums: dict[str, str] = field(default_factory=dict, compare=False)
    source: dict[str, Any] = field(default_factory=dict, compare=False)
    # Not a LARQL field (LARQL reads a tied model from the files); written for readers that want it.
    lm_head_tied: bool | None = None
    version: int = FORMAT_VERSION
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    _KNOWN = (
        "version", "model", "family", "num_layers", "hidden_size", "intermediate_size", "vocab_size", "embed_scale",
        "extract_level", "dtype", "quant", "has_model_weights", "layers", "down_top_k", "model_config", "checksums",
        "source", "lm_head_tied",
    )  # fmt: skip

    @classmethod
    def from_json(cls, d: Any, where: str = "index.json") -> "VindexIndex":
        if not isinstance(d, dict):
            raise VindexError(f"{where}: index.json is not a JSON object")
        missing = [k for k in ("version", "num_layers", "hidden_size", "vocab_size") if k not in d]
        if missing:
            raise VindexError(f"{where}: index.json lacks {', '.join(missing)}")
        if d.get("version") != FORMAT_VERSION:
            raise VindexError(f"{where}: unsupported vindex version {d.get('version')!r} (expected {FORMAT_VERSION})")
        level = d.get("extract_level", "browse")
        level_rank(level) if isinstance(level, str) else None
        dtype = d.get("dtype", "f32")
        if dtype not in DTYPES:
            raise VindexError(f"{where}: dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
        quant = d.get("quant", "none")
        if quant not in QUANTS:
            raise VindexError(f"{where}: quant {quant!r} is not supported (one of {', '.join(QUANTS)})")
        layers = d.get("layers") or []
        if not isinstance(layers, list):
            raise VindexError(f"{where}: layers must be a list")
        checksums = d.get("checksums") or {}
        if not isinstance(checksums, dict) or not all(isinstance(v, str) for v in checksums.values()):
            raise VindexError(f"{where}: checksums must map file names to sha256 strings")
        for name in checksums:
            _file_name(name, where)
        source = d.get("source") or {}
        if not isinstance(source, dict):
            raise VindexError(f"{where}: source must be an object")
        mc = d.get("model_config")
        tied = d.get("lm_head_tied")
        if (_opt_int(d, "intermediate_size", where) or 0) > MAX_INTERMEDIATE:
            raise VindexError(f"{where}: intermediate_size {d['intermediate_size']} is beyond this format's limit of "
                              f"{MAX_INTERMEDIATE}")
        out = cls(
            version=FORMAT_VERSION,
            model=str(d.get("model") or ""),
            family=str(d.get("family") or ""),
            num_layers=_positive_int(d, "num_layers", where, maximum=MAX_LAYERS),
            hidden_size=_positive_int(d, "hidden_size", where, maximum=MAX_HIDDEN),
            vocab_size=_positive_int(d, "vocab_size", where, maximum=MAX_VOCAB),
            intermediate_size=_opt_int(d, "intermediate_size", where) or 0,
            embed_scale=_opt_number(d, "embed_scale", where) or 1.0,
            extract_level=str(level),
            dtype=dtype,
            quant=quant,
            has_model_weights=bool(d.get("has_model_weights", False)),
            layers=tuple(LayerInfo.from_json(x, where) for x in layers),
            down_top_k=_opt_int(d, "down_top_k", where) or 0,
            model_config=ModelConfig.from_json(mc, f"{where} model_config") if mc else None,
            checksums=dict(checksums),
            source=dict(source),
            lm_head_tied=tied if isinstance(tied, bool) else None,
            extra={k: v for k, v in d.items() if k not in cls._KNOWN},
        )
        beyond = sorted({x.layer for x in out.layers if x.layer >= out.num_layers})
        if beyond:
            raise VindexError(f"{where}: layers lists layer {beyond[0]}, but num_layers is {out.num_layers}")
        return out

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "version": self.version,
            "model": self.model,
            "family": self.family,
            "num_layers": self.num_layers,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "vocab_size": self.vocab_size,
            "embed_scale": self.embed_scale,
            "extract_level": self.extract_level,
            "dtype": self.dtype,
            "has_model_weights": self.has_model_weights,
            "layers": [x.to_json() for x in self.layers],
            "down_top_k": self.down_top_k,
        }
        if self.quant != "none":
            out["quant"] = self.quant
        if self.model_config is not None:
            out["model_config"] = self.model_config.to_json()
        if self.lm_head_tied is not None:
            out["lm_head_tied"] = self.lm_head_tied
        out["checksums"] = dict(self.checksums)
        out["source"] = dict(self.source)
        return out | self.extra

    def replace(self, **changes: Any) -> "VindexIndex":
        return replace(self, **changes)

    def layer(self, i: int) -> LayerInfo | None:
        return next((x for x in self.layers if x.layer == i), None)
