"""The transformer's primitive operations, float32 numpy, shared by every tier.

Each function matches the Hugging Face reference implementation of the families we serve
(see tests/test_model_ops.py for the direct comparisons).
"""

from __future__ import annotations

import numpy as np

_SQRT_2_OVER_PI = np.float32(np.sqrt(2.0 / np.pi))


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float, offset: float) -> np.ndarray:
    """RMSNorm over the last axis; multiplies by ``offset + w`` (Gemma: 1 + w, Llama: w).

    Lean on purpose (it runs 4-6 times per layer per token): one sum of squares (einsum, no x*x
    temporary, no np.mean wrapper), the scale applied in place on the one output array."""
    x = x.astype(np.float32, copy=False)
    ss = np.einsum("...i,...i->...", x, x)[..., None]
    ss /= np.float32(x.shape[-1])
    ss += np.float32(eps)
    np.sqrt(ss, out=ss)
    out = x / ss
    out *= np.float32(offset) + w if offset else w
    return out


# BLAS multiplies a row in a different order of summation depending on how many rows come with it
# (OpenBLAS: gemv for one, then per microkernel tile): up to this many rows, a float32 product is
# one row at a time (`linear_rows`), so a row's result is what it is alone. ggml's kernels (f16 and
# quantized weights, the compact backend) are per row at any count; this is for float32 weights.
# 17: a verification pass of the most drafts `larql generate --spec-k` allows (16) and the decided token.
EXACT_LINEAR_ROWS = 17


def linear_rows(x: np.ndarray, w_t: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """``x @ w_t`` (``w_t``: a weight's transposed view ``[in, out]``), float32, each of up to
    `EXACT_LINEAR_ROWS` rows multiplied on its own (beyond: one product, a prefill's speed)."""
    if x.ndim != 2 or x.shape[0] > EXACT_LINEAR_ROWS:
        return np.matmul(x, w_t, out=out)
    if out is None:
        out = np.empty((x.shape[0], w_t.shape[1]), dtype=np.result_type(x, w_t))
    for i in range(x.shape[0]):
        np.matmul(x[i], w_t, out=out[i])
    return out


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    # 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), in place on one temporary
    t = x * x
    t *= np.float32(0.044715)
    t += np.float32(1.0)
    t *= x
    t *= _SQRT_2_OVER_PI
    np.tanh(t, out=t)
    t += np.float32(1.0)
    t *= x
    t *= np.float32(0.5)
    return t


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


ACTIVATIONS = {"gelu_tanh": gelu_tanh, "silu": silu}


def rope_tables(positions: np.ndarray, head_dim: int, base: float) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin tables ``[seq, head_dim]`` for the rotate-half (Hugging Face) RoPE layout."""
    inv_freq = 1.0 / (base ** (np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim)))
    freqs = positions.astype(np.float32)[:, None] * inv_freq[None, :].astype(np.float32)
    emb = np.concatenate([freqs, freqs], axis=-1)
    return np.cos(emb).astype(np.float32), np.sin(emb).astype(np.float32)


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """x: ``[heads, seq, head_dim]``."""
    half = x.shape[-1] // 2
    rot = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[None] + rot * sin[None]


def softcap(x: np.ndarray, cap: float | None) -> np.ndarray:
    if cap is None:
        return x
    return np.tanh(x / np.float32(cap)) * np.float32(cap)


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = np.max(x, axis=-1, keepdims=True)
    return x - m - np.log(np.sum(np.exp(x - m), axis=-1, keepdims=True))


# Up to this many query rows, attention computes each row on its own, on exactly the keys it attends
# (`_attention_row`): the same numpy calls on the same shapes whether the row travels alone (a decode
# step) or with others (speculative decoding's verification, serve's chunks). Batched, the reductions
# over keys (the softmax sum, p @ v) run over every key of the pass, the masked ones included, and BLAS
# and numpy's pairwise sum change their order of summation with the length: a row's floats then
# depended on how many rows came with it, and greedy speculation parted from plain decoding at near-ties.
EXACT_ROWS = 32


def attention(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    q_pos: np.ndarray,
    k_pos: np.ndarray,
    scale: float,
    window: int | None,
    logit_cap: float | None,
) -> np.ndarray:
    """Grouped-query causal attention.

    q: ``[n_q, seq_q, d]``; k, v: ``[n_kv, seq_k, d]``; positions are absolute token positions, and
    ``k_pos`` ascends by one (a cache). A sliding window keeps keys with ``q_pos - k_pos < window``.
    Returns ``[seq_q, n_q * d]``. Up to `EXACT_ROWS` rows, each row's result is independent of the
    other rows and of keys it does not attend (beyond that: a long prefill, batched for speed).
    """
    n_q, seq_q, d = q.shape
    if seq_q <= EXACT_ROWS:
        out = np.empty((seq_q, n_q * d), dtype=np.float32)
        for i in range(seq_q):
            out[i] = _attention_row(np.ascontiguousarray(q[:, i]), k, v, int(q_pos[i]), int(k_pos[0]), scale, window,
                                    logit_cap)
        return out
    n_kv = k.shape[0]
    group = n_q // n_kv
    qg = q.reshape(n_kv, group * seq_q, d)
    scores = np.matmul(qg, k.transpose(0, 2, 1)) * np.float32(scale)  # [n_kv, group*seq_q, seq_k]
    scores = scores.reshape(n_kv, group, seq_q, -1)
    scores = softcap(scores, logit_cap)
    delta = q_pos[:, None] - k_pos[None, :]
    allowed = delta >= 0
    if window is not None:
        allowed &= delta < window
    scores = np.where(allowed[None, None], scores, np.float32(-np.inf))
    scores = scores - np.max(scores, axis=-1, keepdims=True)
    p = np.exp(scores)
    p /= np.sum(p, axis=-1, keepdims=True)
    out = np.matmul(p.reshape(n_kv, group * seq_q, -1), v)  # [n_kv, group*seq_q, d]
    out = out.reshape(n_q, seq_q, d)
    return out.transpose(1, 0, 2).reshape(seq_q, n_q * d)


def _attention_row(q: np.ndarray, k: np.ndarray, v: np.ndarray, pos: int, first: int, scale: float,
                   window: int | None, logit_cap: float | None) -> np.ndarray:
    """One query row ``q [n_q, d]`` at ``pos`` over the keys it attends: positions ``(pos - window, pos]``
    of ``k, v`` (whose first key is at position ``first``). Returns ``[n_q * d]``."""
    n_q, d = q.shape
    n_kv = k.shape[0]
    hi = pos - first + 1
    lo = 0 if window is None else max(0, pos - window + 1 - first)
    kk, vv = k[:, lo:hi], v[:, lo:hi]  # views: the same keys, wherever the cache starts
    scores = np.matmul(q.reshape(n_kv, n_q // n_kv, d), kk.transpose(0, 2, 1)) * np.float32(scale)
    scores = softcap(scores, logit_cap)
    scores -= np.max(scores, axis=-1, keepdims=True)
    p = np.exp(scores)
    p /= np.sum(p, axis=-1, keepdims=True)
    return np.matmul(p, vv).reshape(n_q * d)
