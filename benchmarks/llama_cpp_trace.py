"""Where the one-graph step's arithmetic and llama.cpp's part, op by op, from llama.cpp's own tensors.

    python benchmarks/llama_cpp_trace.py [--model gemma3-270m] [--prompt 5] [--steps 12] [--layers 2]
                                         [--no-extra-buffers] [--no-tiled-mm]
                                         [--out benchmarks/results/llama_cpp_trace.txt]
    python benchmarks/llama_cpp_trace.py --kq [--model smollm2-135m] [--prompt 4] [--layer 1]
                                         [--out benchmarks/results/llama_cpp_trace-native.txt]

Needs ``llama_cpp`` (see benchmarks/llama_cpp_parity.py), run in its own process (its ggml 0.25 and the
libggml-python wheel's 0.20 share library names: in one process one binds the other's symbols).

Op by op (the default): llama.cpp prefills a golden prompt (tests/data/llama_cpp_greedy.json) and then
decodes ``--steps`` tokens fed from the golden file, with an eval callback that copies out its named
tensors (``attn_norm-3``, ``Qcur-3``, ``kq-3``, ``kq_soft_max-3``, ``kqv_out-3``, ``ffn_out-3``, ``l_out-3``,
``result_output``, ...). The one-graph step (`larql_edge.model.graph`, built with ``graph.TRACE``: its
tensors carry llama.cpp's names and every node's result is kept) runs the same ids. Per step: whether the
logits are bitwise equal, and every named op (in llama.cpp's graph order; attention scores on the causal
entries only) whose result is not, with the share of equal entries. The first op listed is where the two
implementations' arithmetic parts; what follows it is that difference carried on.

``--kq`` (the native-build analysis of DESIGN.md §4.1): llama.cpp's kq of one layer recomputed from its
own q, k three ways:

- ggml's ``mul_mat`` of the libggml-python wheel, which the one-graph step runs (its AVX2 ``vec_dot_f16``:
  4 accumulators of 8 lanes);
- an emulation of that same ``vec_dot_f16`` order in numpy (checks the emulation);
- an emulation of llamafile's tinyBLAS f16 kernel as llama.cpp's native AVX-512 build runs it (one
  accumulator of 16 lanes per output, summed by ``_mm512_reduce_add_ps``).

The share of causal entries each equals bit for bit is the result: the two libraries sum the same exact
products in different orders, so about half of the QK^T entries differ in their last bits (relative ~1e-7).
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
from pathlib import Path

for _v in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_v] = "1"
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

F32 = np.float32


def _reduce512(x: np.ndarray) -> np.ndarray:
    """``_mm512_reduce_add_ps`` of 16 float32 lanes: halves added, down to one lane."""
    while x.shape[-1] > 1:
        h = x.shape[-1] // 2
        x = (x[..., :h] + x[..., h:]).astype(F32)
    return x[..., 0]


def _reduce256(x: np.ndarray) -> np.ndarray:
    """ggml's AVX2 reduce of 8 float32 lanes: the two 128-bit halves added, then two ``hadd`` (adjacent pairs)."""
    t = (x[..., :4] + x[..., 4:]).astype(F32)
    return ((t[..., 0] + t[..., 1]).astype(F32) + (t[..., 2] + t[..., 3]).astype(F32)).astype(F32)


