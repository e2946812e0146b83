"""CompactMatrix: a weight [out, in] kept in its compact (block) form, multiplied in place by ggml."""

from __future__ import annotations

import platform
import threading
from dataclasses import dataclass, field

import numpy as np

from larql_edge.model.kernels import _ggml, _threads
from larql_edge.model.kernels._formats import FORMATS, KernelError, block_format
from larql_edge.model.ops import linear_rows

# From this many rows of x on, a product decodes W tile by tile into float32 (ggml's dequantizer) and
# multiplies each tile with BLAS instead of ggml's mul_mat; the wheel's x86 build has no llamafile
# sgemm and no AVX-512/VNNI, so its batched path is a loop of vec_dot (DESIGN.md, "Kernels").
TILED_FROM_ROWS = 1 << 30  # measured below: ggml's mul_mat is never slower here (benchmarks/kernels.py)
_TILE_ROWS = 256  # a 256 x 2048 float32 tile is 2 MiB: it stays in L2/L3 between decode and SGEMM

# Repack a matrix into ggml's interleaved layout on its first product where ggml has a repacked
# kernel for its type on this CPU (x86-64 AVX2: Q4_K; DESIGN.md §9). False: always the stored bytes.
REPACK = True

# Formats multiplied from a copy in another format with the same values, made once in memory on the
# first product (the stored bytes' pages are dropped after, as for a repacked copy). Q5_0 -> Q8_0: the
# same scale per block and the same integers (q - 16); on x86 ggml's Q8_0 `vec_dot` is Q5_0's without
# the bit unpacking (the same integer sums per block, scaled and accumulated in the same order), so
# every float is Q5_0's bit for bit (tests/test_kernels.py), in 0.46-0.80x the time at 1 to 16 rows
# (`python benchmarks/widen.py`); the copy is 34/22 of the stored bytes. x86 only: that
# is where the two kernels were read and measured equal. {}: the stored bytes.
WIDEN = {"q5_0": "q8_0"} if _ggml.is_x86(platform.machine()) else {}

# A product is split across the kernel threads only if it is at least this many multiply-adds;
# below it, handing work to a thread costs more than it saves (a 1-row q_proj is ~0.65 M).
PARALLEL_FROM_MACS = 4_000_000


