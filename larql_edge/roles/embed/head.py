"""The logits head of the embed server: final norm, lm_head, final softcap, then top-k or raw logits.

The lm_head's form (Q8_0, f16, f32; mapped from the vindex or a shared converted copy) is chosen by
`larql_edge.model.lm_head` (``--lm-head-format``).

Post-processing never sorts the vocabulary: the top k of a row are found among the k blocks with the
largest maxima (a row split into blocks of 512; the top k values all lie in those blocks).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from larql_edge.format.vindex import Vindex
from larql_edge.model import ops
from larql_edge.model.backend import Backend, get_backend
from larql_edge.model.lm_head import compute_copy, head_format
from larql_edge.model.spec import ModelSpec
from larql_edge.model.weights import final_norm

_BLOCK = 512


class LogitsHead:
    """``softcap(lm_head @ final_norm(x))`` for a batch of pre-final-norm residuals."""

    def __init__(self, vx: Vindex, spec: ModelSpec, cache_dir: Path | None, backend: Backend | None = None,
                 lm_head_format: str = "auto"):
        self.backend = backend or get_backend()
        self.spec = spec
        self.norm = final_norm(vx)
        if self.norm.shape != (spec.hidden_size,):
            raise ValueError(f"final norm has shape {self.norm.shape}, expected ({spec.hidden_size},)")
        self.copy = compute_copy(vx, cache_dir, head_format(vx, lm_head_format, self.backend))
        self.weight = self.backend.prepare(self.copy.matrix)
        self.vocab, self.hidden = self.copy.shape
        self.tied = vx.tied

    def warm_up(self) -> None:
        """Fault the whole matrix into memory and let the kernels compile, so the first request is not slow."""
        self.logits(np.zeros((1, self.hidden), dtype=np.float32))

    def logits(self, x: np.ndarray) -> np.ndarray:
        s = self.spec
        h = ops.rms_norm(np.atleast_2d(x), self.norm, s.rms_norm_eps, s.family.norm_offset)
        y = np.asarray(self.backend.linear(h, self.weight), dtype=np.float32)
        return ops.softcap(y, s.final_logit_softcapping)


# -- post-processing of one row ------------------------------------------------------------------------


def top_k_ids(row: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest values of ``row``, largest first (ties: lower id first)."""
    n = row.size
    k = min(k, n)
    if k * _BLOCK * 4 < n:
        nblocks = n // _BLOCK
        head = row[: nblocks * _BLOCK].reshape(nblocks, _BLOCK)
        best = np.argpartition(-head.max(axis=1), k - 1)[:k]
        cand = (best[:, None] * _BLOCK + np.arange(_BLOCK)).ravel()
        if nblocks * _BLOCK < n:  # the ragged tail is always a candidate
            cand = np.concatenate([cand, np.arange(nblocks * _BLOCK, n)])
    else:
        cand = np.arange(n)
    vals = row[cand]
    if k < cand.size:
        part = np.argpartition(-vals, k - 1)[:k]
        cand, vals = cand[part], vals[part]
    order = np.lexsort((cand, -vals))
    return cand[order]


def log_normaliser(row: np.ndarray) -> float:
    """log(sum(exp(row))), computed stably (float32 exponentials, float64 sum)."""
    m = float(row.max())
    return m + float(np.log(np.sum(np.exp(row - np.float32(m)), dtype=np.float64)))
