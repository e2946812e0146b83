"""ModelSpec: everything the forward pass needs to know about a model, from its typed index."""

from __future__ import annotations

from dataclasses import dataclass

from larql_edge.errors import VindexError
from larql_edge.format.families import Family, family_by_name, family_for_hf_model_type
from larql_edge.format.index import VindexIndex


@dataclass(frozen=True)
class ModelSpec:
    family: Family
    num_layers: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    head_dim: int
    num_q_heads: int
    num_kv_heads: int
    rope_base: float
    rope_local_base: float | None
    sliding_window: int | None
    layer_types: tuple[str, ...]  # "full_attention" | "sliding_attention" per layer
    rms_norm_eps: float
    attn_scale: float
    embed_scale: float
    final_logit_softcapping: float | None
    attn_logit_softcapping: float | None
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    add_bos_token: bool

    def is_sliding(self, layer: int) -> bool:
        return self.layer_types[layer] == "sliding_attention" and self.sliding_window is not None

    def rope_base_for(self, layer: int) -> float:
        if self.is_sliding(layer) and self.rope_local_base is not None:
            return self.rope_local_base
        return self.rope_base

    @classmethod
    def from_index(cls, index: VindexIndex) -> "ModelSpec":
        """The spec of a vindex's model, from its typed index (`larql_edge.format.index`)."""
        mc = index.model_config
        if mc is None:
            raise VindexError("index.json has no model_config: the forward pass cannot be built")
        fam = family_by_name(index.family) if index.family else family_for_hf_model_type(mc.model_type)
        n_layers = index.num_layers
        layer_types: tuple[str, ...] | None = mc.layer_types
        if not layer_types:
            pattern = mc.sliding_window_pattern or fam.default_sliding_window_pattern
            if mc.sliding_window and pattern:
                layer_types = tuple(
                    "full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(n_layers)
                )
            else:
                layer_types = ("full_attention",) * n_layers
        if len(layer_types) != n_layers:
            raise VindexError(f"index.json: layer_types has {len(layer_types)} entries for {n_layers} layers")
        qpas = mc.query_pre_attn_scalar
        return cls(
            family=fam,
            num_layers=n_layers,
            hidden_size=index.hidden_size,
            intermediate_size=index.intermediate_size,
            vocab_size=index.vocab_size,
            head_dim=mc.head_dim,
            num_q_heads=mc.num_q_heads,
            num_kv_heads=mc.num_kv_heads,
            rope_base=mc.rope_base,
            rope_local_base=mc.rope_local_base if mc.rope_local_base is not None else fam.default_rope_local_base,
            sliding_window=mc.sliding_window,
            layer_types=tuple(layer_types),
            rms_norm_eps=mc.rms_norm_eps if mc.rms_norm_eps is not None else 1e-6,
            attn_scale=float(qpas) ** -0.5 if qpas else mc.head_dim**-0.5,
            embed_scale=index.embed_scale,
            final_logit_softcapping=mc.final_logit_softcapping,
            attn_logit_softcapping=mc.attn_logit_softcapping,
            bos_token_id=mc.bos_token_id,
            eos_token_ids=mc.eos_token_ids,
            add_bos_token=mc.add_bos_token,
        )
