"""The whole forward step as ONE ggml graph (the compact backend's fast path for a local model).

A step (the ids of one chunk, the KV cache, optionally the head) is a single ``ggml_graph_compute``:
every layer's norms, q/k/v/o products, q/k norms, RoPE, the KV write, masked softmax attention, the
FFN (gate/up products, fused GELU*up or SiLU*up, down), the post norms and residual adds, then the
final norm, lm_head and softcap on the last row. The arithmetic is llama.cpp's (the same ggml ops
on the GGUF's own blocks; activations quantized to each weight's ``vec_dot_type``), the Python cost
per token is a handful of buffer writes, and the threads are one persistent ggml thread pool.

Layout (ggml's ``ne`` order, fastest first):
- weights: ``[padded in, out]`` tensors whose ``data`` points at the vindex's memory-mapped blocks;
- K cache per layer: numpy ``[kv_heads, capacity, head_dim]``; V cache: ``[kv_heads * head_dim,
  capacity]`` (transposed, so that ``softmax(QK) @ V`` is a plain ``ggml_mul_mat``, as llama.cpp does
  without flash attention); float32, zero-filled (a masked position must hold a finite number);
- attention reads a window of ``L`` cache positions (``L`` rounded up to `_BUCKET`, so that a graph
  serves 64 consecutive steps), masked by a ``[seq, L]`` additive mask computed per step.

A graph is built per (rows, cache capacity, attended lengths, head or not) and reused; what changes
per step (the cache's write and read offsets, positions, mask, input rows) is written into buffers
and tensor ``data`` pointers before each compute. Measured figures: DESIGN.md §4.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from larql_edge.model.kernels import _ggml
from larql_edge.model.kernels._formats import FORMATS
from larql_edge.model.kernels._matrix import CompactMatrix
from larql_edge.model.kernels._threads import graph_pool
from larql_edge.model.spec import ModelSpec

_F32, _I32 = 0, 26  # ggml_type numbers
_ROPE_NORM, _ROPE_NEOX = 0, 2  # RoPE on adjacent pairs / on halves (GGML_ROPE_TYPE_NEOX)
_BUCKET = 64  # attended lengths are rounded up to this: one graph serves this many decode steps.
# 64, not 32: an AVX-512 build of ggml sums an f16 dot product 64 values at a time (GGML_F16_STEP) and
# a shorter one in a scalar tail, so with 32 a row attending 32 keys and one attending 64 (the masked
# half zeros) summed in other orders; 64 is a whole step on AVX2 and AVX-512 alike (DESIGN.md §4.3)
_CHUNK = 64  # a longer prompt is computed in chunks of this many rows (bounded graph buffers)
_FIRST_CAPACITY = 256
_MAX_GRAPHS = 8
# Tracing (benchmarks/llama_cpp_trace.py): graphs built while this is set name their tensors as
# llama.cpp's graph does ("Qcur-3", "kq-3", ...) and keep every node's result (all marked outputs, so
# the allocator reuses no buffer), to be read back after a compute and compared op by op.
TRACE = False


@dataclass
class GraphCache:
    """The KV cache of the graph path: every position kept (rollback needs no slack), in buffers ggml
    reads and writes in place. Same interface as `forward.KVCache` (``length``, ``truncate``)."""

    num_layers: int
    kv_heads: int
    head_dim: int
    dtype: type = np.float16  # llama.cpp's default KV type (its rounding is part of the arithmetic)
    capacity: int = 0
    length: int = 0
    slack: int = 0  # accepted for KVCache's interface; nothing is trimmed here
    k: list[np.ndarray] = field(default_factory=list, repr=False)
    v: list[np.ndarray] = field(default_factory=list, repr=False)
    addrs: list[tuple[int, int]] = field(default_factory=list, repr=False)  # each layer's (K, V) buffer address

    def reserve(self, n: int) -> None:
        """Room for ``n`` positions (grows by doubling; the kept positions are copied)."""
        if n <= self.capacity:
            return
        cap = max(_FIRST_CAPACITY, self.capacity)
        while cap < n:
            cap *= 2
        k: list[np.ndarray] = [np.zeros((self.kv_heads, cap, self.head_dim), self.dtype) for _ in range(self.num_layers)]
        v: list[np.ndarray] = [np.zeros((self.kv_heads * self.head_dim, cap), self.dtype) for _ in range(self.num_layers)]
        for i in range(len(self.k)):
            k[i][:, : self.length] = self.k[i][:, : self.length]
            v[i][:, : self.length] = self.v[i][:, : self.length]
        self.k, self.v, self.capacity = k, v, cap
        self.addrs = [(a.ctypes.data, b.ctypes.data) for a, b in zip(k, v, strict=True)]

    def truncate(self, length: int, windows: Sequence[int | None] | None = None) -> None:
        """Forget the positions from ``length`` on (speculative decoding's rollback)."""
        if length > self.length or length < 0:
            raise ValueError(f"cannot truncate a cache of {self.length} positions to {length}")
        self.length = length


def _rounded(n: int, cap: int) -> int:
    return min(cap, -(-n // _BUCKET) * _BUCKET)


class _Step:
    """One built graph: ``seq`` rows through every layer (and the head when ``head``); or, with
    ``layer`` set, that one layer's attention half only (the split grid's client: the FFN is remote),
    whose outputs are the residual after attention (``out``) and the FFN's normed input (``out_x``)."""

    def __init__(self, eng: "GraphEngine", seq: int, cap: int, lens: dict[int | None, int], head: bool,
                 layer: int | None = None, alone: bool = False):
        L = _ggml.lib()
        b = L.base
        s = eng.spec

        def mm(ctx, m, x):  # every weight product of this graph (``alone``: see GraphEngine.step)
            return eng.mm(ctx, m, x, alone)

        self.seq, self.cap, self.lens, self.head = seq, cap, lens, head
        hd, nq, nkv, hid = s.head_dim, s.num_q_heads, s.num_kv_heads, s.hidden_size
        self.layer_ids = list(range(s.num_layers)) if layer is None else [layer]
        # ``alone``: a repacked weight's product is a view, a product and a concat per row (7 weights a layer at most)
        n_nodes = (64 + (7 * 3 * seq if alone else 0)) * len(self.layer_ids) + 64
        mem = n_nodes * 3 * int(b.ggml_tensor_overhead()) + int(b.ggml_graph_overhead_custom(n_nodes * 2, False)) + 4096
        self._mem = np.empty(mem, np.uint8)
        ctx = self._ctx = b.ggml_init(_ggml._InitParams(mem, self._mem.ctypes.data, True))
        if not ctx:
            raise _ggml.KernelError("ggml_init failed")
        keep: list[np.ndarray] = []  # numpy buffers some tensor points into
        self._keep = keep

        def leaf(arr: np.ndarray, t):
            t.contents.data = arr.ctypes.data
            keep.append(arr)
            return t

        # per-step inputs, filled before each compute
        self.inp = np.zeros((seq, hid), np.float32)
        self.pos = np.zeros(seq, np.int32)
        self.masks = {w: np.zeros((seq, n), np.float32) for w, n in lens.items()}
        inp = leaf(self.inp, b.ggml_new_tensor_2d(ctx, _F32, hid, seq))
        pos = leaf(self.pos, b.ggml_new_tensor_1d(ctx, _I32, seq))
        masks = {w: leaf(m, b.ggml_new_tensor_2d(ctx, _F32, m.shape[1], seq)) for w, m in self.masks.items()}
        # the caches: one base tensor per layer (data set per step through the views below)
        f4 = np.dtype(eng.kv_dtype).itemsize  # bytes per cached value
        kv_type = _ggml.TYPE["f16" if f4 == 2 else "f32"]
        self.k_write, self.v_write, self.k_read, self.v_read = [], [], [], []
        gf = self._graph = b.ggml_new_graph_custom(ctx, n_nodes * 2, False)
        cur = inp
        named: dict[str, list] = {}  # name -> its tensors, in graph order (TRACE only)
        self.named = named

        def nm(t, name: str, li: int | None = None):
            if TRACE:
                full = name if li is None else f"{name}-{li}"
                b.ggml_set_name(t, full.encode())
                named.setdefault(full, []).append(t)
            return t

        for li in self.layer_ids:
            lw = eng.layers[li]
            window = s.sliding_window if s.is_sliding(li) else None
            n_att = lens[window]
            kc = b.ggml_new_tensor_3d(ctx, kv_type, hd, cap, nkv)
            vc = b.ggml_new_tensor_2d(ctx, kv_type, cap, nkv * hd)
            kc.contents.data = vc.contents.data = 1  # placeholder (never read): views need a non-null base
            x = nm(eng.norm(ctx, cur, lw.pre_attn), "attn_norm", li)
            q = b.ggml_reshape_3d(ctx, nm(mm(ctx, lw.q, x), "Qcur", li), hd, nq, seq)
            k = b.ggml_reshape_3d(ctx, nm(mm(ctx, lw.k, x), "Kcur", li), hd, nkv, seq)
            v = nm(mm(ctx, lw.v, x), "Vcur", li)  # [nkv*hd, seq]
            if lw.q_norm is not None:
                q = nm(eng.norm(ctx, q, lw.q_norm, s.rms_norm_eps), "Qcur_normed", li)
                k = nm(eng.norm(ctx, k, lw.k_norm, s.rms_norm_eps), "Kcur_normed", li)
            base = float(s.rope_base_for(li))
            rm = eng.rope_mode
            q = nm(b.ggml_rope_ext(ctx, q, pos, None, hd, rm, 0, base, 1.0, 0.0, 1.0, 0.0, 0.0), "Qcur", li)
            k = nm(b.ggml_rope_ext(ctx, k, pos, None, hd, rm, 0, base, 1.0, 0.0, 1.0, 0.0, 0.0), "Kcur", li)
            # write this chunk's keys and values into the cache, before the attention reads it
            kw = b.ggml_view_3d(ctx, kc, hd, nkv, seq, cap * hd * f4, hd * f4, 0)
            vw = b.ggml_view_2d(ctx, vc, seq, nkv * hd, cap * f4, 0)
            # (a copy's result is a view of its destination with the data pointer copied at build
            # time: that result is what the compute writes through, so that is what gets repointed)
            kw = b.ggml_cpy(ctx, k, kw)
            vw = b.ggml_cpy(ctx, b.ggml_transpose(ctx, v), vw)
            b.ggml_build_forward_expand(gf, kw)
            b.ggml_build_forward_expand(gf, vw)
            kr = b.ggml_view_3d(ctx, kc, hd, n_att, nkv, hd * f4, cap * hd * f4, 0)
            vr = b.ggml_view_3d(ctx, vc, n_att, hd, nkv, cap * f4, cap * hd * f4, 0)
            self.k_write.append(kw.contents)
            self.v_write.append(vw.contents)
            self.k_read.append(kr.contents)
            self.v_read.append(vr.contents)
            kq_scale = float(s.attn_scale)
            if eng.scale_q:  # Gemma in llama.cpp: q scaled before QK, softmax unscaled (same math, its rounding)
                q, kq_scale = b.ggml_scale(ctx, q, kq_scale), 1.0
            kq = nm(_ggml.mul_mat(ctx, kr, b.ggml_permute(ctx, q, 0, 2, 1, 3)), "kq", li)  # [n_att, seq, nq]
            if seq < _ggml.min_rows():  # a view of the padded rows' product: softmax wants it whole
                kq = b.ggml_cont(ctx, kq)
            if s.attn_logit_softcapping:
                cap_ = float(s.attn_logit_softcapping)
                kq = b.ggml_scale(ctx, b.ggml_tanh(ctx, b.ggml_scale(ctx, kq, kq_scale / cap_)), cap_)
                kq_scale = 1.0
            kq = nm(b.ggml_soft_max_ext(ctx, kq, masks[window], kq_scale, 0.0), "kq_soft_max", li)
            o = nm(_ggml.mul_mat(ctx, vr, kq), "kqv", li)  # [hd, seq, nq]
            o = nm(b.ggml_cont_2d(ctx, b.ggml_permute(ctx, o, 0, 2, 1, 3), hd * nq, seq), "kqv_out", li)
            a = nm(mm(ctx, lw.o, o), "attn_out", li)
            if lw.post_attn is not None:
                a = nm(eng.norm(ctx, a, lw.post_attn), "attn_post_norm", li)
            cur = nm(b.ggml_add(ctx, cur, a), "sa_out" if lw.post_attn is not None else "ffn_inp", li)
            x = nm(eng.norm(ctx, cur, lw.pre_ffn), "ffn_norm", li)
            if layer is not None:  # attention only: the FFN input leaves the graph too
                self.out_x = np.zeros((seq, hid), np.float32)
                b.ggml_build_forward_expand(gf, b.ggml_cpy(ctx, x, leaf(self.out_x, b.ggml_new_tensor_2d(ctx, _F32, hid, seq))))
                break
            g, u = nm(mm(ctx, lw.gate, x), "ffn_gate", li), nm(mm(ctx, lw.up, x), "ffn_up", li)
            f = nm(mm(ctx, lw.down, nm(eng.glu(ctx, g, u), "ffn_" + eng.glu_name[5:-6], li)), "ffn_out", li)
            if lw.post_ffn is not None:
                f = nm(eng.norm(ctx, f, lw.post_ffn), "ffn_post_norm", li)
            cur = nm(b.ggml_add(ctx, cur, f), "l_out", li)
        if head:
            last = b.ggml_view_2d(ctx, cur, hid, 1, cur.contents.nb[1], (seq - 1) * cur.contents.nb[1])
            y = nm(mm(ctx, eng.lm_head, nm(eng.norm(ctx, last, eng.final_norm), "result_norm")), "result_output")
            if s.final_logit_softcapping:
                c = float(s.final_logit_softcapping)
                y = b.ggml_scale(ctx, b.ggml_tanh(ctx, b.ggml_scale(ctx, y, 1.0 / c)), c)
            self.out = np.zeros(eng.spec.vocab_size if eng.lm_head is None else eng.lm_head.shape[0], np.float32)
        else:
            y = cur
            self.out = np.zeros((seq, hid), np.float32)
        # the result lands in our buffer (the allocator leaves a tensor with data alone)
        y = b.ggml_cpy(ctx, y, leaf(self.out, b.ggml_new_tensor_2d(ctx, _F32, self.out.shape[-1], 1 if head else seq)))
        b.ggml_build_forward_expand(gf, y)
        self.n_nodes = b.ggml_graph_n_nodes(gf)
        if TRACE:
            for ts in named.values():
                for t in ts:
                    b.ggml_set_output(t)
        self._galloc = b.ggml_gallocr_new(b.ggml_backend_cpu_buffer_type())
        if not b.ggml_gallocr_alloc_graph(self._galloc, gf):
            raise _ggml.KernelError("ggml_gallocr_alloc_graph failed")
        self.buffer_bytes = int(b.ggml_gallocr_get_buffer_size(self._galloc, 0))
        self._plans = _ggml.GraphPlans(self._graph)

    def run(self, threads: int, pool: int | None) -> None:
        self._plans.compute(threads, pool)

    def __del__(self) -> None:
        lib = _ggml._lib
        if lib is None:
            return
        if getattr(self, "_galloc", None):
            lib.base.ggml_gallocr_free(self._galloc)
            self._galloc = None
        if getattr(self, "_ctx", None):
            lib.base.ggml_free(self._ctx)
            self._ctx = None


@dataclass
class _Layer:
    q: CompactMatrix
    k: CompactMatrix
    v: CompactMatrix
    o: CompactMatrix
    gate: CompactMatrix | None  # None: the FFN is remote (attention-only graphs)
    up: CompactMatrix | None
    down: CompactMatrix | None
    q_norm: np.ndarray | None
    k_norm: np.ndarray | None
    pre_attn: np.ndarray
    post_attn: np.ndarray | None
    pre_ffn: np.ndarray
    post_ffn: np.ndarray | None


def graphable(m) -> bool:
    return isinstance(m, CompactMatrix) and m.fmt in _ggml.TYPE


class GraphEngine:
    """Runs a local model's steps as ggml graphs. Built from the Transformer's own weights (no copy:
    the weight tensors point at the CompactMatrix bytes, the vindex's memory map)."""

    def __init__(self, spec: ModelSpec, attn: list, ffn: list | None, head_matrix: CompactMatrix | None,
                 final_norm: np.ndarray | None, kv_dtype: type = np.float16, embed_matrix: CompactMatrix | None = None):
        self.spec = spec
        self.kv_dtype = kv_dtype
        self.scale_q = spec.family.name.startswith("gemma")
        # token rows from the tied Q8_0 head when it holds the source's own values (`embed`)
        self.embed_matrix = embed_matrix
        off = np.float32(spec.family.norm_offset)

        def nw(w):  # Gemma multiplies by (1 + w): folded once here, as llama.cpp's GGUF does
            return None if w is None else np.ascontiguousarray((w + off) if off else w, dtype=np.float32)

        # The vindex keeps Hugging Face's q/k row order (rotate-half RoPE). For the families whose GGUF
        # llama.cpp permutes (Llama: RoPE on adjacent pairs), the graph takes its q/k rows in the GGUF's
        # order and RoPE on pairs: the same values, but QK^T then sums each head's dimensions in
        # llama.cpp's order, bit for bit its kq (in Hugging Face's order ~10% of kq differed in the last
        # bits: DESIGN.md §4.1). The copies are small (q and k: ~8 MB for SmolLM2-135M's Q4_1).
        permute = spec.family.gguf_permutes_qk
        self.rope_mode = _ROPE_NORM if permute else _ROPE_NEOX
        hd = spec.head_dim
        pair = np.arange(hd).reshape(2, hd // 2).T.reshape(-1)  # GGUF dimension i <- Hugging Face's pair[i]

        def qk(m, heads):
            if not permute:
                return m
            rows = (np.arange(heads)[:, None] * hd + pair[None, :]).reshape(-1)
            return CompactMatrix(m.fmt, m.shape, np.ascontiguousarray(m.data[rows]))

        def qk_norm(w):
            return nw(w) if w is None or not permute else nw(w[pair])

        nq, nkv = spec.num_q_heads, spec.num_kv_heads
        self.layers = [
            _Layer(qk(a.q, nq), qk(a.k, nkv), a.v, a.o, f and f.gate, f and f.up, f and f.down,
                   qk_norm(a.q_norm), qk_norm(a.k_norm),
                   nw(a.pre_attn_norm), nw(a.post_attn_norm), nw(a.pre_ffn_norm), nw(a.post_ffn_norm))
            for a, f in zip(attn, ffn or [None] * len(attn), strict=True)
        ]
        self.has_ffn = ffn is not None
        self.lm_head = head_matrix
        self.final_norm = nw(final_norm)
        self.glu_name = {"gelu_tanh": "ggml_geglu_split", "silu": "ggml_swiglu_split"}[spec.family.activation]
        self._weights: dict[int, tuple] = {}  # id(matrix) -> (tensor, ctx memory) in a weights context
        self._graphs: OrderedDict[tuple, _Step] = OrderedDict()  # LRU
        self._layer_kind = [spec.sliding_window if spec.is_sliding(i) else None for i in range(spec.num_layers)]
        self._kinds = sorted(set(self._layer_kind), key=lambda w: w or 0)
        self._lock = threading.Lock()
        self._wmem: np.ndarray | None = None
        self._wctx = None

    # -- graph building helpers (called by _Step) -----------------------------------------------

    def _weights_ctx(self):
        if self._wctx is None:
            b = _ggml.lib().base
            n = 16 * (len(self.layers) + 2) + 64
            self._wmem = np.empty(n * int(b.ggml_tensor_overhead()), np.uint8)
            self._wctx = b.ggml_init(_ggml._InitParams(self._wmem.nbytes, self._wmem.ctypes.data, True))
        return self._wctx

    def _weight(self, m: CompactMatrix):
        t = self._weights.get(id(m))
        if t is None:
            b = _ggml.lib().base
            ctx = self._weights_ctx()
            rows, cols = m.shape
            keep: Any  # what the tensor's data points into
            fmt, data, rp = ("f32", np.ascontiguousarray(m.data, dtype=np.float32), None) if m.fmt == "f32" else m.kernel_form()
            if rp is not None:
                # ggml's repacked copy, as llama.cpp's CPU_REPACK buffer holds its weights by default:
                # its gemm/gemv kernels sum in their own order, so using them is both llama.cpp's
                # arithmetic (bit for bit, DESIGN.md §4.1) and faster (§4)
                w, keep = rp.tensor(ctx, 0, rows), rp
            else:
                # the stored bytes, or the copy the products read (Q5_0 as Q8_0: the same floats)
                ne0 = cols if fmt == "f32" else FORMATS[fmt].padded_cols(cols)
                w = b.ggml_new_tensor_2d(ctx, _ggml.TYPE[fmt], ne0, rows)
                if w.contents.nb[1] != data.strides[0]:
                    raise _ggml.KernelError(f"weight row bytes {data.strides[0]} != ggml's {w.contents.nb[1]}")
                w.contents.data = data.ctypes.data
                keep = data
            t = self._weights[id(m)] = (w, keep, m)
        return t[0]

    def mm(self, ctx, m: Any, x, alone: bool = False):
        b = _ggml.lib().base
        w = self._weight(m)
        pad = w.contents.ne[0] - x.contents.ne[0]
        if pad:
            x = b.ggml_pad(ctx, x, pad, 0, 0, 0)
        return _ggml.mul_mat(ctx, w, x, alone)

    def norm(self, ctx, x, w: Any, eps: float | None = None):
        b = _ggml.lib().base
        t = self._vec(w)
        return b.ggml_mul(ctx, b.ggml_rms_norm(ctx, x, float(self.spec.rms_norm_eps if eps is None else eps)), t)

    def _vec(self, w: np.ndarray):
        t = self._weights.get(id(w))
        if t is None:
            b = _ggml.lib().base
            v = b.ggml_new_tensor_1d(self._weights_ctx(), _F32, w.shape[0])
            v.contents.data = w.ctypes.data
            t = self._weights[id(w)] = (v, w, None)
        return t[0]

    def __del__(self) -> None:
        self._graphs.clear()  # the graphs point at the weight tensors: they go first
        if self._wctx is not None and _ggml._lib is not None:
            _ggml._lib.base.ggml_free(self._wctx)
            self._wctx = None

    def glu(self, ctx, g, u):
        return getattr(_ggml.lib().base, self.glu_name)(ctx, g, u)

    # -- running -----------------------------------------------------------------------------------

    def embed(self, ids) -> np.ndarray | None:
        """Scaled input rows decoded by ggml from the tied quantized table (llama.cpp's ``get_rows``),
        or None: the embedder's rows are the same values."""
        if self.embed_matrix is None:
            return None
        idx = np.asarray(ids, dtype=np.int64)
        if idx.size and (idx.min() < 0 or idx.max() >= self.embed_matrix.shape[0]):
            raise ValueError(f"token id out of range [0, {self.embed_matrix.shape[0]})")
        rows = self.embed_matrix.rows(idx)
        if self.spec.embed_scale != 1.0:
            rows *= np.float32(self.spec.embed_scale)
        return rows

    def new_cache(self, slack: int = 0) -> GraphCache:
        s = self.spec
        return GraphCache(s.num_layers, s.num_kv_heads, s.head_dim, self.kv_dtype, slack=slack)

    def _graph(self, seq: int, cap: int, lens: tuple, head: bool, layer: int | None = None,
               alone: bool = False) -> _Step:
        alone = alone and seq > 1
        key = (seq, cap, lens, head, layer, alone)
        graphs = self._graphs
        g = graphs.get(key)
        if g is None:
            g = graphs[key] = _Step(self, seq, cap, dict(lens), head, layer, alone)
            while len(graphs) > _MAX_GRAPHS * (1 if layer is None else len(self.layers)):
                graphs.popitem(last=False)
        else:
            graphs.move_to_end(key)
        return g

    def step(self, rows: np.ndarray, cache: GraphCache, head: bool, alone: bool = False) -> np.ndarray:
        """``rows`` (embedded, ``[seq, hidden]``) through every layer, appended to ``cache``; returns
        the logits of the last row ``[vocab]`` (``head``) or the residual ``[seq, hidden]``.

        ``alone``: every row gets the floats it would get in a step of its own (speculation's verify
        rows against plain decoding): a repacked weight then multiplies the rows one by one
        (`_ggml.mul_mat`). Without it (a prompt's prefill) ggml sums 4+ rows of those weights in its
        gemm, as llama.cpp's prefill does (DESIGN.md §4.4)."""
        seq = rows.shape[0]
        if seq == 0:
            raise ValueError("no ids to run: a step needs at least one row")
        if head and seq > _CHUNK:
            self.step(rows[:-_CHUNK], cache, False, alone)
            return self.step(rows[-_CHUNK:], cache, True, alone)
        if seq > _CHUNK:
            return np.concatenate([self.step(rows[i : i + _CHUNK], cache, False, alone) for i in range(0, seq, _CHUNK)])
        with self._lock:
            st = self.begin(seq, cache)
            g = self._graph(seq, cache.capacity, st.lens, head, alone=alone)
            self._bind(g, rows, cache, st)
            graph_pool.run(g)
            cache.length = st.end
            return g.out.copy()

    def begin(self, seq: int, cache: GraphCache) -> "_StepState":
        """What one step of ``seq`` rows needs: room in the cache, each window kind's first attended
        position and length (a multiple of _BUCKET), positions and additive masks."""
        start = cache.length
        end = start + seq
        cache.reserve(end)
        cap = cache.capacity
        spans, lens, masks = {}, [], {}
        pos = np.arange(start, end, dtype=np.int32)
        q_pos = pos[:, None]
        for w in self._kinds:
            # The first attended position is a multiple of _BUCKET: a key then sits at the same index
            # modulo the SIMD step whatever rows come in the step, so ggml sums a row's softmax and
            # softmax @ V in the same order (the extra masked positions add exact zeros). Started at
            # the oldest key in the window, a sliding layer's row summed in another order in company:
            # greedy speculation parted from plain decoding (issue 18).
            lo = 0 if w is None else max(0, start - w + 1) // _BUCKET * _BUCKET
            n = _rounded(end - lo, cap)
            a = spans[w] = min(lo, cap - n)
            lens.append((w, n))
            k_pos = np.arange(a, a + n, dtype=np.int32)[None, :]
            ok = k_pos <= q_pos
            if w is not None:
                ok &= (q_pos - k_pos) < w
            masks[w] = np.where(ok, np.float32(0), np.float32(-np.inf))
        return _StepState(start, end, spans, tuple(lens), pos, masks)

    def _bind(self, g: _Step, rows: np.ndarray, cache: GraphCache, st: "_StepState") -> None:
        g.inp[:] = rows
        g.pos[:] = st.pos
        for w, m in st.masks.items():
            g.masks[w][:] = m
        esz = np.dtype(self.kv_dtype).itemsize
        hdb, start = self.spec.head_dim * esz, st.start
        kw, vw, kr, vr = g.k_write, g.v_write, g.k_read, g.v_read
        for j, i in enumerate(g.layer_ids):
            kb, vb = cache.addrs[i]
            a = st.spans[self._layer_kind[i]]
            kw[j].data = kb + start * hdb
            vw[j].data = vb + start * esz
            kr[j].data = kb + a * hdb
            vr[j].data = vb + a * esz

    def attention(self, layer: int, h: np.ndarray, cache: GraphCache, st: "_StepState",
                  alone: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """One layer's attention half as a graph (the FFN is elsewhere): the residual after attention
        and the FFN's normed input, both ``[seq, hidden]``. ``st`` from `begin`; the caller sets
        ``cache.length = st.end`` after the last layer. ``alone``: as `step`."""
        with self._lock:
            g = self._graph(h.shape[0], cache.capacity, st.lens, False, layer, alone)
            self._bind(g, h, cache, st)
            graph_pool.run(g)
            return g.out.copy(), g.out_x.copy()


@dataclass
class _StepState:
    start: int
    end: int
    spans: dict
    lens: tuple
    pos: np.ndarray
    masks: dict
