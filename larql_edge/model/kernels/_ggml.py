"""ggml's CPU kernels through ctypes, from the prebuilt ``libggml-python`` wheel (nothing compiled here).

The wheel ships ``libggml-base`` and ``libggml-cpu`` (x86-64: AVX2/FMA/F16C; aarch64: NEON; macOS arm64
also ``libggml-metal``, unused here). A product ``y = x @ W.T`` is one ``ggml_mul_mat`` node in a small
graph whose weight tensor's ``data`` points at the block bytes as stored (a memory map of the vindex):
ggml quantizes the activation to the weight type's ``vec_dot_type`` (Q8_0 for Q8_0/Q5_0, Q8_1 for Q4_1,
Q8_K for the K-quants, f16 for f16), exactly as llama.cpp does, then runs its ``vec_dot`` per row.
Graphs are built once per (matrix, rows of x, row range) and reused; a call only repoints ``x`` and
``y`` and runs ``ggml_graph_compute`` with one thread (our pool splits rows: `_threads`).

Repacked weights (`Repacked`): for the block types ggml's CPU build can interleave for its gemm/gemv
kernels on this CPU (x86-64 AVX2: Q4_K, Q4_0, IQ4_NL; more on arm64), a matrix is copied once, in
memory, into ggml's repack buffer (``ggml_backend_cpu_repack_buffer_type``: rows interleaved by 8,
the same bytes per row) and multiplied from there: measured 1.5-2x faster than ``vec_dot`` per row
at 1-32 rows (DESIGN.md §9). The vindex file is not touched.

Why not the other routes (measured, DESIGN.md "Kernels"): a per-row ``vec_dot`` loop needs a compiled
loop (numba: ~200 MB per image, ~70 MB RSS per process); ggml's own thread pool per call (threadpool
NULL) spawns threads on every product, 20-80x slower on this loaded 2-core machine.
"""

from __future__ import annotations

import ctypes as C
import platform
import sys
import threading
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from larql_edge.errors import KernelError

# ggml_type numbers (ggml.h enum ggml_type; gguf-py's GGMLQuantizationType has the same values)
TYPE = {"f32": 0, "f16": 1, "q4_1": 3, "q5_0": 6, "q8_0": 8, "q4_k": 12, "q6_k": 14}


class _InitParams(C.Structure):
    _fields_ = [("mem_size", C.c_size_t), ("mem_buffer", C.c_void_p), ("no_alloc", C.c_bool)]


class _Tensor(C.Structure):  # struct ggml_tensor (ggml.h, 0.20.x: GGML_MAX_DIMS 4, MAX_SRC 10, MAX_NAME 64)
    _fields_ = [
        ("type", C.c_int), ("buffer", C.c_void_p), ("ne", C.c_int64 * 4), ("nb", C.c_size_t * 4), ("op", C.c_int),
        ("op_params", C.c_int32 * 16), ("flags", C.c_int32), ("src", C.c_void_p * 10), ("view_src", C.c_void_p),
        ("view_offs", C.c_size_t), ("data", C.c_void_p), ("name", C.c_char * 64), ("extra", C.c_void_p),
        ("padding", C.c_char * 8),
    ]


class _CPlan(C.Structure):  # struct ggml_cplan (ggml-cpu.h)
    _fields_ = [
        ("work_size", C.c_size_t), ("work_data", C.c_void_p), ("n_threads", C.c_int), ("threadpool", C.c_void_p),
        ("abort_callback", C.c_void_p), ("abort_callback_data", C.c_void_p), ("use_ref", C.c_bool),
    ]


class _TypeTraits(C.Structure):  # struct ggml_type_traits (ggml.h)
    _fields_ = [
        ("type_name", C.c_char_p), ("blck_size", C.c_int64), ("blck_size_interleave", C.c_int64),
        ("type_size", C.c_size_t), ("is_quantized", C.c_bool), ("to_float", C.c_void_p), ("from_float_ref", C.c_void_p),
    ]


