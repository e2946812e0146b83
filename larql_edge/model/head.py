"""The logits head, written once: final norm -> lm_head -> final softcap, and top-k with one tie rule.

`LocalHead` is what every tier that holds the lm_head runs (the single-sequence forward, the batch
engine's `LocalTopK`, the embed server's `LogitsHead`). The lm_head's form (Q8_0, f16, f32; mapped
from the vindex or a shared converted copy) is chosen by `larql_edge.model.lm_head`.

Top-k never sorts the vocabulary: the top k of a row are found among the k blocks of 512 with the
largest maxima (the top k values all lie in those blocks). Ties: the lower id first, as ``argmax``.
"""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np

from larql_edge.config import cache_dir
from larql_edge.format.vindex import Vindex
from larql_edge.model import ops
from larql_edge.model.backend import Backend, get_backend
from larql_edge.model.lm_head import compute_copy, head_format
from larql_edge.model.spec import ModelSpec
from larql_edge.model.weights import final_norm

_BLOCK = 512


class LocalHead:
    """``softcap(lm_head @ final_norm(h))`` for pre-final-norm rows ``h``."""

    def __init__(self, vx: Vindex, spec: ModelSpec, backend: Backend | None = None, cache: Path | None | bool = True,
                 lm_head_format: str = "auto"):
        """``cache``: the folder of converted lm_head copies (True: this process's cache folder; None:
        a converted copy stays in memory)."""
        self.backend = backend or get_backend()
        self.spec = spec
        self.norm = final_norm(vx)
        if self.norm.shape != (spec.hidden_size,):
            raise ValueError(f"final norm has shape {self.norm.shape}, expected ({spec.hidden_size},)")
        folder = cache_dir() / "lm-head" if cache is True else (cache or None)
        self.copy = compute_copy(vx, folder, head_format(vx, lm_head_format, self.backend))
        self.weight = self.backend.prepare(self.copy.matrix)
        self.vocab, self.hidden = self.copy.shape
        self.tied = vx.tied

    def warm_up(self) -> None:
        """Fault the whole matrix into memory and load the kernels, so the first request is not slow."""
        self.logits(np.zeros((1, self.hidden), dtype=np.float32))

    def logits(self, h: np.ndarray) -> np.ndarray:
        s = self.spec
        x = ops.rms_norm(np.atleast_2d(h), self.norm, s.rms_norm_eps, s.family.norm_offset)
        y = np.asarray(self.backend.linear(x, self.weight), dtype=np.float32)
        cap = s.final_logit_softcapping
        if cap is None:
            return y
        if not y.flags.writeable or not y.flags.c_contiguous:
            return ops.softcap(y, cap)
        # ops.softcap's arithmetic (tanh(y / cap) * cap, float32), in place on the fresh product and row by
        # row (a 1 MB row stays in cache): its three [rows, vocab] temporaries cost more than its tanh
        # (16 rows: 7.7 ms -> ~1.5 ms)
        c = np.float32(cap)
        for row in y:
            np.divide(row, c, out=row)
            np.tanh(row, out=row)
            np.multiply(row, c, out=row)
        return y


class Top(tuple):
    """One row's candidates: unpacks as ``(ids, lps)`` (log-probabilities at temperature 1, most likely
    first; ties: the lower id first), and says what the list leaves out:

    - ``lse``: the row's log normaliser, so a candidate's logit is ``lp + lse`` (nan: unknown);
    - ``floor``: every token not listed has ``lp <= floor`` (the k-th candidate's; ``-inf``: every
      token the row allows is listed). Ids asked for beyond the top k follow it, at or below ``floor``.
    """

    lse: float
    floor: float

    def __new__(cls, ids: np.ndarray, lps: np.ndarray, lse: float = float("nan"), floor: float = float("-inf")):
        self = super().__new__(cls, (ids, lps))
        self.lse, self.floor = float(lse), float(floor)
        return self

    @property
    def ids(self) -> np.ndarray:
        return self[0]

    @property
    def lps(self) -> np.ndarray:
        return self[1]


def candidates(row: np.ndarray, k: int, extra: np.ndarray | None = None) -> Top:
    """The top ``k`` of a logits row (``-inf``: a disallowed token, never listed), then the ``extra``
    ids not among them, as a `Top`."""
    ids = top_k_ids(row, k)
    ids = ids[np.isfinite(row[ids])]
    lse = log_normaliser(row)
    floor = float(row[ids[-1]]) - lse if ids.size == k and k < row.size else float("-inf")
    if extra is not None and len(extra):
        more = np.setdiff1d(np.asarray(extra, dtype=np.int64), ids)
        more = more[np.isfinite(row[more])]
        more = more[np.lexsort((more, -row[more]))]
        ids = np.concatenate([ids, more])
    ids = ids.astype(np.int64)
    return Top(ids, row[ids].astype(np.float64) - lse, lse, floor)


def top_k_ids(row: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest values of ``row``, largest first (ties: lower id first)."""
    n = row.size
    k = min(k, n)
    if k * _BLOCK * 4 < n:
        nblocks = n // _BLOCK
        bmax = row[: nblocks * _BLOCK].reshape(nblocks, _BLOCK).max(axis=1)
        # every block whose maximum reaches the k-th largest maximum (ties included: the tie rule
        # must see every tied value)
        best = np.nonzero(bmax >= np.partition(bmax, nblocks - k)[nblocks - k])[0]
        cand = (best[:, None] * _BLOCK + np.arange(_BLOCK)).ravel()
        if nblocks * _BLOCK < n:  # the ragged tail is always a candidate
            cand = np.concatenate([cand, np.arange(nblocks * _BLOCK, n)])
    else:
        cand = np.arange(n)
    vals = row[cand]
    if k < cand.size:
        # a value tied with the k-th may sit outside argpartition's pick: keep every candidate >= it
        kth = np.partition(vals, vals.size - k)[vals.size - k]
        keep = vals >= kth
        cand, vals = cand[keep], vals[keep]
    order = np.lexsort((cand, -vals))[:k]
    return cand[order]


_scratch = threading.local()


def log_normaliser(row: np.ndarray) -> float:
    """log(sum(exp(row))), computed stably (float32 exponentials, float64 sum), in a reused per-thread
    buffer (a vocabulary row's temporaries cost as much as its exponentials)."""
    m = float(row.max())
    if row.dtype != np.float32 or row.ndim != 1:
        return m + float(np.log(np.sum(np.exp(row - np.float32(m)), dtype=np.float64)))
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.size < row.size:
        buf = _scratch.buf = np.empty(row.size, np.float32)
    t = buf[: row.size]
    np.subtract(row, np.float32(m), out=t)
    np.exp(t, out=t)
    return m + float(np.log(np.sum(t, dtype=np.float64)))


def top_k_logprobs(row: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The top ``k`` ids of a logits row and their log-probabilities (temperature 1), most likely first."""
    ids = top_k_ids(row, k)
    return ids.astype(np.int64), row[ids].astype(np.float64) - log_normaliser(row)