def vec_dot_avx2(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """ggml_vec_dot_f16 on AVX2: 4 accumulators of 8 lanes over steps of 32, then reduced (the
    AVX2 build's reduce adds accumulators 0+2, 1+3, then 0+1; hd is a multiple of 32 here)."""
    hd = x.shape[-1]
    acc = np.zeros(np.broadcast_shapes(x.shape, y.shape)[:-1] + (4, 8), F32)
    for s in range(0, hd, 32):
        for j in range(4):
            a = s + 8 * j
            acc[..., j, :] = (acc[..., j, :] + x[..., a : a + 8] * y[..., a : a + 8]).astype(F32)
    acc[..., 0, :] += acc[..., 2, :]
    acc[..., 1, :] += acc[..., 3, :]
    acc[..., 0, :] += acc[..., 1, :]
    return _reduce256(acc[..., 0, :])


def tinyblas_avx512(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """llamafile's tinyBLAS f16 gemm on AVX-512: one 16-lane FMA accumulator per output, then a reduce."""
    hd = x.shape[-1]
    acc = np.zeros(np.broadcast_shapes(x.shape, y.shape)[:-1] + (16,), F32)
    for s in range(0, hd, 16):
        acc = (acc + x[..., s : s + 16] * y[..., s : s + 16]).astype(F32)
    return _reduce512(acc)


NAMES = ("attn_norm", "Qcur", "Kcur", "Vcur", "Qcur_normed", "Kcur_normed", "kq", "kq_soft_max", "kqv", "kqv_out",
         "attn_out", "attn_post_norm", "sa_out", "ffn_inp", "ffn_norm", "ffn_gate", "ffn_up", "ffn_geglu", "ffn_swiglu",
         "ffn_out", "ffn_post_norm", "l_out")


def llama_cpp_tensors(gguf: Path, ids: list[int], feed: list[int], wanted: set[str], extra_buffers: bool,
                      tiled_mm: bool = True) -> dict:
    """llama.cpp's float32 tensors named in ``wanted`` while it prefills ``ids`` (step 0) and then
    decodes each token of ``feed`` (steps 1, 2, ...): ``{"tensors": [(step, name, array)], "logits":
    [per step]}``, every occurrence in graph order (the last Qcur/Kcur is the one after RoPE)."""
    if not tiled_mm:
        os.environ["GGML_CPU_TILED_MM"] = "0"  # read once, at ggml's first product
    import llama_cpp
    import llama_cpp.llama as llama_py
    import llama_cpp.llama_cpp as low

    from larql_edge.model.kernels._ggml import _Tensor  # the struct layout only (no library loaded)

    base = ctypes.CDLL(str(Path(llama_cpp.__file__).parent / "lib" / "libggml-base.so"))
    base.ggml_nbytes.restype, base.ggml_nbytes.argtypes = ctypes.c_size_t, [ctypes.c_void_p]
    got: list = []
    step = [0]

    @low.ggml_backend_sched_eval_callback
    def callback(t, ask, _user):
        tt = ctypes.cast(t, ctypes.POINTER(_Tensor)).contents
        name = tt.name.decode()
        if ask:
            return name in wanted
        if tt.type == 0:  # float32
            raw = np.frombuffer(bytes((ctypes.c_char * base.ggml_nbytes(t)).from_address(tt.data)), F32)
            a = np.lib.stride_tricks.as_strided(raw, shape=list(tt.ne)[::-1], strides=list(tt.nb)[::-1])
            got.append((step[0], name, np.array(a)))
        return True

    ctx_defaults, model_defaults = low.llama_context_default_params, low.llama_model_default_params

    def ctx_params():
        p = ctx_defaults()
        p.cb_eval = callback
        return p

    def model_params():
        p = model_defaults()
        p.use_extra_bufts = extra_buffers
        return p

    # `Llama` exposes neither the eval callback nor use_extra_bufts: its defaults are wrapped for the load.
    llama_py.llama_cpp.llama_context_default_params = ctx_params
    llama_py.llama_cpp.llama_model_default_params = model_params
    try:
        m = llama_cpp.Llama(model_path=str(gguf), n_threads=1, n_threads_batch=1, n_ctx=128, verbose=False,
                            logits_all=True)
        m.eval(ids)
        logits = [np.array(m.scores[m.n_tokens - 1], F32)]
        for i, tok in enumerate(feed):
            step[0] = i + 1
            m.eval([tok])
            logits.append(np.array(m.scores[m.n_tokens - 1], F32))
    finally:
        llama_py.llama_cpp.llama_context_default_params = ctx_defaults
        llama_py.llama_cpp.llama_model_default_params = model_defaults
    return {"tensors": got, "logits": logits, "version": llama_cpp.__version__,
            "system_info": llama_cpp.llama_print_system_info().decode().strip()}


def _llama(fn, *args, **kwargs):
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context

    with ProcessPoolExecutor(1, mp_context=get_context("spawn")) as ex:
        return ex.submit(fn, *args, **kwargs).result()


def graph_tensors(alias: str, ids: list[int], feed: list[int]) -> dict:
    """The one-graph step's named tensors for the same steps, as `llama_cpp_tensors` returns them."""
    from larql_edge.model import graph as G
    from larql_edge.model.forward import Transformer
    from larql_edge.model.kernels import _ggml
    from larql_edge.tools.slicer.cache import cached_vindex

    G.TRACE = True
    m = Transformer.local(str(cached_vindex(alias, quant="gguf", log=lambda m: None)))
    eng = m.engine()
    base = _ggml.lib().base
    got: list = []

    def read(step: int) -> None:
        g = next(reversed(eng._graphs.values()))  # the graph this step ran
        for name, ts in g.named.items():
            for t in ts:
                tt = t.contents
                if tt.type == 0:
                    raw = np.frombuffer((ctypes.c_char * int(base.ggml_nbytes(t))).from_address(tt.data), F32)
                    a = np.lib.stride_tricks.as_strided(raw, shape=list(tt.ne)[::-1], strides=list(tt.nb)[::-1])
                    got.append((step, name, np.array(a)))

    cache = m.new_cache()
    logits = [m.next_logits(ids, cache)]
    read(0)
    for i, tok in enumerate(feed):
        logits.append(m.next_logits([tok], cache))
        read(i + 1)
    G.TRACE = False
    return {"tensors": got, "logits": logits}


def compare_ops(theirs: dict, ours: dict, n_prompt: int, layers: int) -> list[str]:
    """Per step: logits bitwise or not, then every named op (llama.cpp's order) whose result differs."""
    lines = []
    parted = False  # an earlier step differed: the keys and values it cached do too
    for st, (a, b) in enumerate(zip(theirs["logits"], ours["logits"], strict=True)):
        top = np.argsort(a)[-2:]
        lines.append(f"step {st} ({'prefill of %d rows' % n_prompt if st == 0 else 'decode'}): logits bitwise equal on "
                     f"{np.mean(a == b):.2%} (max |diff| {np.abs(a - b).max():.3g}); llama.cpp's top-2 margin "
                     f"{a[top[1]] - a[top[0]]:.5f}, ours {np.sort(b)[-1] - np.sort(b)[-2]:.5f}")
        mine: dict[str, list] = {}
        for s, n, x in ours["tensors"]:
            if s == st:
                mine.setdefault(n, []).append(x)
        theirs_st = [(n, x) for s, n, x in theirs["tensors"] if s == st and n in mine]
        count = {n: sum(1 for n2, _ in theirs_st if n2 == n) for n in mine}
        seen: dict[str, int] = {}
        q0 = 0 if st == 0 else n_prompt + st - 1  # the first query position of this step
        shown = 0
        for n, x in theirs_st:
            j = seen[n] = seen.get(n, -1) + 1
            # an op named more than once (Qcur after its product, its reshape, RoPE): first with first,
            # last with last, the ones between skipped
            if 0 < j < count[n] - 1:
                continue
            y = mine[n][0] if j == 0 else mine[n][-1]
            if n.startswith("result"):
                x = x[..., -1:, :]  # llama.cpp computes every row's logits here, the graph the last
            if n.startswith("kq") and n != "kqv" and n != "kqv_out":
                k = min(x.shape[-1], y.shape[-1])
                x, y = x[..., :k], y[..., :k]
                rows = q0 + np.arange(x.shape[-2])[:, None]
                causal = np.broadcast_to(np.arange(k)[None, :] <= rows, x.shape)
                x, y = x[causal], y[causal]
            if x.size != y.size:
                lines.append(f"  {n}: shapes {x.shape} vs {y.shape}")
                continue
            x = x.reshape(y.shape)
            eq = float(np.mean(x == y))
            li = int(n.rsplit("-", 1)[1]) if n[-1].isdigit() else -1
            if eq < 1 and (li < layers or shown == 0):
                first = ("   <- the first op that differs" + (", on a KV cache that already differs" if parted else "")
                         if shown == 0 else "")
                lines.append(f"  {n:<18} equal {eq:7.2%}  max |diff| {np.abs(x - y).max():.3g}{first}")
                shown += 1
        if shown == 0:
            lines.append("  every op compared is bitwise equal")
        parted = parted or shown > 0
    return lines


def kq_analysis(args, p: dict, gguf: str) -> list[str]:
    from larql_edge.model.kernels._matrix import CompactMatrix

    got = _llama(llama_cpp_tensors, Path(gguf), p["input_ids"], [], {f"{n}-{args.layer}" for n in ("Qcur", "Kcur", "kq")},
                 args.extra_buffers)
    t: dict[str, list] = {}
    for _, name, a in got["tensors"]:
        t.setdefault(name, []).append(a)
    q = t[f"Qcur-{args.layer}"][-1][0]  # [seq, heads, hd], after RoPE
    k = t[f"Kcur-{args.layer}"][-1][0]  # [seq, kv heads, hd]
    kq = t[f"kq-{args.layer}"][-1][0]  # [heads, seq, n_kv]
    seq, nq, hd = q.shape
    g = nq // k.shape[1]
    if args.model.startswith("gemma"):
        q = q * F32(hd**-0.5)  # llama.cpp scales Gemma's q before QK (1/16 here: exact)
    qh = q.astype(np.float16).astype(F32).transpose(1, 0, 2)  # [heads, seq, hd]
    kh = k.astype(np.float16).astype(F32)
    kk = np.stack([kh[:, h // g] for h in range(nq)])  # [heads, keys, hd]
    causal = np.tril(np.ones((seq, seq), bool))
    theirs = kq[:, :, :seq][:, causal]
    ggml = np.stack([CompactMatrix.from_array(kk[h].astype(np.float16)).matmul(qh[h]) for h in range(nq)])
    ways = {
        "ggml mul_mat (libggml-python wheel, the one-graph step's op)": ggml,
        "vec_dot_f16 order, AVX2 (numpy emulation)": vec_dot_avx2(qh[:, :, None, :], kk[:, None, :, :]),
        "tinyBLAS f16 order, AVX-512 (numpy emulation)": tinyblas_avx512(qh[:, :, None, :], kk[:, None, :, :]),
    }
    lines = [f"llama.cpp {got['version']} (extra buffers {'on' if args.extra_buffers else 'off'}; {got['system_info']})",
             f"{args.model} {p['prompt']!r}, layer {args.layer}, prefill of {seq} rows: llama.cpp's kq "
             f"({theirs.size} causal entries, |kq| <= {np.abs(theirs).max():.4g}) recomputed from its own q, k:"]
    for name, v in ways.items():
        mine = v[:, causal]
        d = np.abs(mine - theirs)
        lines.append(f"  {name:<62} equal {np.mean(mine == theirs):6.1%}  max |diff| {d.max():.3g} "
                     f"(relative {d.max() / np.abs(theirs).max():.2g})")
    same = np.mean(ways["ggml mul_mat (libggml-python wheel, the one-graph step's op)"][:, causal]
                   == ways["vec_dot_f16 order, AVX2 (numpy emulation)"][:, causal])
    lines.append(f"  (ggml mul_mat equals the AVX2 vec_dot_f16 emulation on {same:.1%} of them)")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gemma3-270m", choices=["smollm2-135m", "gemma3-270m"])
    ap.add_argument("--prompt", type=int, default=5, help="index of a prompt in the golden file")
    ap.add_argument("--steps", type=int, default=12, help="decode steps after the prefill (tokens from the golden file)")
    ap.add_argument("--layers", type=int, default=2, help="list differing ops of the first this many layers (and the first)")
    ap.add_argument("--kq", action="store_true", help="the QK^T recomputation of one layer (the native-build analysis)")
    ap.add_argument("--layer", type=int, default=1, help="--kq: the layer")
    ap.add_argument("--no-extra-buffers", dest="extra_buffers", action="store_false",
                    help="llama.cpp without its extra buffer types (CPU_REPACK/AMX)")
    ap.add_argument("--no-tiled-mm", dest="tiled_mm", action="store_false",
                    help="llama.cpp without ggml's tiled K-quant products (GGML_CPU_TILED_MM=0)")
    ap.add_argument("--out", default=None, help="default: benchmarks/results/llama_cpp_trace.txt (--kq: -native.txt)")
    args = ap.parse_args()
    import importlib.util

    if importlib.util.find_spec("llama_cpp") is None:
        print("llama_cpp (llama-cpp-python) is not installed: nothing to compare against", file=sys.stderr)
        return 2
    from larql_edge.tools.slicer.extract import resolve

    golden = json.loads((ROOT / "tests" / "data" / "llama_cpp_greedy.json").read_text())
    p = golden["models"][args.model]["prompts"][args.prompt]
    _, gguf = resolve(args.model)
    if args.kq:
        lines = kq_analysis(args, p, str(gguf))
        out = args.out or str(ROOT / "benchmarks" / "results" / "llama_cpp_trace-native.txt")
    else:
        feed = p["ids"][: args.steps]
        wanted = {f"{n}-{i}" for n in NAMES for i in range(64)} | {"result_norm", "result_output"}
        theirs = _llama(llama_cpp_tensors, Path(gguf), p["input_ids"], feed, wanted, args.extra_buffers, args.tiled_mm)
        ours = graph_tensors(args.model, p["input_ids"], feed)
        from larql_edge.model.kernels import _ggml

        lines = [f"llama.cpp {theirs['version']} ({theirs['system_info']}; extra buffers "
                 f"{'on' if args.extra_buffers else 'off'}, tiled K-quant products {'on' if args.tiled_mm else 'off'}) "
                 f"vs the one-graph step (ggml {_ggml.lib().info()['version']}), 1 thread",
                 f"{args.model} {p['prompt']!r}: prefill, then {len(feed)} decode steps fed llama.cpp's greedy tokens"]
        lines += compare_ops(theirs, ours, len(p["input_ids"]), args.layers)
        out = args.out or str(ROOT / "benchmarks" / "results" / "llama_cpp_trace.txt")
    text = "\n".join(lines)
    print(text)
    Path(out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