class ThreadpoolParams(C.Structure):  # struct ggml_threadpool_params (ggml.h; GGML_MAX_N_THREADS 512)
    _fields_ = [("cpumask", C.c_bool * 512), ("n_threads", C.c_int), ("prio", C.c_int), ("poll", C.c_uint32),
                ("strict_cpu", C.c_bool), ("paused", C.c_bool)]


_TP = C.POINTER(_Tensor)
_LOG_CALLBACK = C.CFUNCTYPE(None, C.c_int, C.c_char_p, C.c_void_p)
_log_state = {"shown": False}


def _log(level: int, text: bytes, _user) -> None:
    # ggml_log_level: 1 debug, 2 info, 3 warn, 4 error, 5 continuation of the previous line
    show = level in (3, 4) or (level == 5 and _log_state["shown"])
    _log_state["shown"] = show
    if show and text:
        sys.stderr.write(text.decode("utf-8", "replace"))


_LOG = _LOG_CALLBACK(_log)
_TO_FLOAT = C.CFUNCTYPE(None, C.c_void_p, C.c_void_p, C.c_int64)
_CPU_FEATURES = ("avx", "avx2", "fma", "f16c", "avx512", "avx512_vnni", "avx_vnni", "neon", "dotprod",
                 "matmul_int8", "sve", "llamafile")


