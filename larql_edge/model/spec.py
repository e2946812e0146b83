"""ModelSpec: everything the forward pass needs to know about a model, read from index.json."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from larql_edge.tools.slicer.errors import VindexError
from larql_edge.format.families import Family, family_by_name, family_for_hf_model_type


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
    def from_index(cls, index: dict[str, Any]) -> "ModelSpec":
        mc = index.get("model_config") or {}
        try:
            fam = family_by_name(index["family"]) if index.get("family") else family_for_hf_model_type(
                mc.get("model_type", "")
            )
            n_layers = int(index["num_layers"])
            hidden = int(index["hidden_size"])
            head_dim = int(mc["head_dim"])
            nq = int(mc["num_q_heads"])
            nkv = int(mc["num_kv_heads"])
        except (KeyError, TypeError, ValueError) as e:
            raise VindexError(f"index.json model_config is incomplete ({e})") from None
        sliding = mc.get("sliding_window")
        layer_types = mc.get("layer_types")
        if not layer_types:
            pattern = mc.get("sliding_window_pattern") or fam.default_sliding_window_pattern
            if sliding and pattern:
                layer_types = [
                    "full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(n_layers)
                ]
            else:
                layer_types = ["full_attention"] * n_layers
        if len(layer_types) != n_layers:
            raise VindexError(f"index.json: layer_types has {len(layer_types)} entries for {n_layers} layers")
        qpas = mc.get("query_pre_attn_scalar")
        attn_scale = float(qpas) ** -0.5 if qpas else head_dim**-0.5
        eos = mc.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((int(eos),) if eos is not None else ())
        return cls(
            family=fam,
            num_layers=n_layers,
            hidden_size=hidden,
            intermediate_size=int(index.get("intermediate_size") or 0),
            vocab_size=int(index["vocab_size"]),
            head_dim=head_dim,
            num_q_heads=nq,
            num_kv_heads=nkv,
            rope_base=float(mc.get("rope_base", 10000.0)),
            rope_local_base=(
                float(mc["rope_local_base"]) if mc.get("rope_local_base") is not None else fam.default_rope_local_base
            ),
            sliding_window=int(sliding) if sliding else None,
            layer_types=tuple(layer_types),
            rms_norm_eps=float(mc.get("rms_norm_eps", 1e-6)),
            attn_scale=attn_scale,
            embed_scale=float(index.get("embed_scale", fam.embed_scale(hidden))),
            final_logit_softcapping=_opt_float(mc.get("final_logit_softcapping")),
            attn_logit_softcapping=_opt_float(mc.get("attn_logit_softcapping")),
            bos_token_id=_opt_int(mc.get("bos_token_id")),
            eos_token_ids=eos_ids,
            add_bos_token=bool(mc.get("add_bos_token", False)),
        )


def _opt_float(v: Any) -> float | None:
    return None if v is None else float(v)


def _opt_int(v: Any) -> int | None:
    return None if v is None else int(v)
