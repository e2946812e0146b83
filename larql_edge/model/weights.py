"""Per-role weight views over a vindex, converted once into the backend's resident form.

Each role loads only what it uses: the attention-only client never touches FFN files, an FFN shard
loads only its own layers, the embed server only the embeddings, final norm and lm_head.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from larql_edge.errors import VindexError
from larql_edge.format.quant import QBlocks
from larql_edge.format.vindex import Vindex
from larql_edge.model.backend import Backend, get_backend
from larql_edge.model.spec import ModelSpec


def _vec(vx: Vindex, key: str | None) -> np.ndarray | None:
    if key is None or not vx.has_tensor(key):
        return None
    return vx.tensor_f32(key)


@dataclass
class AttentionLayer:
    q: object
    k: object
    v: object
    o: object
    q_norm: np.ndarray | None
    k_norm: np.ndarray | None
    pre_attn_norm: np.ndarray
    post_attn_norm: np.ndarray | None
    pre_ffn_norm: np.ndarray
    post_ffn_norm: np.ndarray | None


def load_attention_layer(vx: Vindex, spec: ModelSpec, layer: int, backend: Backend) -> AttentionLayer:
    fam = spec.family
    p = f"layers.{layer}.self_attn."
    try:
        pre_attn = vx.tensor_f32(fam.pre_attn_norm_key(layer))
        pre_ffn = vx.tensor_f32(fam.pre_ffn_norm_key(layer))
        return AttentionLayer(
            q=backend.prepare(vx.weight(p + "q_proj.weight")),
            k=backend.prepare(vx.weight(p + "k_proj.weight")),
            v=backend.prepare(vx.weight(p + "v_proj.weight")),
            o=backend.prepare(vx.weight(p + "o_proj.weight")),
            q_norm=_vec(vx, p + "q_norm.weight") if fam.qk_norm else None,
            k_norm=_vec(vx, p + "k_norm.weight") if fam.qk_norm else None,
            pre_attn_norm=pre_attn,
            post_attn_norm=_vec(vx, fam.post_attn_norm_key(layer)),
            pre_ffn_norm=pre_ffn,
            post_ffn_norm=_vec(vx, fam.post_ffn_norm_key(layer)),
        )
    except VindexError as e:
        raise VindexError(f"{vx.path}: attention weights for layer {layer} unavailable ({e})") from None


@dataclass
class FfnLayer:
    gate: object
    up: object
    down: object


def load_ffn_layer(vx: Vindex, layer: int, backend: Backend) -> FfnLayer:
    p = f"layers.{layer}.mlp."
    try:
        # A q4k vindex computes the gate from its own blocks (gate_vectors.bin is an f16 copy for browsing).
        gate = vx.weight(p + "gate_proj.weight") if vx.quantized else vx.gate(layer)
        return FfnLayer(
            gate=backend.prepare(gate),
            up=backend.prepare(vx.weight(p + "up_proj.weight")),
            down=backend.prepare(vx.weight(p + "down_proj.weight")),
        )
    except VindexError as e:
        raise VindexError(f"{vx.path}: FFN weights for layer {layer} unavailable ({e})") from None


def final_norm(vx: Vindex) -> np.ndarray:
    return vx.tensor_f32("norm.weight")


def lm_head_matrix(vx: Vindex) -> np.ndarray | QBlocks:
    """The lm_head ``[vocab, hidden]`` as stored (a memory map, or Q4_K blocks of a q4k vindex):
    its own file, or the embeddings when the model is tied."""
    if not vx.tied and vx.has_weight("lm_head.weight"):
        return vx.weight("lm_head.weight")
    return vx.embeddings()


def default_backend() -> Backend:
    return get_backend()