class _Lib:
    def __init__(self) -> None:
        import libggml  # the libggml-python wheel: libraries and headers only

        root = Path(libggml.__file__).parent
        ext = ".dylib" if sys.platform == "darwin" else ".so"
        libdir = next((root / d for d in ("lib64", "lib") if (root / d / f"libggml-base{ext}").exists()), None)
        if libdir is None:
            raise KernelError(f"libggml-python at {root} has no libggml-base{ext}")
        self.path = libdir
        self.version, self.build = _wheel_build()
        self.base = C.CDLL(str(libdir / f"libggml-base{ext}"), mode=C.RTLD_GLOBAL)
        self.cpu = C.CDLL(str(libdir / f"libggml-cpu{ext}"), mode=C.RTLD_GLOBAL)
        b, c = self.base, self.cpu
        b.ggml_init.restype, b.ggml_init.argtypes = C.c_void_p, [_InitParams]
        b.ggml_free.argtypes = [C.c_void_p]
        b.ggml_new_tensor_2d.restype, b.ggml_new_tensor_2d.argtypes = _TP, [C.c_void_p, C.c_int, C.c_int64, C.c_int64]
        b.ggml_mul_mat.restype, b.ggml_mul_mat.argtypes = _TP, [C.c_void_p, _TP, _TP]
        b.ggml_new_graph_custom.restype = C.c_void_p
        b.ggml_new_graph_custom.argtypes = [C.c_void_p, C.c_size_t, C.c_bool]
        b.ggml_build_forward_expand.argtypes = [C.c_void_p, _TP]
        b.ggml_tensor_overhead.restype = C.c_size_t
        b.ggml_graph_overhead_custom.restype, b.ggml_graph_overhead_custom.argtypes = C.c_size_t, [C.c_size_t, C.c_bool]
        b.ggml_get_type_traits.restype, b.ggml_get_type_traits.argtypes = C.POINTER(_TypeTraits), [C.c_int]
        b.ggml_version.restype = C.c_char_p
        b.ggml_commit.restype = C.c_char_p
        c.ggml_graph_plan.restype, c.ggml_graph_plan.argtypes = _CPlan, [C.c_void_p, C.c_int, C.c_void_p]
        c.ggml_graph_compute.restype, c.ggml_graph_compute.argtypes = C.c_int, [C.c_void_p, C.POINTER(_CPlan)]
        c.ggml_cpu_init()
        b.ggml_backend_buft_alloc_buffer.restype = C.c_void_p
        b.ggml_backend_buft_alloc_buffer.argtypes = [C.c_void_p, C.c_size_t]
        b.ggml_backend_buffer_get_base.restype, b.ggml_backend_buffer_get_base.argtypes = C.c_void_p, [C.c_void_p]
        b.ggml_backend_buffer_free.argtypes = [C.c_void_p]
        b.ggml_backend_tensor_alloc.restype = C.c_int
        b.ggml_backend_tensor_alloc.argtypes = [C.c_void_p, _TP, C.c_void_p]
        b.ggml_backend_tensor_set.argtypes = [_TP, C.c_void_p, C.c_size_t, C.c_size_t]
        b.ggml_nbytes.restype, b.ggml_nbytes.argtypes = C.c_size_t, [_TP]
        # ggml's default logger prints its debug lines (one per repacked matrix) to stderr: keep
        # warnings and errors only
        b.ggml_log_set.argtypes = [_LOG_CALLBACK, C.c_void_p]
        b.ggml_log_set(_LOG, None)
        # C++ (not extern "C") in ggml-cpu: looked up by its mangled name; absent in other builds
        fn = getattr(c, "_Z35ggml_backend_cpu_repack_buffer_typev", None)
        self.repack_buft = None
        if fn is not None:
            fn.restype = C.c_void_p
            self.repack_buft = fn()
        self._bind_graph_api()
        if C.sizeof(_Tensor) + 32 > b.ggml_tensor_overhead() + 32 or C.sizeof(_Tensor) != 336:
            raise KernelError(f"libggml {self.version}: struct ggml_tensor is not the layout this binding knows")
        self.to_float = {}
        for name, t in TYPE.items():
            tr = b.ggml_get_type_traits(t).contents
            if name != "f32":
                self.to_float[name] = _TO_FLOAT(tr.to_float)
        # ggml-cpu's own f16 -> f32 row converter (F16C/NEON where the CPU has them): the type traits'
        # to_float above is ggml-base's scalar reference loop (0.7 G values/s here; this one 3.6). Same
        # values (f16 -> f32 is exact); it decodes f16 rows (`CompactMatrix.rows`) and tiles (DESIGN.md §4).
        if hasattr(c, "ggml_cpu_fp16_to_fp32"):
            self.to_float["f16"] = _TO_FLOAT(("ggml_cpu_fp16_to_fp32", c))
        self.features = {f: bool(getattr(c, f"ggml_cpu_has_{f}")()) for f in _CPU_FEATURES
                         if hasattr(c, f"ggml_cpu_has_{f}")}
        self.min_rows = sgemm_min_rows(self.features, platform.machine())

    def _bind_graph_api(self) -> None:
        """The ops a whole decode step is built from (`larql_edge.model.graph`), ggml's allocator and
        its persistent thread pool."""
        b, c = self.base, self.cpu
        V, I64, F, INT = C.c_void_p, C.c_int64, C.c_float, C.c_int
        sig = {
            "ggml_new_tensor_1d": [V, INT, I64], "ggml_new_tensor_3d": [V, INT, I64, I64, I64],
            "ggml_add": [V, _TP, _TP], "ggml_mul": [V, _TP, _TP], "ggml_rms_norm": [V, _TP, F],
            "ggml_rope_ext": [V, _TP, _TP, _TP, INT, INT, INT, F, F, F, F, F, F],
            "ggml_soft_max_ext": [V, _TP, _TP, F, F], "ggml_geglu_split": [V, _TP, _TP],
            "ggml_swiglu_split": [V, _TP, _TP], "ggml_scale": [V, _TP, F], "ggml_tanh": [V, _TP],
            "ggml_cpy": [V, _TP, _TP], "ggml_cont_2d": [V, _TP, I64, I64], "ggml_reshape_3d": [V, _TP, I64, I64, I64],
            "ggml_view_2d": [V, _TP, I64, I64, C.c_size_t, C.c_size_t],
            "ggml_view_3d": [V, _TP, I64, I64, I64, C.c_size_t, C.c_size_t, C.c_size_t],
            "ggml_permute": [V, _TP, INT, INT, INT, INT], "ggml_transpose": [V, _TP], "ggml_pad": [V, _TP, INT, INT, INT, INT],
            "ggml_concat": [V, _TP, _TP, INT], "ggml_cont": [V, _TP],
        }
        for name, args in sig.items():
            f = getattr(b, name)
            f.restype, f.argtypes = _TP, args
        b.ggml_set_output.argtypes = [_TP]
        b.ggml_set_name.restype, b.ggml_set_name.argtypes = _TP, [_TP, C.c_char_p]
        b.ggml_graph_n_nodes.restype, b.ggml_graph_n_nodes.argtypes = C.c_int, [V]
        b.ggml_backend_cpu_buffer_type.restype = V
        b.ggml_gallocr_new.restype, b.ggml_gallocr_new.argtypes = V, [V]
        b.ggml_gallocr_free.argtypes = [V]
        b.ggml_gallocr_alloc_graph.restype, b.ggml_gallocr_alloc_graph.argtypes = C.c_bool, [V, V]
        b.ggml_gallocr_get_buffer_size.restype, b.ggml_gallocr_get_buffer_size.argtypes = C.c_size_t, [V, C.c_int]
        b.ggml_threadpool_params_default.restype = ThreadpoolParams
        b.ggml_threadpool_params_default.argtypes = [C.c_int]
        c.ggml_threadpool_new.restype, c.ggml_threadpool_new.argtypes = V, [C.POINTER(ThreadpoolParams)]
        c.ggml_threadpool_free.argtypes = [V]

    def info(self) -> dict:
        return {
            "library": "ggml (libggml-python)",
            "version": f"{self.base.ggml_version().decode()} (wheel {self.version}, commit {self.base.ggml_commit().decode()})",
            "build": self.build,
            "path": str(self.path),
            "min_rows": self.min_rows,
            "cpu_features": sorted(f for f, on in self.features.items() if on),
        }


