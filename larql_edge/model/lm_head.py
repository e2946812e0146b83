"""The lm_head in the form it is multiplied in: shared by the embed server's head and the local model.

The lm_head is a ``[vocab, hidden]`` matrix product per token (Gemma 3 270M: 262,144 x 640), the one
real computation of the embed server and the largest of a local decode step. Which form of the
matrix it multiplies by (the embed server's ``--lm-head-format``, `head_format`):

- ``auto`` (the default) with the compact backend: what the vindex stores, if the kernels can use it
  in place (an f16 or f32 table, an untied lm_head's blocks); a **quantized** vindex's tied lm_head
  (its f16 embeddings) as **Q8_0** (178 MB for Gemma 3 270M instead of 671 MB of f32: the same bytes
  as the GGUF's own Q8_0 table, since requantizing its f16 image recovers them exactly);
- ``q8_0``: a Q8_0 copy of any float lm_head; ``f16``: an f16 one; ``f32``: a float32 one (the
  reference backends, numpy and MLX, always use f32).

A copy (f32, f16 or Q8_0) is converted once into ``<lm-head-cache>/<sha256 of the source file>-...``
and memory-mapped: the page cache then holds one copy for every worker and every server process on
the machine, and a restart maps the finished file instead of converting again. With no usable cache
folder (``--lm-head-cache ''``, read-only disk, no recorded checksum), the copy is built in this
process's memory.
"""

from __future__ import annotations

import fcntl
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from larql_edge.format.quant import QBlocks, dequantize_matrix, quantize_q8_0, row_bytes
from larql_edge.format.vindex import EMBEDDINGS, LM_HEAD_KEY, Vindex
from larql_edge.model.backend import Backend
from larql_edge.model.weights import lm_head_matrix

log = logging.getLogger("larql.lm_head")

HEAD_FORMATS = ("auto", "q8_0", "f16", "f32")
_CONVERT_ROWS = 16384  # rows converted per step: bounds the temporary f32 memory to ~40 MB


@dataclass
class ComputeCopy:
    """The lm_head as the head multiplies by it."""

    matrix: np.ndarray | QBlocks  # float [vocab, hidden], or blocks
    format: str  # "f32" | "f16" | "q8_0" | a vindex block format ("Q4_K", ...)
    storage: str  # "mmap (vindex)" | "mmap (shared copy)" | "memory (copy)"
    path: str | None
    nbytes: int

    @property
    def shape(self) -> tuple[int, int]:
        m = self.matrix
        return (m.rows, m.logical_cols) if isinstance(m, QBlocks) else (int(m.shape[0]), int(m.shape[1]))


def _lm_head_key(vx: Vindex) -> tuple[str | None, str]:
    """The manifest key of the lm_head (None: the embedding table, when tied) and its file."""
    if vx.has_tensor(LM_HEAD_KEY):
        return LM_HEAD_KEY, vx.manifest[LM_HEAD_KEY].file
    return None, EMBEDDINGS


def _f32_chunks(vx: Vindex, key: str | None, rows: int) -> Iterator[tuple[int, np.ndarray]]:
    """The lm_head as f32 chunks of rows read with ``pread`` (`Vindex.read_rows`): converting through
    the memory map would leave the whole f16 table resident in this process."""
    for i in range(0, rows, _CONVERT_ROWS):
        n = min(_CONVERT_ROWS, rows - i)
        yield i, vx.read_rows(key, i, n).astype(np.float32)


# target format -> (file suffix, bytes per row, chunk converter to uint8/float rows)
def _converter(fmt: str, cols: int):
    if fmt == "q8_0":
        if cols % 32:
            raise ValueError(f"a Q8_0 lm_head needs a hidden size divisible by 32, not {cols}")
        # ggml's f16 rounding of the scales: the bytes gguf-py and llama.cpp would write
        return row_bytes("Q8_0", cols), lambda b: quantize_q8_0(b, f16="ggml").reshape(len(b), -1)
    if fmt == "f16":
        return cols * 2, lambda b: b.astype("<f2").view(np.uint8).reshape(len(b), -1)
    return cols * 4, lambda b: b.astype("<f4", copy=False).view(np.uint8).reshape(len(b), -1)


def _as_form(raw: np.ndarray, fmt: str, rows: int, cols: int) -> np.ndarray | QBlocks:
    if fmt == "q8_0":
        return QBlocks("Q8_0", rows, cols, cols, raw.reshape(rows, -1))
    return raw.view("<f2" if fmt == "f16" else "<f4").reshape(rows, cols)


def head_format(vx: Vindex, wanted: str, backend: Backend) -> str:
    """The form the lm_head is multiplied in (see the module docstring)."""
    if wanted not in HEAD_FORMATS:
        raise ValueError(f"lm_head format {wanted!r} is not one of {', '.join(HEAD_FORMATS)}")
    src = lm_head_matrix(vx)
    if backend.name != "compact":
        return "f32"  # the reference backends multiply float32
    if wanted != "auto":
        return wanted
    if isinstance(src, QBlocks):
        return src.format
    if vx.quantized:
        return "q8_0"
    return "f16" if src.dtype == np.float16 else "f32"


def compute_copy(vx: Vindex, cache_dir: Path | None, fmt: str = "f32") -> ComputeCopy:
    """The lm_head in form ``fmt`` (`head_format`): the vindex's own bytes where they already are that
    form, else a converted copy (see the module docstring for where it lives)."""
    src = lm_head_matrix(vx)
    if isinstance(src, QBlocks):
        if fmt == src.format:
            return ComputeCopy(src, fmt, "mmap (vindex)", None, src.nbytes)
        mat = dequantize_matrix(src)  # blocks into a float form: the reference path (or an explicit ask)
        if fmt == "f16":
            mat = mat.astype(np.float16)
        return ComputeCopy(mat, "f16" if fmt == "f16" else "f32", f"memory (from {src.format})", None, mat.nbytes)
    rows, cols = src.shape
    if (fmt, src.dtype) in (("f32", np.float32), ("f16", np.float16)):
        return ComputeCopy(src, fmt, "mmap (vindex)", None, src.nbytes)
    key, file = _lm_head_key(vx)
    row_b, convert = _converter(fmt, cols)
    sha = vx.checksums.get(file)
    if cache_dir is not None and sha:
        try:
            out = _shared_copy(vx, key, rows, cols, Path(cache_dir), sha, fmt)
            mapped = np.memmap(out, dtype=np.uint8, mode="r", shape=(rows * row_b,))
            return ComputeCopy(_as_form(mapped, fmt, rows, cols), fmt, "mmap (shared copy)", str(out), rows * row_b)
        except OSError as e:
            log.warning("lm_head cache %s unusable (%s); keeping the %s copy in memory", cache_dir, e, fmt)
    raw = np.empty((rows, row_b), dtype=np.uint8)
    for i, chunk in _f32_chunks(vx, key, rows):
        raw[i : i + len(chunk)] = convert(chunk)
    return ComputeCopy(_as_form(raw.reshape(-1), fmt, rows, cols), fmt, "memory (copy)", None, raw.nbytes)


def _shared_copy(vx: Vindex, key: str | None, rows: int, cols: int, folder: Path, sha: str, fmt: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    row_b, convert = _converter(fmt, cols)
    path = folder / f"{sha}-{rows}x{cols}.{fmt}"
    want = rows * row_b
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
                for _, chunk in _f32_chunks(vx, key, rows):
                    f.write(convert(chunk).tobytes())
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
    return path
