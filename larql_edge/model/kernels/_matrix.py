"""CompactMatrix: a weight [out, in] kept in its compact (block) form, multiplied in place."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import numpy as np

from larql_edge.model.kernels import _numba_impl as nk
from larql_edge.model.kernels import _threads
from larql_edge.model.kernels._formats import FORMATS, KernelError, block_format
from larql_edge.model.kernels._quantize import QUANTIZERS

_MATMUL = {"q8_0": nk.q8_0_matmul, "q4_k": nk.q4_k_matmul, "q6_k": nk.q6_k_matmul, "f16": nk.f16_matmul}
_ROWS = {"q8_0": nk.q8_0_rows, "q4_k": nk.q4_k_rows, "q6_k": nk.q6_k_rows, "f16": nk.f16_rows}

# From this many rows of x on, a product decodes W tile by tile into float32 and multiplies each
# tile with BLAS: the fused kernels keep their accumulators in memory (numba cannot hold them in
# registers), so past a few rows BLAS's register-blocked SGEMM wins even with the decode added.
# Measured (1 thread, Gemma shapes): fused wins at <= 8 rows (lm_head 8 rows: 48 vs 85 ms per 65k
# rows), tiled at >= 16 (gate 16 rows: 1.95 vs 3.4 ms; lm_head 32 rows: 207 vs 301 ms).
TILED_FROM_ROWS = 16
_TILE_ROWS = 256  # a 256 x 2048 float32 tile is 2 MiB: it stays in L2/L3 between decode and SGEMM

# A product is split across the kernel threads only if it is at least this many multiply-adds;
# below it, handing work to a thread costs more than it saves (a 1-row q_proj is ~0.65 M).
PARALLEL_FROM_MACS = 4_000_000


@dataclass(eq=False)
class CompactMatrix:
    """A weight ``[rows, cols]`` (``y = x @ W.T``) held as its block bytes, never as a float32 copy.

    ``fmt`` is ``"q4_k" | "q6_k" | "q8_0" | "f16"`` (the compact formats) or ``"f32"`` (the exact
    reference, numpy BLAS). ``data`` is ``[rows, row_bytes]`` uint8 (float16/float32 for the float
    formats), possibly a read-only memory map shared with other processes through the page cache.
    """

    fmt: str
    shape: tuple[int, int]
    data: np.ndarray = field(repr=False)

    # -- construction -------------------------------------------------------------------------

    @classmethod
    def from_blocks(cls, raw: np.ndarray, fmt: str, rows: int, cols: int) -> CompactMatrix:
        """Wrap a weight's stored bytes (a uint8 view of the file, e.g. a memory map) without copying.

        K-quant rows are padded to a multiple of 256 columns (as LARQL and ggml store them); the
        padding must be zeros or at least finite values: x is treated as zero there.
        """
        f = block_format(fmt)
        rows, cols = _dims(rows, cols)
        if not isinstance(raw, np.ndarray):
            raise KernelError(f"{fmt} weight bytes must be a numpy array, got {type(raw).__name__}")
        if raw.dtype != np.uint8:
            raise KernelError(f"{fmt} weight bytes must be uint8 (a byte view of the file), got {raw.dtype}")
        need = rows * f.row_bytes(cols)
        if raw.size != need:
            raise KernelError(
                f"{fmt} weight [{rows}, {cols}] needs {need} bytes ({f.row_bytes(cols)} per row), got {raw.size}"
            )
        if not raw.flags.c_contiguous:
            raise KernelError(f"{fmt} weight bytes must be C-contiguous (a slice of the file, not a strided view)")
        # a plain ndarray view (a np.memmap subclass would be a distinct numba type)
        data = raw.view(np.ndarray).reshape(rows, f.row_bytes(cols))
        if fmt == "f16":
            data = data.view(np.uint16)
        elif fmt == "f32":
            data = data.view(np.float32)
        return cls(fmt, (rows, cols), data)

    @classmethod
    def from_array(cls, w: np.ndarray) -> CompactMatrix:
        """An f16 or f32 ``[rows, cols]`` array as it is (no copy if C-contiguous)."""
        if not isinstance(w, np.ndarray) or w.ndim != 2:
            raise KernelError("a weight must be a 2-D numpy array [rows, cols]")
        if w.dtype not in (np.float16, np.float32):
            raise KernelError(f"from_array takes float16 or float32 weights, got {w.dtype}: use quantize()")
        w = np.ascontiguousarray(w)
        fmt = "f16" if w.dtype == np.float16 else "f32"
        return cls(fmt, w.shape, w.view(np.uint16) if fmt == "f16" else w)

    @classmethod
    def quantize(cls, w: np.ndarray, fmt: str) -> CompactMatrix:
        """Quantize float weights ``[rows, cols]`` into ``fmt`` (a new in-memory array of its size)."""
        block_format(fmt)
        if not isinstance(w, np.ndarray) or w.ndim != 2 or w.dtype.kind != "f":
            raise KernelError("quantize takes a 2-D floating-point numpy array [rows, cols]")
        _dims(*w.shape)
        if fmt in ("f16", "f32"):
            return cls.from_array(np.asarray(w, dtype=np.float16 if fmt == "f16" else np.float32))
        if not np.isfinite(w).all():
            raise KernelError("cannot quantize a weight with NaN or infinite values")
        raw = QUANTIZERS[fmt](np.ascontiguousarray(w, dtype=np.float32))
        return cls.from_blocks(raw.reshape(-1), fmt, *w.shape)

    # -- properties ---------------------------------------------------------------------------

    @property
    def nbytes(self) -> int:
        """Bytes this matrix holds (or maps): its blocks, padding included."""
        return int(self.data.nbytes)

    def __repr__(self) -> str:
        return f"CompactMatrix({self.fmt}, shape={self.shape}, nbytes={self.nbytes})"

    # -- compute ------------------------------------------------------------------------------

    def matmul(self, x: np.ndarray) -> np.ndarray:
        """``x @ W.T``: x float32 ``[n, cols]`` (or ``[cols]``) -> float32 ``[n, rows]`` (or ``[rows]``)."""
        rows, cols = self.shape
        x2, vector = self._check_x(x)
        if self.fmt == "f32":
            y = x2 @ self.data.T
            return y[0] if vector else y
        n = x2.shape[0]
        out = np.empty((n, rows), np.float32)
        if n:
            f = FORMATS[self.fmt]
            pc = f.padded_cols(cols)
            if pc != cols or not x2.flags.c_contiguous:
                xp = np.zeros((n, pc), np.float32)
                xp[:, :cols] = x2
                x2 = xp
            work = _tiled if n >= TILED_FROM_ROWS else _fused
            _threads.split_rows(lambda a, b: work(self, x2, out, a, b), rows, n * rows * cols >= PARALLEL_FROM_MACS)
        return out[0] if vector else out

    def rows(self, idx) -> np.ndarray:
        """Dequantized rows ``W[idx]`` as float32 ``[k, cols]`` (embedding lookups)."""
        nrows, cols = self.shape
        try:
            ids = np.asarray(idx)
        except Exception:  # noqa: BLE001 - anything numpy cannot take is a bad index
            raise KernelError("row indices must be integers") from None
        if ids.dtype.kind not in "iu" and not (ids.size == 0 and ids.dtype.kind == "f"):
            raise KernelError(f"row indices must be integers, got {ids.dtype}")
        ids = ids.astype(np.int64).reshape(-1)
        if ids.size and (ids.min() < 0 or ids.max() >= nrows):
            raise KernelError(f"row index out of range [0, {nrows})")
        if self.fmt == "f32":
            return self.data[ids].copy()
        pc = FORMATS[self.fmt].padded_cols(cols)
        out = np.empty((ids.size, pc), np.float32)
        if ids.size:
            _ROWS[self.fmt](_readonly(self.data), ids, cols, out)
        return out[:, :cols] if pc != cols else out

    def dequantize(self) -> np.ndarray:
        """The whole matrix as float32 (tests and debugging only: this is the copy the class avoids)."""
        return self.rows(np.arange(self.shape[0]))

    def _check_x(self, x) -> tuple[np.ndarray, bool]:
        rows, cols = self.shape
        if not isinstance(x, np.ndarray):
            raise KernelError(f"x must be a numpy array, got {type(x).__name__}")
        if x.dtype.kind != "f":
            raise KernelError(f"x must be floating point (float32), got {x.dtype}")
        vector = x.ndim == 1
        x2 = x[None, :] if vector else x
        if x2.ndim != 2 or x2.shape[1] != cols:
            raise KernelError(f"x must be [n, {cols}] for a [{rows}, {cols}] weight, got {list(x.shape)}")
        return np.asarray(x2, dtype=np.float32), vector


def _dims(rows, cols) -> tuple[int, int]:
    try:
        r, c = int(rows), int(cols)
    except (TypeError, ValueError):
        raise KernelError(f"weight shape must be two integers, got {rows!r}, {cols!r}") from None
    if r <= 0 or c <= 0 or r != rows or c != cols:
        raise KernelError(f"weight shape must be positive integers, got [{rows}, {cols}]")
    return r, c


def _readonly(a: np.ndarray) -> np.ndarray:
    """A read-only view: numba compiles one kernel per writeable flag, and vindex maps are read-only,
    so every call passes a read-only view and only that specialization is ever compiled."""
    v = a.view()
    v.flags.writeable = False
    return v


def _fused(m: CompactMatrix, x: np.ndarray, out: np.ndarray, a: int, b: int) -> None:
    _MATMUL[m.fmt](_readonly(m.data[a:b]), x, m.shape[1], out, a)


_tile_buffers = threading.local()


def _tile(shape: tuple[int, int]) -> np.ndarray:
    """A per-thread float32 tile buffer, reused so its pages are faulted in only once."""
    buf = getattr(_tile_buffers, "buf", None)
    if buf is None or buf.size < shape[0] * shape[1]:
        buf = _tile_buffers.buf = np.empty(shape[0] * shape[1], np.float32)
    return buf[: shape[0] * shape[1]].reshape(shape)


def _tiled(m: CompactMatrix, x: np.ndarray, out: np.ndarray, a: int, b: int) -> None:
    cols = m.shape[1]
    pc = x.shape[1]
    tile = _tile((_TILE_ROWS, pc))
    decode = _ROWS[m.fmt]
    data = _readonly(m.data)
    for s in range(a, b, _TILE_ROWS):
        e = min(b, s + _TILE_ROWS)
        t = tile[: e - s]
        decode(data, np.arange(s, e, dtype=np.int64), cols, t)
        # padded columns of t hold decoded padding (zeros) and x is zero there: no slicing needed
        np.matmul(x, t.T, out=out[:, s:e])
