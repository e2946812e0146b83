"""The forward pass, assembled from three providers so that every tier runs the same code.

- an `EmbedProvider` turns token ids into scaled input rows (local table, or the embed server),
- an `FfnProvider` computes ``down(act(gate x) * up x)`` for one layer on exactly the vector given
  (local weights, or an FFN shard / the router),
- a `HeadProvider` turns the pre-final-norm residual into logits (local, or the embed server).

Attention always runs here, with a KV cache. Norms around the FFN are applied here too, which is
what lets the FFN tier be a pure function of its input (DESIGN.md §1).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from larql_edge.config import graph_mode
from larql_edge.errors import VindexError
from larql_edge.format.vindex import Vindex
from larql_edge.model import ops
from larql_edge.model.backend import Backend, get_backend
from larql_edge.model.graph import GraphCache
from larql_edge.model.head import LocalHead, top_k_logprobs
from larql_edge.model.spec import ModelSpec
from larql_edge.model.weights import AttentionLayer, FfnLayer, load_attention_layer, load_ffn_layer

__all__ = ["EmbedProvider", "FfnProvider", "HeadProvider", "KVCache", "LocalEmbed", "LocalFfn", "LocalHead",
           "Transformer", "ffn_compute", "load_attention", "project_qkv", "sample", "top_k"]


class EmbedProvider(Protocol):
    def embed(self, ids: Sequence[int]) -> np.ndarray: ...


class FfnProvider(Protocol):
    def ffn(self, layer: int, x: np.ndarray) -> np.ndarray: ...


class HeadProvider(Protocol):
    def logits(self, h: np.ndarray) -> np.ndarray: ...


# -- local providers ----------------------------------------------------------------------------


class LocalEmbed:
    def __init__(self, vx: Vindex, spec: ModelSpec):
        self.table = vx.embeddings()  # f16/f32 memory map; rows are decoded per lookup
        self.scale = np.float32(spec.embed_scale)

    def embed(self, ids: Sequence[int]) -> np.ndarray:
        idx = np.asarray(ids, dtype=np.int64)
        if idx.size and (idx.min() < 0 or idx.max() >= self.table.shape[0]):
            raise ValueError(f"token id out of range [0, {self.table.shape[0]})")
        return self.table[idx].astype(np.float32) * self.scale


def activation(spec: ModelSpec, backend: Backend, weights: Sequence = ()):
    """The FFN's activation: the exact float32 form on the reference backends and on float32 weights;
    on compact (quantized, f16) weights Gemma's GELU is ggml's (llama.cpp's), so that an FFN shard,
    the local product-by-product path and the one-graph step compute the same thing."""
    compact = getattr(backend, "name", None) == "compact" and any(getattr(w, "fmt", "f32") != "f32" for w in weights)
    if spec.family.activation == "gelu_tanh" and compact:
        from larql_edge.model.kernels._ggml import gelu

        return gelu
    return ops.ACTIVATIONS[spec.family.activation]


def ffn_compute(w: FfnLayer, x: np.ndarray, act, backend: Backend) -> np.ndarray:
    """``down(act(gate x) * up x)``: the whole of what an FFN shard computes for one layer."""
    return backend.linear(act(backend.linear(x, w.gate)) * backend.linear(x, w.up), w.down)


class LocalFfn:
    def __init__(self, vx: Vindex, spec: ModelSpec, layers: Sequence[int] | None = None, backend: Backend | None = None):
        self.backend = backend or get_backend()
        wanted = range(spec.num_layers) if layers is None else layers
        self.layers = {i: load_ffn_layer(vx, i, self.backend) for i in wanted}
        self.act = activation(spec, self.backend, [m for w in self.layers.values() for m in (w.gate, w.up, w.down)])
        self.fused = _fused_ffn(spec, self.act, self.layers.values())

    def ffn(self, layer: int, x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """The layer's FFN of ``x``; ``out`` (float32, C-contiguous, x's rows by hidden) receives it
        when given (an FFN shard's reply buffer)."""
        w = self.layers.get(layer)
        if w is None:
            raise KeyError(layer)
        if self.fused is not None and x.ndim == 2 and self.fused.takes(x.shape[0]):
            return self.fused.run(w.gate, w.up, w.down, x, out)
        y = ffn_compute(w, x, self.act, self.backend)
        if out is None:
            return y
        out[...] = y
        return out


def _fused_ffn(spec: ModelSpec, act, layers):
    """One ggml graph per FFN layer (`larql_edge.model.ffn_graph`) where it computes exactly what the
    product-by-product path does: ggml block weights and ggml's own activation (Gemma's GELU table).
    SiLU stays product by product: ggml's vectorized SiLU rounds differently from numpy's."""
    if spec.family.activation != "gelu_tanh":
        return None
    from larql_edge.model import ffn_graph
    from larql_edge.model.kernels import _ggml

    if act is not _ggml.gelu:
        return None

    if not layers or not all(ffn_graph.fusable(w.gate, w.up, w.down) for w in layers):
        return None
    return ffn_graph.FfnGraphs(spec.family.activation)


# -- the forward pass -----------------------------------------------------------------------------


@dataclass
class KVCache:
    keys: list[np.ndarray | None]
    values: list[np.ndarray | None]
    length: int = 0
    slack: int = 0  # keys kept beyond a sliding window, so that `truncate` can go back that far

    @classmethod
    def empty(cls, num_layers: int, slack: int = 0) -> "KVCache":
        return cls([None] * num_layers, [None] * num_layers, slack=slack)

    def truncate(self, length: int, windows: Sequence[int | None] | None = None) -> None:
        """Forget the positions from ``length`` on (speculative decoding's rollback past a rejected
        draft). ``windows``: each layer's sliding window (None: full attention), to check that the
        keys left still cover what the next position attends to."""
        drop = self.length - length
        if drop < 0:
            raise ValueError(f"cannot truncate a cache of {self.length} positions to {length}")
        if drop == 0:
            return
        for i, k in enumerate(self.keys):
            if k is None:
                continue
            left = k.shape[1] - drop
            window = windows[i] if windows is not None else None
            need = length if window is None else min(length, window - 1)
            if left < need:
                raise ValueError(f"layer {i}: {left} keys would be left, {need} are needed: the cache was trimmed "
                                 "to its sliding window (give it more slack)")
            self.keys[i] = k[:, :left]
            self.values[i] = self.values[i][:, :left]  # type: ignore[index]
        self.length = length


@dataclass
class Transformer:
    spec: ModelSpec
    attn: list[AttentionLayer]
    embedder: EmbedProvider
    ffn_provider: FfnProvider
    head: HeadProvider
    backend: Backend = field(default_factory=get_backend)
    local_s: float = field(default=0.0, repr=False, compare=False)  # seconds computed here (attention, norms, sampling), so far
    # one ggml graph per step (`larql_edge.model.graph`): None = LARQL_GRAPH (auto: on compact weights)
    graph: bool | None = field(default=None, repr=False, compare=False)
    _engine: object = field(default=None, init=False, repr=False, compare=False)

    @classmethod
    def local(cls, vindex: str | Vindex, backend: Backend | None = None, graph: bool | None = None) -> "Transformer":
        """The whole model in this process, from a vindex with attention and FFN weights."""
        vx = vindex if isinstance(vindex, Vindex) else Vindex.open(vindex)
        spec = ModelSpec.from_index(vx.index)
        be = backend or get_backend()
        return cls(
            spec=spec,
            attn=load_attention(vx, spec, be),
            embedder=LocalEmbed(vx, spec),
            ffn_provider=LocalFfn(vx, spec, backend=be),
            head=LocalHead(vx, spec, be),
            backend=be,
            graph=graph,
        )

    def engine(self):
        """The graph engine when this model's steps run as one ggml graph each, else None."""
        if self._engine is None:
            self._engine = _build_engine(self) or False
        return self._engine or None

    def new_cache(self, slack: int = 0) -> KVCache:
        eng = self.engine()
        if eng is not None:
            return eng.new_cache(slack)
        return KVCache.empty(self.spec.num_layers, slack)

    def windows(self) -> list[int | None]:
        """Each layer's sliding window (None: full attention), for `KVCache.truncate`."""
        s = self.spec
        return [s.sliding_window if s.is_sliding(i) else None for i in range(s.num_layers)]

    def _attention(self, layer: int, x: np.ndarray, cache: KVCache, start: int, rope: dict) -> np.ndarray:
        s, w, be = self.spec, self.attn[layer], self.backend
        seq = x.shape[0]
        pos = np.arange(start, start + seq)
        base = s.rope_base_for(layer)
        if base not in rope:  # two bases at most (sliding and full layers): computed once per forward
            rope[base] = ops.rope_tables(pos, s.head_dim, base)
        q, k, v = project_qkv(s, w, be, x, rope[base])
        if cache.keys[layer] is not None:
            k = np.concatenate([cache.keys[layer], k], axis=1)
            v = np.concatenate([cache.values[layer], v], axis=1)
        window = s.sliding_window if s.is_sliding(layer) else None
        if window is not None and k.shape[1] > window + seq - 1 + cache.slack:
            # Keys older than the window are never attended again by this or any later query
            # (unless the cache is rolled back: `slack` keeps that many more).
            keep = window + seq - 1 + cache.slack
            k, v = k[:, -keep:], v[:, -keep:]
        cache.keys[layer], cache.values[layer] = k, v
        # The cache always ends at the newest position, so key positions count back from it.
        k_pos = np.arange(start + seq - k.shape[1], start + seq)
        out = ops.attention(q, k, v, pos, k_pos, s.attn_scale, window, s.attn_logit_softcapping)
        return be.linear(out, w.o)

    def forward(self, ids: Sequence[int], cache: KVCache | None = None, alone: bool = False) -> np.ndarray:
        """Run ``ids`` through every layer; returns the residual before the final norm ``[seq, hidden]``.
        ``alone``: each row's floats are those of a pass of its own (speculation's verify rows; see
        `GraphEngine.step`); the product-by-product path always gives them."""
        cache = cache if cache is not None else self.new_cache()
        if isinstance(cache, GraphCache):
            return self._graph_step(ids, cache, head=False, alone=alone)
        s = self.spec
        eps, off = s.rms_norm_eps, s.family.norm_offset
        h = np.asarray(self.embedder.embed(ids), dtype=np.float32)
        start = cache.length
        rope: dict = {}
        for layer in range(s.num_layers):
            w = self.attn[layer]
            t = time.perf_counter()
            a = self._attention(layer, ops.rms_norm(h, w.pre_attn_norm, eps, off), cache, start, rope)
            if w.post_attn_norm is not None:
                a = ops.rms_norm(a, w.post_attn_norm, eps, off)
            h = h + a
            x = ops.rms_norm(h, w.pre_ffn_norm, eps, off)
            self.local_s += time.perf_counter() - t  # attention and norms here: --timings' "local"
            f = self.ffn_provider.ffn(layer, x)
            t = time.perf_counter()
            if w.post_ffn_norm is not None:
                f = ops.rms_norm(f, w.post_ffn_norm, eps, off)
            h = h + f
            self.local_s += time.perf_counter() - t
        cache.length = start + len(ids)
        return h

    def _graph_step(self, ids: Sequence[int], cache: GraphCache, head: bool, alone: bool = False) -> np.ndarray:
        eng = self.engine()
        h = eng.embed(ids)
        if h is None:
            h = np.asarray(self.embedder.embed(ids), dtype=np.float32)
        if eng.has_ffn:
            t = time.perf_counter()
            out = eng.step(h, cache, head, alone)
            self.local_s += time.perf_counter() - t  # the whole step ran here
            return out
        # the FFN is remote: each layer's attention half is a graph, the FFN a call between them
        s = self.spec
        eps, off = s.rms_norm_eps, s.family.norm_offset
        st = eng.begin(len(ids), cache)
        for layer in range(s.num_layers):
            t = time.perf_counter()
            h, x = eng.attention(layer, h, cache, st, alone)
            self.local_s += time.perf_counter() - t
            f = self.ffn_provider.ffn(layer, x)
            t = time.perf_counter()
            w = self.attn[layer]
            if w.post_ffn_norm is not None:
                f = ops.rms_norm(f, w.post_ffn_norm, eps, off)
            h = h + f
            self.local_s += time.perf_counter() - t
        cache.length = st.end
        return h

    def next_logits(self, ids: Sequence[int], cache: KVCache | None = None) -> np.ndarray:
        """Logits ``[vocab]`` for the token after ``ids`` (appended to ``cache`` when given)."""
        eng = self.engine()
        if eng is not None and eng.lm_head is not None and eng.has_ffn:
            cache = cache if cache is not None else self.new_cache()
            if isinstance(cache, GraphCache):
                return self._graph_step(ids, cache, head=True)
        h = self.forward(ids, cache)
        return np.asarray(self.head.logits(h[-1:]), dtype=np.float32)[0]

    def generate(
        self,
        ids: Sequence[int],
        max_tokens: int,
        temperature: float = 0.0,
        seed: int | None = None,
        stop_ids: Sequence[int] | None = None,
    ) -> Iterator[int]:
        """Yield generated token ids one by one, with the KV cache; greedy when temperature is 0."""
        if not ids:
            raise ValueError("empty prompt: nothing to condition on")
        rng = np.random.default_rng(seed)
        stop = set(self.spec.eos_token_ids if stop_ids is None else stop_ids)
        cache = self.new_cache()
        logits = self.next_logits(ids, cache)
        for _ in range(max_tokens):
            t = time.perf_counter()
            tok = sample(logits, temperature, rng)
            self.local_s += time.perf_counter() - t  # sampling is this machine's work too
            yield tok
            if tok in stop:
                return
            logits = self.next_logits([tok], cache)


# The one-graph step decodes token rows from the tied quantized table when the stored f16 embeddings
# are exactly its image (llama.cpp's values; an embed server serves the f16 image).
EXACT_TOKEN_ROWS = True


def _build_engine(m: Transformer):
    """A `GraphEngine` over the model's own weights when every product can run in a graph (compact
    backend, weights in ggml's types): the whole step when the FFN is local (the head joins when it is
    local too), else each layer's attention half."""
    mode = {True: "on", False: "off"}.get(m.graph) if m.graph is not None else graph_mode()
    if mode == "off" or getattr(m.backend, "name", None) != "compact":
        return None
    from larql_edge.model.graph import GraphEngine, graphable

    s = m.spec
    ffn: list[Any] | None = None  # a remote FFN (the grid's client): one attention-only graph per layer
    if isinstance(m.ffn_provider, LocalFfn):
        ffn = [m.ffn_provider.layers.get(i) for i in range(s.num_layers)]
        if any(f is None for f in ffn):
            ffn = None
    mats: list[Any] = [x for a in m.attn for x in (a.q, a.k, a.v, a.o)]
    mats += [x for f in ffn or [] for x in (f.gate, f.up, f.down)]
    if not all(graphable(x) for x in mats):
        return None
    if mode == "auto" and all(x.fmt == "f32" for x in mats):
        return None  # float32 weights: the exact BLAS path is the reference and no slower here
    head = m.head if isinstance(m.head, LocalHead) and graphable(m.head.weight) else None
    embed = None
    if (EXACT_TOKEN_ROWS and head is not None and head.tied and getattr(head.weight, "fmt", "f32") not in ("f16", "f32")
            and isinstance(m.embedder, LocalEmbed)):
        # The GGUF's own token table (e.g. Q8_0) when the stored f16 embeddings are exactly its image:
        # llama.cpp decodes token rows from it in float32, which f16 would round.
        probe = np.linspace(0, head.vocab - 1, 64).astype(np.int64)
        if np.array_equal(head.weight.rows(probe).astype(np.float16), np.asarray(m.embedder.table[probe], np.float16)):
            embed = head.weight
    hw: Any = head.weight if head else None
    return GraphEngine(s, m.attn, ffn, hw, head.norm if head else None,
                       kv_dtype=np.float32 if mode == "on" and all(x.fmt == "f32" for x in mats) else np.float16,
                       embed_matrix=embed)


def project_qkv(s: ModelSpec, w: AttentionLayer, be: Backend, x: np.ndarray,
                rope: tuple[np.ndarray, np.ndarray]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """q, k, v ``[heads, rows, head_dim]`` of rows ``x``: projections, q/k norms, RoPE at ``rope``'s
    (cos, sin) positions. Row-wise arithmetic: a row gets the same values alone or among others."""
    n = x.shape[0]
    q = be.linear(x, w.q).reshape(n, s.num_q_heads, s.head_dim).transpose(1, 0, 2)
    k = be.linear(x, w.k).reshape(n, s.num_kv_heads, s.head_dim).transpose(1, 0, 2)
    v = be.linear(x, w.v).reshape(n, s.num_kv_heads, s.head_dim).transpose(1, 0, 2)
    if w.q_norm is not None and w.k_norm is not None:
        q = ops.rms_norm(q, w.q_norm, s.rms_norm_eps, s.family.norm_offset)
        k = ops.rms_norm(k, w.k_norm, s.rms_norm_eps, s.family.norm_offset)
    cos, sin = rope
    return ops.apply_rope(q, cos, sin), ops.apply_rope(k, cos, sin), v


def load_attention(vx: Vindex, spec: ModelSpec, backend: Backend) -> list[AttentionLayer]:
    if not vx.manifest:
        raise VindexError(f"{vx.path}: no weight_manifest.json: this vindex has no attention weights")
    return [load_attention_layer(vx, spec, i, backend) for i in range(spec.num_layers)]


def sample(logits: np.ndarray, temperature: float, rng: np.random.Generator) -> int:
    if temperature <= 0:
        return int(np.argmax(logits))
    lp = ops.log_softmax(logits / temperature)
    p = np.exp(lp)
    return int(rng.choice(p.size, p=p / p.sum()))


def top_k(logits: np.ndarray, k: int) -> list[tuple[int, float]]:
    """The k most likely ids with their log-probabilities, most likely first (ties: lower id first)."""
    ids, lps = top_k_logprobs(np.asarray(logits, dtype=np.float32), k)
    return [(int(i), float(lp)) for i, lp in zip(ids, lps, strict=True)]