@dataclass(eq=False)
class CompactMatrix:
    """A weight ``[rows, cols]`` (``y = x @ W.T``) held as its block bytes, never as a float32 copy.

    ``fmt`` is one of ggml's ``"q4_k" | "q6_k" | "q8_0" | "q5_0" | "q4_1" | "f16"`` (computed by ggml's
    kernels on these bytes) or ``"f32"`` (the exact reference, numpy BLAS). ``data`` is ``[rows,
    row_bytes]`` uint8 (float16/float32 for the float formats), possibly a read-only memory map shared
    with other processes through the page cache.
    """

    fmt: str
    shape: tuple[int, int]
    data: np.ndarray = field(repr=False)
    _graphs: _ggml.MatMulCache | None = field(default=None, repr=False)
    _kernel_fmt: str = field(default="", repr=False)  # the format the graphs multiply (see kernel_form)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

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
        # a plain ndarray view (not a np.memmap subclass: slicing it stays cheap)
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
        """Quantize float weights ``[rows, cols]`` into ``fmt`` (a new in-memory array of its size), with
        the package's one encoder per block type (`larql_edge.format.quant`)."""
        from larql_edge.format.quant import q6k_to_ggml, quantize_matrix

        block_format(fmt)
        if not isinstance(w, np.ndarray) or w.ndim != 2 or w.dtype.kind != "f":
            raise KernelError("quantize takes a 2-D floating-point numpy array [rows, cols]")
        _dims(*w.shape)
        if fmt in ("f16", "f32"):
            return cls.from_array(np.asarray(w, dtype=np.float16 if fmt == "f16" else np.float32))
        if not np.isfinite(w).all():
            raise KernelError("cannot quantize a weight with NaN or infinite values")
        raw = quantize_matrix(np.ascontiguousarray(w, dtype=np.float32), fmt.upper()).data
        if fmt == "q6_k":  # the encoder writes LARQL's Q6_K bit layout; ggml reads its own
            raw = q6k_to_ggml(raw.reshape(-1))
        return cls.from_blocks(np.ascontiguousarray(raw).reshape(-1), fmt, *w.shape)

    # -- properties ---------------------------------------------------------------------------

    @property
    def nbytes(self) -> int:
        """Bytes this matrix holds (or maps): its blocks, padding included."""
        return int(self.data.nbytes)

    def __repr__(self) -> str:
        return f"CompactMatrix({self.fmt}, shape={self.shape}, nbytes={self.nbytes})"

    # -- compute ------------------------------------------------------------------------------

    def matmul(self, x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """``x @ W.T``: x float32 ``[n, cols]`` (or ``[cols]``) -> float32 ``[n, rows]`` (or ``[rows]``).

        ``out`` (float32 ``[n, rows]``, C-contiguous) receives the result instead of a new array."""
        rows, cols = self.shape
        x2, vector = self._check_x(x)
        n = x2.shape[0]
        if out is None:
            out = np.empty((n, rows), np.float32)
        elif out.dtype != np.float32 or out.shape != (n, rows) or not out.flags.c_contiguous:
            raise KernelError(f"out must be a C-contiguous float32 [{n}, {rows}] array")
        if self.fmt == "f32":
            linear_rows(x2, self.data.T, out=out)  # a row's floats do not depend on its company
            return out[0] if vector else out
        if n:
            pc = FORMATS[self.fmt].padded_cols(cols)
            if pc != cols or not x2.flags.c_contiguous:
                xp = np.zeros((n, pc), np.float32)
                xp[:, :cols] = x2
                x2 = xp
            xs = x2

            def work(a: int, b: int) -> None:
                if n >= TILED_FROM_ROWS:
                    _tiled(self, xs, out, a, b)
                else:
                    self._ggml(xs, out, a, b)

            g = self._graphs or self._make_graphs()
            align = _ggml.Repacked.ALIGN if g.repacked is not None else 1
            _threads.split_rows(work, rows, n * rows * cols >= PARALLEL_FROM_MACS, align)
        return out[0] if vector else out

    def _make_graphs(self) -> _ggml.MatMulCache:
        with self._lock:  # concurrent first products: one repack
            if self._graphs is None:
                fmt, data = self.fmt, self.data
                if fmt in WIDEN:
                    from larql_edge.format.quant import q5_0_to_q8_0

                    fmt = WIDEN[fmt]
                    data = q5_0_to_q8_0(np.asarray(data).reshape(-1)).reshape(self.shape[0], -1)
                    _release_pages(self.data)  # the wider copy is what is read from now on
                pc = FORMATS[fmt].padded_cols(self.shape[1])
                wtype = _ggml.TYPE[fmt]
                rp = _ggml.Repacked.make(data, wtype, pc) if REPACK and fmt == self.fmt and fmt != "f16" else None
                if rp is not None:
                    _release_pages(data)  # the repacked copy is what is read from now on
                self._kernel_fmt = fmt  # before _graphs: a reader that sees the graphs sees their format
                self._graphs = _ggml.MatMulCache(data, wtype, pc, self.shape[0], rp)
        return self._graphs

    def kernel_form(self) -> tuple[str, np.ndarray, _ggml.Repacked | None]:
        """What ggml multiplies: (format, block bytes ``[rows, row_bytes]``, repacked copy or None): the
        stored bytes, a wider copy (`WIDEN`) or ggml's repacked copy; made on the first call."""
        g = self._graphs or self._make_graphs()
        return self._kernel_fmt, g.wdata, g.repacked

    @property
    def repacked(self) -> bool:
        """Whether products read ggml's repacked copy (made on the first product) instead of the stored bytes."""
        return (self._graphs or self._make_graphs()).repacked is not None

    def repacked_copy(self) -> _ggml.Repacked | None:
        """ggml's repacked copy of this matrix (made now if not yet), or None where there is none."""
        return (self._graphs or self._make_graphs()).repacked

    def _ggml(self, x: np.ndarray, out: np.ndarray, a: int, b: int) -> None:
        g = self._graphs or self._make_graphs()
        g.run(x.shape[0], a, b, x.ctypes.data, out.ctypes.data)

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
        _decode_rows(self, ids, out)
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


def _release_pages(a: np.ndarray) -> None:
    """Drop this process's resident pages of ``a`` when it is a read-only file mapping (re-read from
    the page cache if ever touched again): a repacked matrix would otherwise count twice in RSS."""
    import mmap

    base: object = a
    while base is not None and not isinstance(base, np.memmap):
        base = getattr(base, "base", None)
        if isinstance(base, mmap.mmap):
            return  # a bare mmap: its access mode is unknown, leave it
    if base is None or getattr(base, "mode", None) != "r":
        return
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        page = mmap.PAGESIZE
        start = -(-a.ctypes.data // page) * page  # whole pages inside the array only
        end = (a.ctypes.data + a.nbytes) // page * page
        if end > start:
            libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), 4)  # MADV_DONTNEED
    except (OSError, AttributeError):  # not Linux-like: the pages stay until the kernel reclaims them
        pass


def _decode_rows(m: CompactMatrix, ids: np.ndarray, out: np.ndarray) -> None:
    """``out[k] = W[ids[k]]`` decoded by ggml; a run of consecutive ids is one call."""
    data = m.data
    k = 0
    while k < ids.size:
        e = k + 1
        while e < ids.size and ids[e] == ids[e - 1] + 1:
            e += 1
        r = int(ids[k])
        _ggml.to_float(m.fmt, data[r : r + e - k], out[k:e])
        k = e


_tile_buffers = threading.local()


def _tile(shape: tuple[int, int]) -> np.ndarray:
    """A per-thread float32 tile buffer, reused so its pages are faulted in only once."""
    buf = getattr(_tile_buffers, "buf", None)
    if buf is None or buf.size < shape[0] * shape[1]:
        buf = _tile_buffers.buf = np.empty(shape[0] * shape[1], np.float32)
    return buf[: shape[0] * shape[1]].reshape(shape)


def _tiled(m: CompactMatrix, x: np.ndarray, out: np.ndarray, a: int, b: int) -> None:
    pc = x.shape[1]
    tile = _tile((_TILE_ROWS, pc))
    for s in range(a, b, _TILE_ROWS):
        e = min(b, s + _TILE_ROWS)
        t = tile[: e - s]
        _ggml.to_float(m.fmt, m.data[s:e], t)
        # padded columns of t hold decoded padding (zeros) and x is zero there: no slicing needed
        np.matmul(x, t.T, out=out[:, s:e])
