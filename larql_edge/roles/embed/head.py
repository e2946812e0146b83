"""The logits head of the embed server: final norm, lm_head, final softcap, then top-k or raw logits.

The lm_head is a ``[vocab, hidden]`` matrix product per request, the one real computation of the
embed server. numpy's float16 product is ~30x slower than float32 BLAS (DESIGN.md §7), so the head
multiplies by a float32 **compute copy** (4 bytes x vocab x hidden: 671 MB for Gemma 3 270M):

- an f32 lm_head (f32 vindex, or an f32 ``lm_head.bin``) is used straight from its memory map: no copy;
- an f16 one is converted once into ``<lm-head-cache>/<sha256 of the source file>.f32`` and that file
  is memory-mapped. The page cache then holds one copy for every worker and every server process
  on the machine, and a restart maps the finished file instead of converting again;
- with no usable cache folder (``--lm-head-cache ''``, read-only disk, no recorded checksum), the
  copy is built in this process's memory.

Post-processing never sorts the vocabulary: the top k of a row are found among the k blocks with the
largest maxima (a row split into blocks of 512; the top k values all lie in those blocks).
"""

from __future__ import annotations

import fcntl
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from larql_edge.format.quant import QBlocks, dequantize_matrix
from larql_edge.format.vindex import EMBEDDINGS, LM_HEAD_KEY, Vindex
from larql_edge.model import ops
from larql_edge.model.backend import Backend, get_backend
from larql_edge.model.spec import ModelSpec
from larql_edge.model.weights import final_norm, lm_head_matrix

log = logging.getLogger("larql.embed")

_BLOCK = 512
_CONVERT_ROWS = 16384  # rows converted per step: bounds the temporary f32 memory to ~40 MB


@dataclass
class ComputeCopy:
    matrix: np.ndarray  # f32 [vocab, hidden]
    storage: str  # "mmap (f32 source)" | "mmap (shared f32 copy)" | "memory (f32 copy)"
    path: str | None
    nbytes: int


def _lm_head_key(vx: Vindex) -> tuple[str | None, str]:
    """The manifest key of the lm_head (None: the embedding table, when tied) and its file."""
    if vx.has_tensor(LM_HEAD_KEY):
        return LM_HEAD_KEY, vx.manifest[LM_HEAD_KEY].file
    return None, EMBEDDINGS


def _f32_blocks(vx: Vindex, key: str | None, rows: int):
    """The lm_head as f32 blocks read with ``pread`` (`Vindex.read_rows`): converting through the
    memory map would leave the whole f16 table resident in this process."""
    for i in range(0, rows, _CONVERT_ROWS):
        n = min(_CONVERT_ROWS, rows - i)
        yield i, vx.read_rows(key, i, n).astype(np.float32)


def compute_copy(vx: Vindex, cache_dir: Path | None) -> ComputeCopy:
    """The f32 lm_head the head multiplies by (see the module docstring for where it lives)."""
    src = lm_head_matrix(vx)
    if isinstance(src, QBlocks):  # a q4k vindex's untied lm_head: the reference path dequantizes it
        mat = dequantize_matrix(src)
        return ComputeCopy(mat, "memory (f32 from Q4_K)", None, mat.nbytes)
    rows, cols = src.shape
    nbytes = rows * cols * 4
    if src.dtype == np.float32:
        return ComputeCopy(src, "mmap (f32 source)", None, nbytes)
    key, file = _lm_head_key(vx)
    sha = vx.checksums.get(file)
    if cache_dir is not None and sha:
        try:
            out = _shared_copy(vx, key, rows, cols, Path(cache_dir), sha)
            m = np.memmap(out, dtype="<f4", mode="r", shape=(rows, cols))
            return ComputeCopy(m, "mmap (shared f32 copy)", str(out), nbytes)
        except OSError as e:
            log.warning("lm_head cache %s unusable (%s); keeping the f32 copy in memory", cache_dir, e)
    mat = np.empty((rows, cols), dtype=np.float32)
    for i, block in _f32_blocks(vx, key, rows):
        mat[i : i + len(block)] = block
    return ComputeCopy(mat, "memory (f32 copy)", None, nbytes)


def _shared_copy(vx: Vindex, key: str | None, rows: int, cols: int, folder: Path, sha: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{sha}-{rows}x{cols}.f32"
    want = rows * cols * 4
    if path.is_file() and path.stat().st_size == want:
        return path
    # Workers of one server (and other servers) may start together: one converts, the rest wait.
    with open(folder / f".{path.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if path.is_file() and path.stat().st_size == want:
            return path
        tmp = folder / f".{path.name}.{os.getpid()}.tmp"
        try:
            with open(tmp, "wb") as f:
                for _, block in _f32_blocks(vx, key, rows):
                    f.write(block.astype("<f4", copy=False).tobytes())
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
    return path


class LogitsHead:
    """``softcap(lm_head @ final_norm(x))`` for a batch of pre-final-norm residuals."""

    def __init__(self, vx: Vindex, spec: ModelSpec, cache_dir: Path | None, backend: Backend | None = None):
        self.backend = backend or get_backend()
        self.spec = spec
        self.norm = final_norm(vx)
        if self.norm.shape != (spec.hidden_size,):
            raise ValueError(f"final norm has shape {self.norm.shape}, expected ({spec.hidden_size},)")
        self.copy = compute_copy(vx, cache_dir)
        self.weight = self.backend.prepare(self.copy.matrix)
        self.vocab, self.hidden = self.copy.matrix.shape
        self.tied = vx.tied

    def warm_up(self) -> None:
        """Fault the whole matrix into memory and let BLAS set up, so the first request is not slow."""
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
