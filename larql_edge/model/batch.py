"""The batched forward pass: every active sequence through each layer together (larql-serve's engine).

`Transformer.forward` runs one sequence; `BatchEngine.step` runs a list of *chunks* (a few new tokens
of several sequences: one token each for sequences that decode, a slice of the prompt for one that
prefills) as one stack of rows:

- embeddings: one request for every row of the step;
- per layer: the norms and the q/k/v/o projections as one matrix product over all rows; attention per
  sequence, each on its own preallocated KV cache (`SeqCache`: ``[kv_heads, context, head_dim]`` per
  layer, written in place, never re-concatenated); the FFN as ONE provider call on all rows (one
  request per layer to the grid, whatever the number of sequences);
- the head: one call for the last row of every chunk that asks for its next token.

Each row meets exactly the arithmetic `Transformer.forward` gives it (same ops, same keys: the
sliding-window slice is the same), so greedy decoding is the same tokens batched or alone.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from larql_edge.model import ops
from larql_edge.model.backend import Backend
from larql_edge.model.forward import EmbedProvider, FfnProvider, project_qkv
from larql_edge.model.head import Top, candidates
from larql_edge.model.kernels import map_rows
from larql_edge.model.spec import ModelSpec
from larql_edge.model.weights import AttentionLayer
from larql_edge.wire.embed import allowed_tokens


class TopKHead(Protocol):
    """Pre-final-norm rows ``[n, hidden]`` -> per row a `Top`: the top ``k`` ids and their
    log-probabilities (temperature 1), most likely first (ties: the lower id first, as ``argmax``).
    ``masks``: per row None or a token bitmask (`larql_edge.wire.embed.mask_words` 32-bit words;
    structured output): the row's top k are then among its allowed tokens only, renormalised over
    them, and may be fewer than k. ``extra``: per row None or token ids whose log-probabilities the
    row needs whatever their rank (a logit_bias may raise them): listed after the top k.
    ``logits``: the whole rows (``[n, vocab]``), for what the candidates cannot decide."""

    def top_k_rows(self, h: np.ndarray, k: int, masks: Sequence[np.ndarray | None] | None = None,
                   extra: Sequence[np.ndarray | None] | None = None) -> list[Top]: ...

    def logits(self, h: np.ndarray) -> np.ndarray: ...


class LocalTopK:
    """A `TopKHead` from any `HeadProvider` (full logits; used in-process and by tests)."""

    def __init__(self, head):
        self.head = head

    def logits(self, h: np.ndarray) -> np.ndarray:
        return np.asarray(self.head.logits(h), dtype=np.float32)

    def top_k_rows(self, h: np.ndarray, k: int, masks: Sequence[np.ndarray | None] | None = None,
                   extra: Sequence[np.ndarray | None] | None = None) -> list[Top]:
        def top(i: int, row: np.ndarray) -> Top:
            mask = masks[i] if masks is not None else None
            if mask is not None:
                row = np.where(allowed_tokens(mask, row.size), row, np.float32(-np.inf))
            return candidates(row, k, extra[i] if extra is not None else None)

        return map_rows(top, self.logits(h))


def kv_bytes_per_token(spec: ModelSpec) -> int:
    """float32 keys and values of one position in every layer."""
    return 2 * 4 * spec.num_layers * spec.num_kv_heads * spec.head_dim


class SeqCache:
    """One sequence's KV cache, preallocated up to ``context`` positions. ``np.empty`` only reserves
    address space: pages become resident as positions are written, so the bound is what admission
    counts (``context x kv_bytes_per_token`` per sequence), the use is what the sequence has seen."""

    def __init__(self, spec: ModelSpec, context: int):
        shape = (spec.num_kv_heads, context, spec.head_dim)
        self.keys = [np.empty(shape, dtype=np.float32) for _ in range(spec.num_layers)]
        self.values = [np.empty(shape, dtype=np.float32) for _ in range(spec.num_layers)]
        self.context = context
        self.length = 0

    def truncate(self, length: int) -> None:
        """Forget the positions from ``length`` on (speculative decoding's rollback): they are
        overwritten in place by the next ones."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of {self.length} positions to {length}")
        self.length = length


@dataclass
class Chunk:
    cache: SeqCache
    ids: Sequence[int]
    wants_logits: bool = True  # False for a prefill chunk that is not the prompt's last
    logit_rows: int = 1  # with wants_logits: how many of the last rows want their top k (drafts verified)
    mask: np.ndarray | None = None  # the allowed next tokens (a token bitmask), for structured output
    extra: np.ndarray | None = None  # token ids the last row's candidates must include (see TopKHead)