def _wheel_build() -> tuple[str, str]:
    """The libggml-python version and how its libraries were built: ``prebuilt`` (a published wheel,
    portable: its platform tag is manylinux/musllinux/macosx/win) or ``native`` (compiled on this
    machine from the sdist (`pip wheel --no-binary libggml-python`): tagged plain ``linux_*``)."""
    try:
        from importlib.metadata import distribution

        dist = distribution("libggml-python")
        tags = [ln.split(":", 1)[1].strip() for ln in (dist.read_text("WHEEL") or "").splitlines() if ln.startswith("Tag:")]
    except Exception:  # noqa: BLE001 - a copy without package metadata
        return "unknown", "unknown"
    return dist.version, build_kind(tags)


def build_kind(wheel_tags: list[str]) -> str:
    """``prebuilt`` for a published (portable) platform tag, ``native`` for a plain local one."""
    if not wheel_tags:
        return "unknown"
    portable = any(t.rsplit("-", 1)[-1].startswith(("manylinux", "musllinux", "macosx", "win")) for t in wheel_tags)
    return "prebuilt" if portable else "native"


def is_x86(machine: str) -> bool:
    """``platform.machine()`` names an x86 CPU (the kernels read and measured here; not arm64)."""
    return machine.lower() in ("x86_64", "amd64", "x86", "i386", "i686")


def sgemm_min_rows(features: dict[str, bool], machine: str) -> int:
    """The fewest rows of x a product is computed with, so that a row's floats never depend on how
    many rows come with it (exact speculation and serve's batched == alone rest on that).

    ggml built with llamafile's sgemm (a native build, `GGML_LLAMAFILE`; the prebuilt wheels have
    none) sends 2+ rows of x on x86 to tinyBLAS and one row to `vec_dot`, which sum in other orders;
    inside tinyBLAS an element's sum does not depend on its tile (DESIGN.md §4.3). So there a 1-row
    product runs as 2 rows (the row twice, one result kept). On arm64 tinyBLAS starts at 2, 4 or 8
    rows by type: not measured here, left at 1 (such a build parts at those counts)."""
    return 2 if features.get("llamafile") and is_x86(machine) else 1


def min_rows() -> int:
    return lib().min_rows


