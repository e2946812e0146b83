"""One FFN layer as ONE ggml graph: ``down(glu(gate x, up x))`` in a single ``ggml_graph_compute``.

What an FFN shard computes per request on compact weights, without Python between the products:
the gate and up products, ggml's fused ``geglu_split`` (Gemma: GELU from ggml's float16 table, the
same values `kernels._ggml.gelu` reads out of ggml) or ``swiglu_split`` (Llama), and the down
product, each weight read where it already lives: ggml's repacked copy for Q4_K (`_ggml.Repacked`),
else the stored blocks. The arithmetic is the product-by-product path's, op for op (ggml quantizes
each product's input to the weight type's ``vec_dot_type`` in both), so the values are the same bits
(tests/test_ffn_graph.py); what goes is ~3 ctypes round trips, a numpy GELU (five passes over the
intermediate) and the temporaries per layer: measured in benchmarks/ffn_profile.py (DESIGN.md §4.2).

A graph is built per (rows, weight types, shapes) and serves every layer of that kind: a call points
the three weight tensors at the layer's bytes and x/y at the caller's buffers, then computes. Graphs
are not re-entrant (their buffers hold the intermediates): a free list per key, as `MatMulCache`.

Threads: from `PARALLEL_FROM_MACS` (4+ rows of Gemma's FFN) a graph computes on the process's ggml
pool (`kernels._threads.graph_pool`); the floats are the one-thread graph's. A layer with a repacked
weight goes one row at a time (`kernels._ggml.ROW_BY_ROW`: ggml's repack gemm sums 4+ rows otherwise
than its gemv sums one): one chain of nodes per row, in the same graph (DESIGN.md §4.4).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np

from larql_edge.model.kernels import _ggml
from larql_edge.model.kernels._formats import FORMATS
from larql_edge.model.kernels._matrix import PARALLEL_FROM_MACS, CompactMatrix
from larql_edge.model.kernels._threads import get_threads, graph_pool

_F32 = 0
# Rows up to which a request's layer runs as one graph (above, each product's own row split and
# threads: the Python between products is then a small share; measured in benchmarks/ffn_profile.py).
MAX_ROWS = 64
_MAX_KEYS = 16
GLU = {"gelu_tanh": "ggml_geglu_split", "silu": "ggml_swiglu_split"}


@dataclass(frozen=True)
class _Weight:
    """Where ggml reads one weight from: (data, buffer, extra) pointers of its tensor."""

    fmt: str
    rows: int
    kcols: int  # padded columns (a whole number of blocks)
    data: int
    buffer: int | None
    extra: int | None

    @classmethod
    def of(cls, m: CompactMatrix) -> _Weight:
        fmt, data, rp = m.kernel_form()  # what the products read (a repacked or wider copy, or the stored bytes)
        kcols = FORMATS[fmt].padded_cols(m.shape[1])
        if rp is not None:
            return cls(fmt, m.shape[0], kcols, rp.base, rp.buffer, rp.extra)
        return cls(fmt, m.shape[0], kcols, data.ctypes.data, None, None)

    @property
    def kind(self) -> tuple:
        return (self.fmt, self.rows, self.kcols, self.buffer is not None)


def fusable(gate, up, down) -> bool:
    """The three products can run as one graph: ggml block types (not f32, whose reference is BLAS),
    shapes that chain, the intermediate a whole number of the down weight's blocks."""
    ms = (gate, up, down)
    if not all(isinstance(m, CompactMatrix) and m.fmt in _ggml.TYPE and m.fmt != "f32" for m in ms):
        return False
    inter, hidden = gate.shape
    return (up.shape == gate.shape and down.shape == (hidden, inter)
            and FORMATS[down.fmt].padded_cols(inter) == inter)


