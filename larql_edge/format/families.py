"""Model families described as data.

Each supported architecture is one `Family` entry: how its tensors are named in GGUF and in
Hugging Face checkpoints, and the traits the forward pass needs (norm style, activation, q/k norms,
sandwich norms, embedding scale, sliding-window pattern, attention scaling, softcaps). The model math
in `app.model` reads these traits instead of branching on family names.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from gguf import MODEL_TENSOR as MT
from gguf import TENSOR_NAMES

from larql_edge.errors import UnsupportedArchitecture


@dataclass(frozen=True)
class Family:
    name: str
    # Hugging Face `model_type` values that map to this family.
    hf_model_types: tuple[str, ...]
    # model_type written into index.json.model_config.
    model_type: str
    activation: str  # "gelu_tanh" | "silu"
    # RMSNorm multiplies by (norm_offset + w): Gemma stores w and applies (1 + w).
    norm_offset: float
    qk_norm: bool
    # Gemma's "sandwich" norms: post-attention and pre/post-FFN norms around each block.
    sandwich_norms: bool
    scale_embeddings: bool  # multiply input embeddings by sqrt(hidden)
    # llama.cpp permutes Q/K rows of these families when converting to GGUF.
    gguf_permutes_qk: bool
    # llama.cpp stores (1 + w) for these families' norms.
    gguf_norm_plus_one: bool
    default_rope_local_base: float | None = None
    default_sliding_window_pattern: int | None = None
    # GGUF per-layer tensor kind (gguf-py's MODEL_TENSOR) -> vindex key suffix (after "layers.N.").
    gguf_layer_tensors: dict[MT, str] = field(default_factory=dict)

    def embed_scale(self, hidden: int) -> float:
        return float(math.sqrt(hidden)) if self.scale_embeddings else 1.0

    # Per-layer norm keys by role; None when the family has no such norm.
    def pre_attn_norm_key(self, layer: int) -> str:
        return f"layers.{layer}.input_layernorm.weight"

    def post_attn_norm_key(self, layer: int) -> str | None:
        return f"layers.{layer}.post_attention_layernorm.weight" if self.sandwich_norms else None

    def pre_ffn_norm_key(self, layer: int) -> str:
        # Llama calls its pre-FFN norm "post_attention_layernorm" (HF naming); Gemma has a real one.
        if self.sandwich_norms:
            return f"layers.{layer}.pre_feedforward_layernorm.weight"
        return f"layers.{layer}.post_attention_layernorm.weight"

    def post_ffn_norm_key(self, layer: int) -> str | None:
        return f"layers.{layer}.post_feedforward_layernorm.weight" if self.sandwich_norms else None


_COMMON_GGUF = {
    MT.ATTN_Q: "self_attn.q_proj.weight",
    MT.ATTN_K: "self_attn.k_proj.weight",
    MT.ATTN_V: "self_attn.v_proj.weight",
    MT.ATTN_OUT: "self_attn.o_proj.weight",
    MT.FFN_GATE: "mlp.gate_proj.weight",
    MT.FFN_UP: "mlp.up_proj.weight",
    MT.FFN_DOWN: "mlp.down_proj.weight",
    MT.ATTN_NORM: "input_layernorm.weight",
}


def tensor_name(kind: MT, layer: int | None = None) -> str:
    """The GGUF tensor name llama.cpp gives a tensor kind (gguf-py's own table), ``.weight`` added."""
    return TENSOR_NAMES[kind].format(bid=layer) + ".weight"


GEMMA3 = Family(
    name="gemma3",
    hf_model_types=("gemma3_text", "gemma3"),
    model_type="gemma3_text",
    activation="gelu_tanh",
    norm_offset=1.0,
    qk_norm=True,
    sandwich_norms=True,
    scale_embeddings=True,
    gguf_permutes_qk=False,
    gguf_norm_plus_one=True,
    default_rope_local_base=10000.0,
    default_sliding_window_pattern=6,
    gguf_layer_tensors={
        **_COMMON_GGUF,
        MT.ATTN_Q_NORM: "self_attn.q_norm.weight",
        MT.ATTN_K_NORM: "self_attn.k_norm.weight",
        MT.ATTN_POST_NORM: "post_attention_layernorm.weight",
        MT.FFN_NORM: "pre_feedforward_layernorm.weight",
        MT.FFN_POST_NORM: "post_feedforward_layernorm.weight",
    },
)

LLAMA = Family(
    name="llama",
    hf_model_types=("llama",),
    model_type="llama",
    activation="silu",
    norm_offset=0.0,
    qk_norm=False,
    sandwich_norms=False,
    scale_embeddings=False,
    gguf_permutes_qk=True,
    gguf_norm_plus_one=False,
    gguf_layer_tensors={
        **_COMMON_GGUF,
        MT.FFN_NORM: "post_attention_layernorm.weight",
    },
)

FAMILIES: dict[str, Family] = {f.name: f for f in (GEMMA3, LLAMA)}


def family_by_name(name: str) -> Family:
    try:
        return FAMILIES[name]
    except KeyError:
        raise UnsupportedArchitecture(
            f"unsupported architecture {name!r} (supported: {', '.join(sorted(FAMILIES))})"
        ) from None


def family_for_hf_model_type(model_type: str) -> Family:
    for fam in FAMILIES.values():
        if model_type in fam.hf_model_types:
            return fam
    raise UnsupportedArchitecture(
        f"unsupported architecture {model_type!r} (supported: "
        + ", ".join(t for f in FAMILIES.values() for t in f.hf_model_types)
        + ")"
    )