# A product on a repacked weight (`Repacked`) is computed one row of x at a time (`MulMat`: a node per
# row; the FFN graphs, `ffn_graph`): ggml's repack kernels send 4+ rows through their gemm and fewer through
# gemv, which sum in another order, so a row's floats would depend on how many rows came with it
# (serve's batched == alone, DESIGN.md §4.4). gemv per row costs ~1.15x the gemm at 16 rows (Q4_K
# 2048x640: 16 x 45 us vs 625 us) and is still faster than `vec_dot` (1154 us). `mul_mat` (the local
# step graphs) keeps ggml's choice when asked nothing: llama.cpp's prefill takes the gemm, and the
# greedy parity with llama.cpp (tests/test_llama_cpp_parity.py) parts at a near-tie without it.
ROW_BY_ROW = True


def mul_mat(ctx: int, w, x, alone: bool = False):
    """``ggml_mul_mat(w, x)`` in a graph, x's rows (dim 1) padded with copies up to `min_rows`; the
    result is the view of the real rows (contiguous for a 2-D x; ``ggml_cont`` it before an op that
    needs that, e.g. softmax). ``alone``: on a repacked weight, a 2-D x's rows go one by one, one node
    each, joined by pairwise ``ggml_concat`` (each row then has its one-row floats)."""
    b = lib().base
    n = x.contents.ne[1]
    xt = x.contents
    if alone and n > 1 and w.contents.extra and xt.ne[2] == 1 and xt.ne[3] == 1:
        rows = [b.ggml_mul_mat(ctx, w, b.ggml_view_2d(ctx, x, xt.ne[0], 1, xt.nb[1], r * xt.nb[1])) for r in range(n)]
        while len(rows) > 1:  # pairwise: each result row is copied log2(n) times, not n
            rows = [b.ggml_concat(ctx, rows[i], rows[i + 1], 1) if i + 1 < len(rows) else rows[i]
                    for i in range(0, len(rows), 2)]
        return rows[0]
    if n >= lib().min_rows:
        return b.ggml_mul_mat(ctx, w, x)
    xx = x
    while xx.contents.ne[1] < lib().min_rows:
        xx = b.ggml_concat(ctx, xx, x, 1)
    y = b.ggml_mul_mat(ctx, w, xx)
    t = y.contents
    if t.ne[2] == 1 and t.ne[3] == 1:
        return b.ggml_view_2d(ctx, y, t.ne[0], n, t.nb[1], 0)
    return b.ggml_view_3d(ctx, y, t.ne[0], n, t.ne[2], t.nb[1], t.nb[2], 0)


_lib_lock = threading.Lock()
_lib: _Lib | None = None


def lib() -> _Lib:
    global _lib
    if _lib is None:
        with _lib_lock:
            if _lib is None:
                try:
                    _lib = _Lib()
                except ImportError as e:
                    raise KernelError(f"the compact backend needs libggml-python (pip install libggml-python): {e}") from None
    return _lib


def available() -> bool:
    try:
        lib()
    except (KernelError, OSError):
        return False
    return True


@lru_cache(maxsize=None)
def _ctx_bytes(tensors: int = 3, nodes: int = 4) -> int:
    return tensors * int(lib().base.ggml_tensor_overhead()) + int(lib().base.ggml_graph_overhead_custom(nodes, False)) + 1024