class _FfnStep:
    """One built graph: ``n`` rows through gate, up, glu, down; with ``per_row``, n one-row chains
    (a repacked weight's rows one by one, `kernels._ggml.ROW_BY_ROW`) in the same one graph."""

    def __init__(self, n: int, glu: str, kinds: tuple, per_row: bool = False):
        L = _ggml.lib()
        b = L.base
        (gf, grows, gk, grp), (uf, urows, uk, urp), (df, drows, dk, drp) = kinds
        nodes = 6 * n + 16 if per_row else 16
        mem = nodes * 2 * int(b.ggml_tensor_overhead()) + int(b.ggml_graph_overhead_custom(nodes, False)) + 1024
        self._mem = np.empty(mem, np.uint8)
        ctx = self._ctx = b.ggml_init(_ggml._InitParams(mem, self._mem.ctypes.data, True))
        if not ctx:
            raise _ggml.KernelError("ggml_init failed")
        self.hidden, self.kcols = drows, gk
        # x padded with zeros to the gate/up blocks' columns (written per call: only [:, :hidden])
        self.x = np.zeros((n, gk), np.float32)
        self._h = [np.empty((n, grows), np.float32) for _ in range(3)]  # gate x, up x, glu
        w = [b.ggml_new_tensor_2d(ctx, _ggml.TYPE[f], k, r) for f, r, k in ((gf, grows, gk), (uf, urows, uk), (df, drows, dk))]
        x = b.ggml_new_tensor_2d(ctx, _F32, gk, n)
        x.contents.data = self.x.ctypes.data
        self._graph = b.ggml_new_graph_custom(ctx, nodes, False)
        ys = []
        for r in range(n) if per_row else [None]:
            xr = x if r is None else b.ggml_view_2d(ctx, x, gk, 1, x.contents.nb[1], r * x.contents.nb[1])
            g = b.ggml_mul_mat(ctx, w[0], xr)
            u = b.ggml_mul_mat(ctx, w[1], xr)
            h = getattr(b, glu)(ctx, g, u)
            for t, buf in zip((g, u, h), self._h, strict=True):
                t.contents.data = buf[0 if r is None else r].ctypes.data
            y = b.ggml_mul_mat(ctx, w[2], h)
            y.contents.data = 1  # repointed at the caller's output per call (never computed before)
            b.ggml_build_forward_expand(self._graph, y)
            ys.append(y.contents)
        self._plans = _ggml.GraphPlans(self._graph)
        self._w = [t.contents for t in w]
        self._ys = ys

    def point(self, ws: tuple[_Weight, _Weight, _Weight], x: np.ndarray, out: np.ndarray) -> None:
        """Aim the graph at a layer's weights, the caller's rows and its output buffer."""
        self.x[:, : x.shape[1]] = x
        for t, wt in zip(self._w, ws, strict=True):
            t.data, t.buffer, t.extra = wt.data, wt.buffer, wt.extra
        for r, y in enumerate(self._ys):  # one output, or one per row (per_row)
            y.data = out.ctypes.data + r * out.strides[0]

    def run(self, threads: int, pool: int | None) -> None:
        """Compute on ``threads`` (`graph_pool`'s call): a product's floats do not depend on them,
        since ggml gives each thread whole dot products."""
        self._plans.compute(threads, pool)

    def __del__(self) -> None:
        ctx = getattr(self, "_ctx", None)
        if ctx and _ggml._lib is not None:
            _ggml._lib.base.ggml_free(ctx)
            self._ctx = None


class FfnGraphs:
    """The fused FFN of any number of layers of one activation; ``run(gate, up, down, x)``."""

    def __init__(self, activation: str):
        self.glu = GLU[activation]
        self._weights: dict[tuple[int, int, int], tuple[tuple[_Weight, _Weight, _Weight], tuple]] = {}
        self._free: dict[tuple, list[_FfnStep]] = {}
        self._lock = threading.Lock()

    def weights(self, gate: CompactMatrix, up: CompactMatrix, down: CompactMatrix) -> tuple[_Weight, _Weight, _Weight]:
        key = (id(gate), id(up), id(down))
        got = self._weights.get(key)
        if got is None:
            with self._lock:
                # the matrices are kept with their pointers: their ids cannot be reused meanwhile
                got = self._weights[key] = ((_Weight.of(gate), _Weight.of(up), _Weight.of(down)), (gate, up, down))
        return got[0]

    def takes(self, n: int) -> bool:
        """Whether ``n`` rows go through the graph: up to MAX_ROWS (above, the products' own row split)."""
        return 1 <= n <= MAX_ROWS

    def run(self, gate: CompactMatrix, up: CompactMatrix, down: CompactMatrix, x: np.ndarray,
            out: np.ndarray | None = None) -> np.ndarray:
        """``down(glu(gate x, up x))`` for float32 ``x`` ``[n, hidden]`` (n <= MAX_ROWS)."""
        ws = self.weights(gate, up, down)
        n = x.shape[0]
        if out is None:
            out = np.empty((n, ws[2].rows), np.float32)
        elif out.dtype != np.float32 or out.shape != (n, ws[2].rows) or not out.flags.c_contiguous:
            raise _ggml.KernelError(f"out must be a C-contiguous float32 [{n}, {ws[2].rows}] array")
        # a repacked weight: one row at a time, as its products do (kernels._ggml.ROW_BY_ROW)
        per_row = n > 1 and _ggml.ROW_BY_ROW and any(w.buffer is not None for w in ws)
        # fewer rows than the build's min_rows (a native ggml with llamafile's sgemm): that many
        # copies of the rows, so that one row is summed as it is among others (kernels._ggml.sgemm_min_rows)
        rows = n if per_row else max(n, _ggml.min_rows())
        key = (rows, per_row, ws[0].kind, ws[1].kind, ws[2].kind)
        free = self._free.get(key)
        if free is None:
            if len(self._free) >= _MAX_KEYS:
                self._free.pop(next(iter(self._free)), None)
            free = self._free.setdefault(key, [])
        try:
            st = free.pop()
        except IndexError:
            st = _FfnStep(rows, self.glu, key[2:], per_row)
        try:
            # the kernel threads where the products would split over them (PARALLEL_FROM_MACS); below
            # that, waking a second thread costs about what it saves
            threads = get_threads() if n * ws[0].rows * ws[0].kcols >= PARALLEL_FROM_MACS else 1
            if rows == n:
                st.point(ws, x, out)
                graph_pool.run(st, threads)
            else:
                xp, yp = np.empty((rows, x.shape[1]), np.float32), np.empty((rows, out.shape[1]), np.float32)
                xp[:n], xp[n:] = x, x[:1]
                st.point(ws, xp, yp)
                graph_pool.run(st, threads)
                out[:] = yp[:n]
        finally:
            free.append(st)
        return out