class BatchEngine:
    def __init__(self, spec: ModelSpec, attn: list[AttentionLayer], embedder: EmbedProvider, ffn: FfnProvider,
                 head: TopKHead, backend: Backend):
        self.spec, self.attn, self.embedder, self.ffn, self.head, self.backend = spec, attn, embedder, ffn, head, backend
        self.local_s = 0.0  # seconds computed here (attention, norms), so far
        self.step_local: deque[float] = deque(maxlen=4096)  # ... in each recent step (metrics drain it)
        self._last: tuple = ((), np.empty((0, spec.hidden_size), np.float32))  # the last step's chunks and rows

    def new_cache(self, context: int) -> SeqCache:
        return SeqCache(self.spec, context)

    def _attention(self, layer: int, x: np.ndarray, chunks: Sequence[Chunk], spans: list[tuple[int, int]],
                   pos_all: np.ndarray, rope: dict) -> np.ndarray:
        s, w, be = self.spec, self.attn[layer], self.backend
        n = x.shape[0]
        base = s.rope_base_for(layer)
        if base not in rope:  # two bases at most (sliding and full layers): computed once per step
            rope[base] = ops.rope_tables(pos_all, s.head_dim, base)
        # The projections, the q/k norms and RoPE: each one operation over every row of the step.
        q_all, k_all, v_all = project_qkv(s, w, be, x, rope[base])
        window = s.sliding_window if s.is_sliding(layer) else None
        out = np.empty((n, s.num_q_heads * s.head_dim), dtype=np.float32)
        for c, (a, b) in zip(chunks, spans, strict=True):
            seq, start = b - a, c.cache.length
            end = start + seq
            # Written in place into the preallocated cache: no re-concatenation.
            c.cache.keys[layer][:, start:end] = k_all[:, a:b]
            c.cache.values[layer][:, start:end] = v_all[:, a:b]
            first = 0
            if window is not None and end > window + seq - 1:
                first = end - (window + seq - 1)  # the keys Transformer.forward keeps: the same arithmetic
            keys, values = c.cache.keys[layer][:, first:end], c.cache.values[layer][:, first:end]
            out[a:b] = ops.attention(q_all[:, a:b], keys, values, pos_all[a:b], np.arange(first, end), s.attn_scale,
                                     window, s.attn_logit_softcapping)
        return be.linear(out, w.o)

    def forward(self, chunks: Sequence[Chunk]) -> np.ndarray:
        """Every chunk's rows through every layer; returns the pre-final-norm residual rows ``[n, hidden]``."""
        s = self.spec
        eps, off = s.rms_norm_eps, s.family.norm_offset
        for c in chunks:
            if c.cache.length + len(c.ids) > c.cache.context:
                raise ValueError(f"{c.cache.length} + {len(c.ids)} positions exceed the cache's {c.cache.context}")
        ids = [int(t) for c in chunks for t in c.ids]
        spans, at = [], 0
        for c in chunks:
            spans.append((at, at + len(c.ids)))
            at += len(c.ids)
        pos_all = np.concatenate([np.arange(c.cache.length, c.cache.length + len(c.ids)) for c in chunks])
        rope: dict = {}
        h = np.asarray(self.embedder.embed(ids), dtype=np.float32)  # one request for every row
        for layer in range(s.num_layers):
            w = self.attn[layer]
            t = time.perf_counter()
            a = self._attention(layer, ops.rms_norm(h, w.pre_attn_norm, eps, off), chunks, spans, pos_all, rope)
            if w.post_attn_norm is not None:
                a = ops.rms_norm(a, w.post_attn_norm, eps, off)
            h = h + a
            x = ops.rms_norm(h, w.pre_ffn_norm, eps, off)
            self.local_s += time.perf_counter() - t  # attention and norms here (larql_serve_local_seconds)
            f = self.ffn.ffn(layer, x)  # ONE call for all rows
            if w.post_ffn_norm is not None:
                f = ops.rms_norm(f, w.post_ffn_norm, eps, off)
            h = h + f
        for c in chunks:
            c.cache.length += len(c.ids)
        return h

    def step(self, chunks: Sequence[Chunk], k: int) -> list[Top | None]:
        """One step: per chunk, the top ``k`` of its next token (None for a chunk not asking)."""
        return [rows[-1] if rows else None for rows in self.step_rows(chunks, k)]

    def step_rows(self, chunks: Sequence[Chunk], k: int) -> list[list[Top]]:
        """One step: per chunk, the top ``k`` after each of its last ``logit_rows`` rows (none for a
        chunk not asking), every chunk's rows in ONE head request. The rows stay until the next step,
        for `row_logits`."""
        if not chunks:
            return []
        local0 = self.local_s
        h = self.forward(chunks)
        self.step_local.append(self.local_s - local0)
        wanted: list[int] = []
        masks: list[np.ndarray | None] = []
        extra: list[np.ndarray | None] = []
        counts: list[int] = []
        at = 0
        for c in chunks:
            at += len(c.ids)
            n = min(max(1, c.logit_rows), len(c.ids)) if c.wants_logits else 0
            wanted.extend(range(at - n, at))
            masks.extend([None] * (n - 1) + [c.mask] if n else [])  # a mask applies to the last row
            extra.extend([None] * (n - 1) + [c.extra] if n else [])  # so do the extra ids
            counts.append(n)
        self._last = (chunks, h)
        opts: dict = {}
        if any(m is not None for m in masks):
            opts["masks"] = masks
        if any(e is not None and len(e) for e in extra):
            opts["extra"] = extra
        tops = iter(self.head.top_k_rows(h[wanted], k, **opts) if wanted else [])
        return [[next(tops) for _ in range(n)] for n in counts]

    def row_logits(self, chunk: int) -> np.ndarray:
        """The whole logits row (``f32[vocab]``) after the last row of chunk ``chunk`` of the last step,
        its mask applied (-inf): one more head request, for what that row's candidates cannot decide."""
        chunks, h = self._last
        ends = np.cumsum([len(c.ids) for c in chunks])
        row = np.array(self.head.logits(h[ends[chunk] - 1 : ends[chunk]])[0], dtype=np.float32)
        mask = chunks[chunk].mask
        if mask is not None:
            row[~allowed_tokens(mask, row.size)] = -np.inf
        return row