class Repacked:
    """A matrix copied into ggml's repack buffer (rows interleaved for its gemm/gemv kernels).

    `make` returns None where this build of ggml has no repacked kernel for the type on this CPU
    (or the rows are not a multiple of 8). Row ranges ``[a, b)`` with ``a`` and ``b`` multiples of 8
    are views of the same buffer (a group of 8 interleaved rows takes 8 rows' bytes)."""

    ALIGN = 8

    def __init__(self, buffer: int, base: int, extra: int, wtype: int, kcols: int, rows: int, row_bytes: int):
        self.buffer: int | None = buffer
        self.base, self.extra = base, extra
        self.wtype, self.kcols, self.rows, self.row_bytes = wtype, kcols, rows, row_bytes

    @classmethod
    def make(cls, wdata: np.ndarray, wtype: int, kcols: int) -> Repacked | None:
        L = lib()
        rows = wdata.shape[0]
        if L.repack_buft is None or rows % cls.ALIGN:
            return None
        mem = np.empty(_ctx_bytes(), np.uint8)
        ctx = L.base.ggml_init(_InitParams(mem.nbytes, mem.ctypes.data, True))
        try:
            w = L.base.ggml_new_tensor_2d(ctx, wtype, kcols, rows)
            nbytes = int(L.base.ggml_nbytes(w))
            if nbytes != wdata.nbytes:
                return None
            buf = L.base.ggml_backend_buft_alloc_buffer(L.repack_buft, nbytes)
            if not buf:
                return None
            base = L.base.ggml_backend_buffer_get_base(buf)
            if L.base.ggml_backend_tensor_alloc(buf, w, base) != 0 or not w.contents.extra:
                L.base.ggml_backend_buffer_free(buf)  # no repacked kernel for this type here
                return None
            src = np.ascontiguousarray(wdata)
            L.base.ggml_backend_tensor_set(w, src.ctypes.data, 0, nbytes)  # ggml interleaves the rows
            return cls(buf, base, w.contents.extra, wtype, kcols, rows, nbytes // rows)
        finally:
            L.base.ggml_free(ctx)

    def tensor(self, ctx: int, a: int, b: int):
        """Rows ``[a, b)`` as a tensor of ``ctx`` in the repack buffer (what ggml's kernels dispatch on)."""
        if a % self.ALIGN or (b - a) % self.ALIGN:
            raise KernelError(f"repacked rows [{a}, {b}) are not whole groups of {self.ALIGN}")
        w = lib().base.ggml_new_tensor_2d(ctx, self.wtype, self.kcols, b - a)
        w.contents.buffer = self.buffer
        w.contents.extra = self.extra
        w.contents.data = self.base + a * self.row_bytes
        return w

    def __del__(self) -> None:
        if getattr(self, "buffer", None) and _lib is not None:
            _lib.base.ggml_backend_buffer_free(self.buffer)
            self.buffer = None


class GraphPlans:
    """A built graph's compute plans, one per (threads, pool): ``ggml_graph_plan`` sizes the work
    buffer for the thread count, so a graph computed on 1 and on n threads keeps both."""

    def __init__(self, graph) -> None:
        self._graph = graph
        self._plans: dict[tuple[int, int | None], tuple[_CPlan, np.ndarray]] = {}
        self._compute = lib().cpu.ggml_graph_compute

    def compute(self, threads: int, pool: int | None) -> None:
        plan = self._plans.get((threads, pool))
        if plan is None:
            p = lib().cpu.ggml_graph_plan(self._graph, threads, pool)
            work = np.empty(max(1, p.work_size), np.uint8)
            p.work_data = work.ctypes.data
            plan = self._plans[(threads, pool)] = (p, work)
        if self._compute(self._graph, C.byref(plan[0])) != 0:
            raise KernelError("ggml_graph_compute failed")


class MulMat:
    """One ``ggml_mul_mat`` graph: weight rows ``[a, b)`` of a matrix times ``n`` rows of x.

    Not re-entrant (its work buffer holds the quantized x): a caller takes one from `MatMulCache`.
    ``repacked``: the rows come from that copy instead (``wdata`` is then the whole matrix, kept for
    its shape only).
    """

    def __init__(self, wdata: np.ndarray, wtype: int, kcols: int, n: int, ystride: int,
                 repacked: tuple[Repacked, int, int] | None = None):
        L = lib()
        # A repacked weight takes its rows one by one (`ROW_BY_ROW`): n one-row products in this one
        # graph, so a row costs a node, not a Python call and a graph compute
        per_row = ROW_BY_ROW and repacked is not None and n > 1
        self._rows: list[tuple[Any, Any]] | None = None
        self._pad: tuple[np.ndarray, np.ndarray, int, int] | None = None
        self._keep = (wdata, repacked)
        # (nodes and leaves: the graph's size bounds each)
        self._mem = np.empty(_ctx_bytes(2 * n + 1 if per_row else 3, 2 * n + 2 if per_row else 4), np.uint8)
        self._ctx = L.base.ggml_init(_InitParams(self._mem.nbytes, self._mem.ctypes.data, True))
        if not self._ctx:
            raise KernelError("ggml_init failed")
        if repacked is not None:
            rp, a, b = repacked
            w = rp.tensor(self._ctx, a, b)
        else:
            rows = wdata.shape[0]
            w = L.base.ggml_new_tensor_2d(self._ctx, wtype, kcols, rows)
            w.contents.data = wdata.ctypes.data
            if w.contents.nb[1] != wdata.strides[0]:
                raise KernelError(f"weight row bytes {wdata.strides[0]} != ggml's {w.contents.nb[1]}")
        if per_row:
            self._kbytes, self._ybytes = kcols * 4, ystride * 4
            self._graph = L.base.ggml_new_graph_custom(self._ctx, 2 * n + 2, False)
            self._rows = []
            for _ in range(n):
                x = L.base.ggml_new_tensor_2d(self._ctx, TYPE["f32"], kcols, 1)
                y = L.base.ggml_mul_mat(self._ctx, w, x)
                L.base.ggml_build_forward_expand(self._graph, y)
                self._rows.append((x.contents, y.contents))
        else:
            # fewer rows than the build's `min_rows`: computed as that many copies of the row, in
            # buffers of this graph, and one result row copied out
            ng = n
            if n < L.min_rows:
                ng, wrows = L.min_rows, w.contents.ne[1]
                xp, yp = np.empty((ng, kcols), np.float32), np.empty((ng, wrows), np.float32)
                self._pad, ystride = (xp, yp, n, ystride * 4), wrows
            x = L.base.ggml_new_tensor_2d(self._ctx, TYPE["f32"], kcols, ng)
            y = L.base.ggml_mul_mat(self._ctx, w, x)
            y.contents.nb[1] = ystride * 4  # write straight into the caller's [n, all rows] output
            y.contents.nb[2] = y.contents.nb[3] = ystride * 4 * ng
            self._graph = L.base.ggml_new_graph_custom(self._ctx, 4, False)
            L.base.ggml_build_forward_expand(self._graph, y)
            self._x, self._y = x.contents, y.contents
            if self._pad is not None:
                self._x.data, self._y.data = self._pad[0].ctypes.data, self._pad[1].ctypes.data
        self._plan = L.cpu.ggml_graph_plan(self._graph, 1, None)
        self._work = np.empty(max(1, self._plan.work_size), np.uint8)
        self._plan.work_data = self._work.ctypes.data
        self._compute = L.cpu.ggml_graph_compute
        self._plan_ref = C.byref(self._plan)

    def run(self, x_ptr: int, y_ptr: int) -> None:
        if self._rows is not None:
            kb, yb = self._kbytes, self._ybytes
            for r, (x, y) in enumerate(self._rows):
                x.data = x_ptr + r * kb
                y.data = y_ptr + r * yb
            if self._compute(self._graph, self._plan_ref) != 0:
                raise KernelError("ggml_graph_compute failed")
            return
        if self._pad is not None:
            xp, yp, n, ybytes = self._pad
            xb, yb = xp.strides[0], yp.strides[0]
            for r in range(xp.shape[0]):  # the real rows, then copies of the first
                C.memmove(xp.ctypes.data + r * xb, x_ptr + (r if r < n else 0) * xb, xb)
            if self._compute(self._graph, self._plan_ref) != 0:
                raise KernelError("ggml_graph_compute failed")
            for r in range(n):
                C.memmove(y_ptr + r * ybytes, yp.ctypes.data + r * yb, yb)
            return
        self._x.data = x_ptr
        self._y.data = y_ptr
        if self._compute(self._graph, self._plan_ref) != 0:
            raise KernelError("ggml_graph_compute failed")

    def __del__(self) -> None:
        ctx = getattr(self, "_ctx", None)
        if ctx and _lib is not None:
            _lib.base.ggml_free(ctx)
            self._ctx = None


class MatMulCache:
    """Graphs of one matrix, by (rows of x, weight row range); a free list per key, so concurrent
    callers never share one graph's work buffer (list pop/append are atomic under the GIL)."""

    _MAX_KEYS = 96

    def __init__(self, wdata: np.ndarray, wtype: int, kcols: int, ystride: int, repacked: Repacked | None = None):
        self.wdata, self.wtype, self.kcols, self.ystride = wdata, wtype, kcols, ystride
        self.repacked = repacked
        self._free: dict[tuple[int, int, int], list[MulMat]] = {}

    def run(self, n: int, a: int, b: int, x_ptr: int, y_ptr: int) -> None:
        key = (n, a, b)
        free = self._free.get(key)
        if free is None:
            if len(self._free) >= self._MAX_KEYS:
                self._free.pop(next(iter(self._free)), None)
            free = self._free.setdefault(key, [])
        try:
            g = free.pop()
        except IndexError:
            if self.repacked is not None:
                g = MulMat(self.wdata, self.wtype, self.kcols, n, self.ystride, (self.repacked, a, b))
            else:
                g = MulMat(self.wdata[a:b], self.wtype, self.kcols, n, self.ystride)
        try:
            g.run(x_ptr + 0, y_ptr + a * 4)
        finally:
            free.append(g)


def to_float(fmt: str, src: np.ndarray, dst: np.ndarray) -> None:
    """Decode whole rows ``src`` (uint8/uint16 block bytes, C-contiguous) into float32 ``dst`` (same
    number of values), with ggml's own dequantizer."""
    lib().to_float[fmt](src.ctypes.data, dst.ctypes.data, dst.size)



_gelu_table: np.ndarray | None = None


def gelu_table() -> np.ndarray:
    """ggml's GELU at every float16 input, as float32 ``[65536]`` (indexed by the input's float16 bits):
    what ggml's own ``ggml_table_gelu_f16`` holds, taken from ggml by running its GELU once."""
    global _gelu_table
    if _gelu_table is None:
        L = lib()
        b = L.base
        x = np.arange(1 << 16, dtype=np.uint16).view(np.float16).astype(np.float32)
        x[~np.isfinite(x)] = 0.0
        y = np.empty_like(x)
        mem = np.empty(4 * int(b.ggml_tensor_overhead()) + int(b.ggml_graph_overhead_custom(8, False)) + 1024, np.uint8)
        ctx = b.ggml_init(_InitParams(mem.nbytes, mem.ctypes.data, True))
        try:
            b.ggml_gelu.restype, b.ggml_gelu.argtypes = _TP, [C.c_void_p, _TP]
            tx = b.ggml_new_tensor_2d(ctx, TYPE["f32"], x.size, 1)
            tx.contents.data = x.ctypes.data
            ty = b.ggml_gelu(ctx, tx)
            ty.contents.data = y.ctypes.data
            g = b.ggml_new_graph_custom(ctx, 8, False)
            b.ggml_build_forward_expand(g, ty)
            plan = L.cpu.ggml_graph_plan(g, 1, None)
            work = np.empty(max(1, plan.work_size), np.uint8)
            plan.work_data = work.ctypes.data
            if L.cpu.ggml_graph_compute(g, C.byref(plan)) != 0:
                raise KernelError("ggml_graph_compute failed")
        finally:
            b.ggml_free(ctx)
        _gelu_table = y
    return _gelu_table


def gelu(x: np.ndarray) -> np.ndarray:
    """GELU (tanh form) as ggml computes it for float32 (llama.cpp's Gemma FFN): looked up at the input
    rounded to float16; 0 from -10 down, the identity from 10 up. The compact backend's activation, so
    that an FFN shard computes what the one-graph step computes (`larql_edge.model.graph`)."""
    x = np.asarray(x, dtype=np.float32)
    y = gelu_table()[x.astype(np.float16).view(np.uint16)]
    y[x <= -10.0] = 0.0
    big = x >= 10.0
    if big.any():
        y[big] = x[big]
    return y
