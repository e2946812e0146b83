"""Where llama.cpp's arithmetic and ggml's in the one-graph step part: its QK^T product, from its own tensors.

    python benchmarks/llama_cpp_trace.py [--model smollm2-135m] [--prompt 4] [--layer 1]
                                         [--out benchmarks/results/llama_cpp_trace.txt]

Needs ``llama_cpp`` (see benchmarks/llama_cpp_parity.py). llama.cpp prefills a golden prompt
(tests/data/llama_cpp_greedy.json) with an eval callback that copies out its named tensors of one layer:
``Qcur`` and ``Kcur`` (after RoPE) and ``kq`` (QK^T before the softmax). From llama.cpp's own q and k
(rounded to float16 as its KV cache and its f16 product round them; each product of two float16 values is
exact in float32, so only the order of the float32 sums can differ), ``kq`` is recomputed three ways:

- ggml's ``mul_mat`` of the libggml-python wheel, which the one-graph step runs (its AVX2 ``vec_dot_f16``:
  4 accumulators of 8 lanes);
- an emulation of that same ``vec_dot_f16`` order in numpy (checks the emulation);
- an emulation of llamafile's tinyBLAS f16 kernel as llama.cpp's native AVX-512 build runs it (one
  accumulator of 16 lanes per output, summed by ``_mm512_reduce_add_ps``).

The share of causal entries each equals bit for bit is the result (DESIGN.md §4.1): the two libraries
sum the same exact products in different orders, so about half of the QK^T entries differ in their last
bits (relative ~1e-7); that rounding is then amplified by the float16 rounding of softmax @ V and by
the 8-bit activations of the next products.
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


def llama_cpp_tensors(gguf: Path, ids: list[int], layer: int, extra_buffers: bool) -> dict[str, list[np.ndarray]]:
    """llama.cpp's float32 tensors named ``{Qcur,Kcur,kq}-<layer>`` while it prefills ``ids`` (every
    occurrence, in graph order: the last Qcur/Kcur is the one after RoPE)."""
    import llama_cpp
    import llama_cpp.llama as llama_py
    import llama_cpp.llama_cpp as low

    from larql_edge.model.kernels._ggml import _Tensor

    base = ctypes.CDLL(str(Path(llama_cpp.__file__).parent / "lib" / "libggml-base.so"))
    base.ggml_nbytes.restype, base.ggml_nbytes.argtypes = ctypes.c_size_t, [ctypes.c_void_p]
    wanted = {f"{n}-{layer}" for n in ("Qcur", "Kcur", "kq")}
    got: dict[str, list[np.ndarray]] = {}

    @low.ggml_backend_sched_eval_callback
    def callback(t, ask, _user):
        tt = ctypes.cast(t, ctypes.POINTER(_Tensor)).contents
        name = tt.name.decode()
        if ask:
            return name in wanted
        if tt.type == 0:  # float32
            raw = np.frombuffer(bytes((ctypes.c_char * base.ggml_nbytes(t)).from_address(tt.data)), F32)
            a = np.lib.stride_tricks.as_strided(raw, shape=list(tt.ne)[::-1], strides=list(tt.nb)[::-1])
            got.setdefault(name, []).append(np.array(a))
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
    finally:
        llama_py.llama_cpp.llama_context_default_params = ctx_defaults
        llama_py.llama_cpp.llama_model_default_params = model_defaults
    return got


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m", choices=["smollm2-135m", "gemma3-270m"])
    ap.add_argument("--prompt", type=int, default=4, help="index of a prompt in the golden file")
    ap.add_argument("--layer", type=int, default=1)
    ap.add_argument("--extra-buffers", action="store_true", help="llama.cpp with its extra buffer types (AMX/REPACK)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "llama_cpp_trace.txt"))
    args = ap.parse_args()
    try:
        import llama_cpp
    except ImportError:
        print("llama_cpp (llama-cpp-python) is not installed: nothing to compare against", file=sys.stderr)
        return 2
    from larql_edge.model.kernels._matrix import CompactMatrix
    from larql_edge.tools.slicer.extract import resolve

    golden = json.loads((ROOT / "tests" / "data" / "llama_cpp_greedy.json").read_text())
    p = golden["models"][args.model]["prompts"][args.prompt]
    _, gguf = resolve(args.model)
    t = llama_cpp_tensors(Path(gguf), p["input_ids"], args.layer, args.extra_buffers)
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
    lines = [f"llama.cpp {llama_cpp.__version__} (extra buffers {'on' if args.extra_buffers else 'off'}; "
             f"{llama_cpp.llama_print_system_info().decode().strip()})",
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
    text = "\n".join(lines)
    print(text)
    Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
