"""numba kernels: ``y = x @ W.T`` computed straight from GGUF/ggml block bytes.

Every kernel walks W row by row and each row group by group, multiplying the decoded weights into
lane accumulators (see "per-group weights" below); with several rows of x, each decoded weight is
used for four of them. Nothing larger than one group of one row is ever decoded, and the weight
bytes are read in place (they can be a read-only memory map of the vindex file).

``ncols`` is the number of real columns. Groups are decoded only while they start below it, so the
zero padding LARQL adds to K-quant rows (to a multiple of 256 columns) is read only where a group
straddles the end; x must have ``ngroups * G`` columns, zero past ``ncols`` (the caller pads), so
that straddling padding multiplies zeros.

The kernels are serial and release the GIL: the caller splits rows across its own threads, so no
second thread pool (numba's OpenMP/TBB layer) ever competes with BLAS. That also sidesteps numba's
on-disk cache not keying on ``parallel=``.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

_JIT = {"fastmath": True, "cache": True, "nogil": True, "error_model": "numpy", "boundscheck": False}


@intrinsic
def _half_bits_to_f32(typingctx, bits):
    """IEEE half (given as its 16 raw bits) -> float32; compiles to F16C ``vcvtph2ps`` on x86."""
    if not isinstance(bits, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        v = args[0]
        if v.type.width > 16:
            v = builder.trunc(v, ir.IntType(16))
        elif v.type.width < 16:
            v = builder.zext(v, ir.IntType(16))
        return builder.fpext(builder.bitcast(v, ir.HalfType()), ir.FloatType())

    return types.float32(bits), codegen


@njit(inline="always")
def _half_at(raw, r, o):
    return _half_bits_to_f32(np.uint16(raw[r, o]) | (np.uint16(raw[r, o + 1]) << np.uint16(8)))


# -- per-group weights ---------------------------------------------------------------------------
#
# A row of W is walked in groups (32 values for Q8_0, 64 for Q4_K and f16, 128 for Q6_K). For each
# group, ``_fma1_*`` adds ``w * x[i]`` and ``_fma4_*`` adds ``w * x[i..i+3]`` (one decoded weight,
# four multiply-adds) into G-wide lane accumulators ``acc[k, :G]``, reduced once per row.
#
# The shape matters, measured: a per-group dot product with a scalar result, or decoding a group
# into a buffer first, made LLVM vectorize across groups (byte gathers) and ran 3-6x slower; lane
# accumulators carry a dependence across groups that keeps the vectorizer on the lanes.


@njit(inline="always")
def _fma1_q8_0(raw, qi, r, g, ncols, x, i, acc):
    # block_q8_0 (34 bytes / 32 values): f16 d, int8 qs[32]; w = d * q
    o = g * 34
    d = _half_at(raw, r, o)
    base = g * 32
    for j in range(32):
        acc[0, j] += d * (np.float32(qi[r, o + 2 + j]) * x[i, base + j])


@njit(inline="always")
def _fma4_q8_0(raw, qi, r, g, ncols, x, i, acc):
    o = g * 34
    d = _half_at(raw, r, o)
    base = g * 32
    for j in range(32):
        w = d * np.float32(qi[r, o + 2 + j])
        acc[0, j] += w * x[i, base + j]
        acc[1, j] += w * x[i + 1, base + j]
        acc[2, j] += w * x[i + 2, base + j]
        acc[3, j] += w * x[i + 3, base + j]


@njit(inline="always")
def _q4_k_params(raw, r, g):
    # block_q4_K (144 bytes / 256 values): f16 d, f16 dmin, scales[12] (eight 6-bit scale/min
    # pairs), qs[128]. Group g = chunk c of block b: 32 bytes whose low nibbles are values
    # 64c..64c+31 (sub-block 2c) and high nibbles 64c+32..64c+63 (sub-block 2c+1).
    # w = d * sc * q - dmin * m   (ggml's get_scale_min_k4 / dequantize_row_q4_K)
    b = g // 4
    c = g % 4
    o = b * 144
    d = _half_at(raw, r, o)
    dmin = _half_at(raw, r, o + 2)
    sc = o + 4
    j = 2 * c
    if j < 4:
        s1 = raw[r, sc + j] & 63
        m1 = raw[r, sc + j + 4] & 63
        s2 = raw[r, sc + j + 1] & 63
        m2 = raw[r, sc + j + 5] & 63
    else:
        s1 = (raw[r, sc + j + 4] & 0xF) | ((raw[r, sc + j - 4] >> 6) << 4)
        m1 = (raw[r, sc + j + 4] >> 4) | ((raw[r, sc + j] >> 6) << 4)
        s2 = (raw[r, sc + j + 5] & 0xF) | ((raw[r, sc + j - 3] >> 6) << 4)
        m2 = (raw[r, sc + j + 5] >> 4) | ((raw[r, sc + j + 1] >> 6) << 4)
    return (d * np.float32(s1), dmin * np.float32(m1), d * np.float32(s2), dmin * np.float32(m2),
            o + 16 + c * 32)


@njit(inline="always")
def _fma1_q4_k(raw, qi, r, g, ncols, x, i, acc):
    d1, n1, d2, n2, q = _q4_k_params(raw, r, g)
    base = g * 64
    for l in range(32):
        v = raw[r, q + l]
        acc[0, l] += (d1 * np.float32(v & 0xF) - n1) * x[i, base + l]
        acc[0, 32 + l] += (d2 * np.float32(v >> 4) - n2) * x[i, base + 32 + l]


@njit(inline="always")
def _fma4_q4_k(raw, qi, r, g, ncols, x, i, acc):
    d1, n1, d2, n2, q = _q4_k_params(raw, r, g)
    base = g * 64
    for l in range(32):
        v = raw[r, q + l]
        w = d1 * np.float32(v & 0xF) - n1
        acc[0, l] += w * x[i, base + l]
        acc[1, l] += w * x[i + 1, base + l]
        acc[2, l] += w * x[i + 2, base + l]
        acc[3, l] += w * x[i + 3, base + l]
        w = d2 * np.float32(v >> 4) - n2
        acc[0, 32 + l] += w * x[i, base + 32 + l]
        acc[1, 32 + l] += w * x[i + 1, base + 32 + l]
        acc[2, 32 + l] += w * x[i + 2, base + 32 + l]
        acc[3, 32 + l] += w * x[i + 3, base + 32 + l]


# block_q6_K (210 bytes / 256 values): ql[128] (low nibbles), qh[64] (2 high bits each), int8
# scales[16] (one per 16 values), f16 d; w = d * scale * (q - 32). Group g is half h of block b
# (128 values): four runs k of 32 taking the low (k < 2) or high nibble of ql[l + 32 * (k & 1)] and
# bits 2k..2k+1 of qh[l], with scale 2k for l < 16 and 2k + 1 after (ggml's dequantize_row_q6_K).
# The runs are written out so that every shift is a constant, and kept 32 long: LLVM vectorizes 8
# lanes x 4 interleaved, and a 16-long loop fell back to its scalar version (measured: 15x slower).


@njit(inline="always")
def _fma1_q6_k(raw, qi, r, g, ncols, x, i, acc):
    b = g // 2
    h = g % 2
    o = b * 210
    d = _half_at(raw, r, o + 208)
    ql = o + h * 64
    qh = o + 128 + h * 32
    sc = o + 192 + h * 8
    base = g * 128
    s0 = d * np.float32(qi[r, sc + 0])
    s1 = d * np.float32(qi[r, sc + 1])
    for l in range(32):
        q = np.float32(np.int32(((raw[r, ql + 0 + l] >> 0) & 0xF) | (((raw[r, qh + l] >> 0) & 3) << 4)) - np.int32(32))
        w = (s0 if l < 16 else s1) * q
        acc[0, 0 + l] += w * x[i, base + 0 + l]
    s0 = d * np.float32(qi[r, sc + 2])
    s1 = d * np.float32(qi[r, sc + 3])
    for l in range(32):
        q = np.float32(np.int32(((raw[r, ql + 32 + l] >> 0) & 0xF) | (((raw[r, qh + l] >> 2) & 3) << 4)) - np.int32(32))
        w = (s0 if l < 16 else s1) * q
        acc[0, 32 + l] += w * x[i, base + 32 + l]
    s0 = d * np.float32(qi[r, sc + 4])
    s1 = d * np.float32(qi[r, sc + 5])
    for l in range(32):
        q = np.float32(np.int32(((raw[r, ql + 0 + l] >> 4) & 0xF) | (((raw[r, qh + l] >> 4) & 3) << 4)) - np.int32(32))
        w = (s0 if l < 16 else s1) * q
        acc[0, 64 + l] += w * x[i, base + 64 + l]
    s0 = d * np.float32(qi[r, sc + 6])
    s1 = d * np.float32(qi[r, sc + 7])
    for l in range(32):
        q = np.float32(np.int32(((raw[r, ql + 32 + l] >> 4) & 0xF) | (((raw[r, qh + l] >> 6) & 3) << 4)) - np.int32(32))
        w = (s0 if l < 16 else s1) * q
        acc[0, 96 + l] += w * x[i, base + 96 + l]


@njit(inline="always")
def _fma4_q6_k(raw, qi, r, g, ncols, x, i, acc):
    b = g // 2
    h = g % 2
    o = b * 210
    d = _half_at(raw, r, o + 208)
    ql = o + h * 64
    qh = o + 128 + h * 32
    sc = o + 192 + h * 8
    base = g * 128
    s0 = d * np.float32(qi[r, sc + 0])
    s1 = d * np.float32(qi[r, sc + 1])
    for l in range(32):
        q = np.float32(np.int32(((raw[r, ql + 0 + l] >> 0) & 0xF) | (((raw[r, qh + l] >> 0) & 3) << 4)) - np.int32(32))
        w = (s0 if l < 16 else s1) * q
        c = base + 0 + l
        acc[0, 0 + l] += w * x[i + 0, c]
        acc[1, 0 + l] += w * x[i + 1, c]
        acc[2, 0 + l] += w * x[i + 2, c]
        acc[3, 0 + l] += w * x[i + 3, c]
    s0 = d * np.float32(qi[r, sc + 2])
    s1 = d * np.float32(qi[r, sc + 3])
    for l in range(32):
        q = np.float32(np.int32(((raw[r, ql + 32 + l] >> 0) & 0xF) | (((raw[r, qh + l] >> 2) & 3) << 4)) - np.int32(32))
        w = (s0 if l < 16 else s1) * q
        c = base + 32 + l
        acc[0, 32 + l] += w * x[i + 0, c]
        acc[1, 32 + l] += w * x[i + 1, c]
        acc[2, 32 + l] += w * x[i + 2, c]
        acc[3, 32 + l] += w * x[i + 3, c]
    s0 = d * np.float32(qi[r, sc + 4])
    s1 = d * np.float32(qi[r, sc + 5])
    for l in range(32):
        q = np.float32(np.int32(((raw[r, ql + 0 + l] >> 4) & 0xF) | (((raw[r, qh + l] >> 4) & 3) << 4)) - np.int32(32))
        w = (s0 if l < 16 else s1) * q
        c = base + 64 + l
        acc[0, 64 + l] += w * x[i + 0, c]
        acc[1, 64 + l] += w * x[i + 1, c]
        acc[2, 64 + l] += w * x[i + 2, c]
        acc[3, 64 + l] += w * x[i + 3, c]
    s0 = d * np.float32(qi[r, sc + 6])
    s1 = d * np.float32(qi[r, sc + 7])
    for l in range(32):
        q = np.float32(np.int32(((raw[r, ql + 32 + l] >> 4) & 0xF) | (((raw[r, qh + l] >> 6) & 3) << 4)) - np.int32(32))
        w = (s0 if l < 16 else s1) * q
        c = base + 96 + l
        acc[0, 96 + l] += w * x[i + 0, c]
        acc[1, 96 + l] += w * x[i + 1, c]
        acc[2, 96 + l] += w * x[i + 2, c]
        acc[3, 96 + l] += w * x[i + 3, c]


@njit(inline="always")
def _fma1_f16(raw, qi, r, g, ncols, x, i, acc):
    # f16 rows are not padded: x is (by the caller) and the tail group stops at ncols.
    base = g * 64
    if base + 64 <= ncols:
        for j in range(64):
            acc[0, j] += _half_bits_to_f32(raw[r, base + j]) * x[i, base + j]
    else:
        for j in range(ncols - base):
            acc[0, j] += _half_bits_to_f32(raw[r, base + j]) * x[i, base + j]


@njit(inline="always")
def _fma4_f16(raw, qi, r, g, ncols, x, i, acc):
    base = g * 64
    if base + 64 <= ncols:
        for j in range(64):
            w = _half_bits_to_f32(raw[r, base + j])
            acc[0, j] += w * x[i, base + j]
            acc[1, j] += w * x[i + 1, base + j]
            acc[2, j] += w * x[i + 2, base + j]
            acc[3, j] += w * x[i + 3, base + j]
    else:
        for j in range(ncols - base):
            w = _half_bits_to_f32(raw[r, base + j])
            acc[0, j] += w * x[i, base + j]
            acc[1, j] += w * x[i + 1, base + j]
            acc[2, j] += w * x[i + 2, base + j]
            acc[3, j] += w * x[i + 3, base + j]


@njit(inline="always")
def _store(acc, k, out, i, r):
    for kk in range(k):
        s = np.float32(0.0)
        for j in range(acc.shape[1]):
            s += acc[kk, j]
            acc[kk, j] = 0.0
        out[i + kk, r] = s


# -- kernels --------------------------------------------------------------------------------------
# One explicit pair per format (not made by a factory: numba's cache keys on the function's
# qualified name and source line, so factory-made twins would collide in it). Serial: the caller
# splits rows across its own threads (the kernels release the GIL), so no second thread pool exists.
# The *_rows decoders write each weight straight into the output row (measured 2x faster for the
# tiled products than the first version, which ran the one-row FMA with x = 1).


@njit(**_JIT)
def q8_0_matmul(raw, x, ncols, out, col0):
    """out[:, col0 + r] = x[:, :ncols] @ W[r, :ncols] for every row r of ``raw`` (W's block bytes)."""
    rows = raw.shape[0]
    n = x.shape[0]
    qi = raw.view(np.int8)
    ngroups = (ncols + 32 - 1) // 32
    acc = np.zeros((4, 32), np.float32)
    for r in range(rows):
        i = 0
        while i + 4 <= n:
            for g in range(ngroups):
                _fma4_q8_0(raw, qi, r, g, ncols, x, i, acc)
            _store(acc, 4, out, i, col0 + r)
            i += 4
        while i < n:
            for g in range(ngroups):
                _fma1_q8_0(raw, qi, r, g, ncols, x, i, acc)
            _store(acc, 1, out, i, col0 + r)
            i += 1


@njit(**_JIT)
def q8_0_rows(raw, idx, ncols, out):
    """out[k, :] = W[idx[k], :] decoded (out has ngroups * 32 columns: the caller slices off padding)."""
    qi = raw.view(np.int8)
    for k in range(idx.size):
        r = idx[k]
        for g in range((ncols + 31) // 32):
            o = g * 34
            d = _half_at(raw, r, o)
            for j in range(32):
                out[k, g * 32 + j] = d * np.float32(qi[r, o + 2 + j])


@njit(**_JIT)
def q4_k_matmul(raw, x, ncols, out, col0):
    """out[:, col0 + r] = x[:, :ncols] @ W[r, :ncols] for every row r of ``raw`` (W's block bytes)."""
    rows = raw.shape[0]
    n = x.shape[0]
    qi = raw
    ngroups = (ncols + 64 - 1) // 64
    acc = np.zeros((4, 64), np.float32)
    for r in range(rows):
        i = 0
        while i + 4 <= n:
            for g in range(ngroups):
                _fma4_q4_k(raw, qi, r, g, ncols, x, i, acc)
            _store(acc, 4, out, i, col0 + r)
            i += 4
        while i < n:
            for g in range(ngroups):
                _fma1_q4_k(raw, qi, r, g, ncols, x, i, acc)
            _store(acc, 1, out, i, col0 + r)
            i += 1


@njit(**_JIT)
def q4_k_rows(raw, idx, ncols, out):
    """out[k, :] = W[idx[k], :] decoded (out has ngroups * 64 columns: the caller slices off padding)."""
    for k in range(idx.size):
        r = idx[k]
        for g in range((ncols + 63) // 64):
            d1, n1, d2, n2, q = _q4_k_params(raw, r, g)
            base = g * 64
            for l in range(32):
                v = raw[r, q + l]
                out[k, base + l] = d1 * np.float32(v & 0xF) - n1
                out[k, base + 32 + l] = d2 * np.float32(v >> 4) - n2


@njit(**_JIT)
def q6_k_matmul(raw, x, ncols, out, col0):
    """out[:, col0 + r] = x[:, :ncols] @ W[r, :ncols] for every row r of ``raw`` (W's block bytes)."""
    rows = raw.shape[0]
    n = x.shape[0]
    qi = raw.view(np.int8)
    ngroups = (ncols + 128 - 1) // 128
    acc = np.zeros((4, 128), np.float32)
    for r in range(rows):
        i = 0
        while i + 4 <= n:
            for g in range(ngroups):
                _fma4_q6_k(raw, qi, r, g, ncols, x, i, acc)
            _store(acc, 4, out, i, col0 + r)
            i += 4
        while i < n:
            for g in range(ngroups):
                _fma1_q6_k(raw, qi, r, g, ncols, x, i, acc)
            _store(acc, 1, out, i, col0 + r)
            i += 1


@njit(**_JIT)
def q6_k_rows(raw, idx, ncols, out):
    """out[k, :] = W[idx[k], :] decoded (out has ngroups * 128 columns: the caller slices off padding)."""
    qi = raw.view(np.int8)
    for k in range(idx.size):
        r = idx[k]
        for g in range((ncols + 127) // 128):
            o = (g // 2) * 210
            h = g % 2
            d = _half_at(raw, r, o + 208)
            ql = o + h * 64
            qh = o + 128 + h * 32
            sc = o + 192 + h * 8
            base = g * 128
            s0 = d * np.float32(qi[r, sc + 0])
            s1 = d * np.float32(qi[r, sc + 1])
            for l in range(32):
                q = np.float32(np.int32(((raw[r, ql + 0 + l] >> 0) & 0xF) | (((raw[r, qh + l] >> 0) & 3) << 4)) - np.int32(32))
                out[k, base + 0 + l] = (s0 if l < 16 else s1) * q
            s0 = d * np.float32(qi[r, sc + 2])
            s1 = d * np.float32(qi[r, sc + 3])
            for l in range(32):
                q = np.float32(np.int32(((raw[r, ql + 32 + l] >> 0) & 0xF) | (((raw[r, qh + l] >> 2) & 3) << 4)) - np.int32(32))
                out[k, base + 32 + l] = (s0 if l < 16 else s1) * q
            s0 = d * np.float32(qi[r, sc + 4])
            s1 = d * np.float32(qi[r, sc + 5])
            for l in range(32):
                q = np.float32(np.int32(((raw[r, ql + 0 + l] >> 4) & 0xF) | (((raw[r, qh + l] >> 4) & 3) << 4)) - np.int32(32))
                out[k, base + 64 + l] = (s0 if l < 16 else s1) * q
            s0 = d * np.float32(qi[r, sc + 6])
            s1 = d * np.float32(qi[r, sc + 7])
            for l in range(32):
                q = np.float32(np.int32(((raw[r, ql + 32 + l] >> 4) & 0xF) | (((raw[r, qh + l] >> 6) & 3) << 4)) - np.int32(32))
                out[k, base + 96 + l] = (s0 if l < 16 else s1) * q


@njit(**_JIT)
def f16_matmul(raw, x, ncols, out, col0):
    """out[:, col0 + r] = x[:, :ncols] @ W[r, :ncols] for every row r of ``raw`` (W's block bytes)."""
    rows = raw.shape[0]
    n = x.shape[0]
    qi = raw
    ngroups = (ncols + 64 - 1) // 64
    acc = np.zeros((4, 64), np.float32)
    for r in range(rows):
        i = 0
        while i + 4 <= n:
            for g in range(ngroups):
                _fma4_f16(raw, qi, r, g, ncols, x, i, acc)
            _store(acc, 4, out, i, col0 + r)
            i += 4
        while i < n:
            for g in range(ngroups):
                _fma1_f16(raw, qi, r, g, ncols, x, i, acc)
            _store(acc, 1, out, i, col0 + r)
            i += 1


@njit(**_JIT)
def f16_rows(raw, idx, ncols, out):
    """out[k, :] = W[idx[k], :] as float32 (out has ngroups * 64 columns, zero past ncols)."""
    for k in range(idx.size):
        r = idx[k]
        for j in range(ncols):
            out[k, j] = _half_bits_to_f32(raw[r, j])
        for j in range(ncols, out.shape[1]):
            out[k, j] = 0.0
