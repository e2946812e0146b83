"""GGML block formats as quantized vindexes store them: Q4_K, Q6_K, Q8_0 (LARQL's q4k), Q5_0, Q4_1.

Sizes and decode follow gguf-py / llama.cpp. Encode follows LARQL's own quantizer (read from
``crates/larql-compute/src/cpu/ops/q4_common.rs`` ``quantize_q4_k`` / ``quantize_q6_k`` and
``crates/larql-models/src/quant/ggml/quantize.rs`` ``quantize_q8_0``, LARQL commit c880fb7), in float32
with the same operation order, so larql-edge and LARQL produce the same bytes wherever LARQL
requantizes. LARQL's quantizers are not llama.cpp's (no iterative scale search), so neither produces
llama.cpp's bytes from the same floats.

**Q6_K has two bit layouts.** llama.cpp / gguf-py interleave the 6-bit codes across the block
(``dequantize_row_q6_K``). LARQL's decoders (``larql-models/src/quant/ggml/q6_k.rs``, the CPU and Metal
``q6k_matvec``) and its quantizer use a *linear* layout instead: code ``i`` has its low nibble in
``ql[i/2]`` (low half for even ``i``) and its top two bits in ``qh[i/4] >> 2*(i%4)``. Field positions
(ql 128 B, qh 64 B, 16 int8 scales, f16 d) and the per-16-value scales are the same, so the two
layouts hold exactly the same values and convert into each other losslessly (`q6k_from_ggml`,
`q6k_to_ggml`). ``"Q6_K"`` in a vindex manifest means LARQL's layout; ``GGML_Q6_K`` below names the
GGUF one. (LARQL's own GGUF reader decodes GGUF Q6_K with the linear layout too — a LARQL bug that
larql-edge does not copy: GGUF blocks are read with gguf-py.)

Q4_K is the same in both (144 B: f16 d, f16 dmin, 12 B packed 6-bit scales/mins as
``get_scale_min_k4``, 128 B nibbles where byte ``32g+l`` holds sub-block ``2g`` value ``l`` low and
``2g+1`` high), so GGUF Q4_K blocks are kept byte for byte.

f16 scales: LARQL converts with its own truncating ``f32_to_f16`` (``q4_common.rs``; round toward
zero, keeps f16 subnormals), not IEEE round-to-nearest, and quantizes the codes against the f32
scale before that truncation. ``f16_bits_kquant`` reproduces it. LARQL's other f16 encoder, used for
float side files such as ``embeddings.bin`` (``larql-models/src/quant/half.rs``), also truncates but
flushes f16 subnormals to zero: ``f16_bits_side``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from larql_edge.errors import QuantError

QK_K = 256  # values per K-quant super-block
QK8_0 = 32  # values per Q8_0 block

# format -> (values per block, bytes per block): the one geometry table, gguf-py's GGML_QUANT_SIZES
# (the kernels read the same table for their lower-case names: larql_edge.model.kernels._formats).
BLOCK = {f: GGML_QUANT_SIZES[GGMLQuantizationType[f]] for f in ("Q4_K", "Q6_K", "Q8_0", "Q5_0", "Q4_1")}
# Formats a q4k vindex manifest may carry (LARQL's QuantBlockFormat: "Q4_K" | "Q6_K").
VINDEX_FORMATS = ("Q4_K", "Q6_K")
# Formats a ``quant: gguf`` vindex (larql-edge's own; LARQL refuses it) may carry: every GGUF block type
# that larql-edge computes on, so each tensor keeps the block type its GGUF file gave it.
GGUF_FORMATS = ("Q4_K", "Q6_K", "Q8_0", "Q5_0", "Q4_1")
# What a ``quant: gguf`` extraction stores a tensor of any other GGUF type (F16, Q5_1, ...) as.
GGUF_FALLBACK = "Q8_0"
GGML_Q6_K = "GGML_Q6_K"  # llama.cpp's Q6_K bit layout, as found in GGUF files

_F32 = np.float32
_U8 = np.uint8


@dataclass(frozen=True)
class QBlocks:
    """One quantized matrix: ``rows`` rows of ``padded_cols`` values, each row whole blocks.

    ``data`` is uint8 ``[rows, padded_cols // block_values * block_bytes]`` (may be a memory map).
    ``logical_cols`` is the matrix's real width; the rest of each row is LARQL's zero padding.
    """

    format: str
    rows: int
    padded_cols: int
    logical_cols: int
    data: np.ndarray

    @property
    def nbytes(self) -> int:
        return int(self.data.size)


def block_bytes(fmt: str) -> int:
    return BLOCK[_known(fmt)][1]


def row_bytes(fmt: str, padded_cols: int) -> int:
    n, b = BLOCK[_known(fmt)]
    if padded_cols % n:
        raise QuantError(f"{fmt}: {padded_cols} columns is not a multiple of {n}")
    return padded_cols // n * b


def tensor_bytes(fmt: str, rows: int, padded_cols: int) -> int:
    return rows * row_bytes(fmt, padded_cols)


def padded(cols: int, multiple: int = QK_K) -> int:
    """``cols`` rounded up to a multiple of 256, as LARQL's ``pad_rows_to_block``."""
    return -(-cols // multiple) * multiple


def padded_for(fmt: str, cols: int) -> int:
    """``cols`` padded to whole blocks of ``fmt``: 256 for the K-quants (as LARQL pads), 32 for the rest."""
    return padded(cols, BLOCK[_known(fmt)][0])


def pad_rows(w: np.ndarray, multiple: int = QK_K) -> np.ndarray:
    """Zero-pad each row of ``w`` to a multiple of 256 columns (``write_q4k/mod.rs::pad_rows_to_block``).

    Per-row padding, not flat padding: each row must start on a super-block boundary.
    """
    w = np.asarray(w, dtype=_F32)
    if w.ndim != 2:
        raise QuantError(f"expected a 2-D matrix, got shape {w.shape}")
    cols = w.shape[1]
    p = padded(cols, multiple)
    if p == cols:
        return np.ascontiguousarray(w)
    out = np.zeros((w.shape[0], p), dtype=_F32)
    out[:, :cols] = w
    return out


def _known(fmt: str) -> str:
    if fmt not in BLOCK and fmt != GGML_Q6_K:
        raise QuantError(f"unknown block format {fmt!r} (known: {', '.join(BLOCK)})")
    return "Q6_K" if fmt == GGML_Q6_K else fmt


# -- LARQL's float helpers ----------------------------------------------------------------------


def round_half_away(x: np.ndarray) -> np.ndarray:
    """Rust's ``f32::round`` (ties away from zero), exactly; numpy's ``round`` ties to even."""
    t = np.trunc(x)
    f = x - t  # exact for finite floats
    return t + np.where(np.abs(f) >= _F32(0.5), np.sign(x), _F32(0)).astype(x.dtype)


def f16_bits_kquant(x: np.ndarray) -> np.ndarray:
    """LARQL's K-quant scale encoder (``q4_common.rs::f32_to_f16``): truncates, keeps subnormals."""
    bits = np.asarray(x, dtype=_F32).view(np.uint32).astype(np.int64)
    sign = (bits >> 16) & 0x8000
    exp = (bits >> 23) & 0xFF
    mant = bits & 0x7FFFFF
    new_exp = exp - 127 + 15
    normal = sign | (np.clip(new_exp, 0, 31) << 10) | (mant >> 13)
    shift = np.clip(1 - new_exp, 0, 24)
    sub = np.where(13 + shift >= 24, sign, sign | ((mant | 0x800000) >> np.minimum(13 + shift, 31)))
    out = np.where(new_exp <= 0, sub, normal)
    out = np.where(new_exp >= 31, sign | 0x7C00, out)
    out = np.where(exp == 255, sign | 0x7C00 | (mant >> 13), out)
    out = np.where(exp == 0, sign, out)
    return out.astype(np.uint16)


def f16_bits_side(x: np.ndarray) -> np.ndarray:
    """LARQL's float side-file encoder (``larql-models/src/quant/half.rs::f32_to_f16``, used by
    ``encode_floats`` for f16 embeddings/gate/weights): truncates and flushes f16 subnormals to zero."""
    bits = np.asarray(x, dtype=_F32).view(np.uint32).astype(np.int64)
    sign = (bits >> 16) & 0x8000
    exp = (bits >> 23) & 0xFF
    mant = bits & 0x7FFFFF
    exp16 = exp - 127 + 15
    out = sign | (np.clip(exp16, 0, 31) << 10) | (mant >> 13)
    out = np.where(exp16 <= 0, sign, out)
    out = np.where(exp16 >= 31, sign | 0x7C00, out)
    out = np.where(exp == 255, sign | 0x7C00 | np.where(mant != 0, 0x0200, 0), out)
    return out.astype(np.uint16)


def encode_f16_side(x: np.ndarray) -> np.ndarray:
    """f32 values as LARQL writes them into an f16 side file (``<f2`` array, same shape)."""
    return f16_bits_side(x).astype("<u2").view("<f2")


def _f16_to_f32(bits: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(bits).view("<f2").astype(_F32)


def _blocks_of(x: np.ndarray, n: int, fmt: str) -> np.ndarray:
    x = np.ascontiguousarray(x, dtype=_F32).reshape(-1)
    if x.size % n:
        raise QuantError(f"{fmt}: {x.size} values is not a multiple of {n} (pad rows first)")
    if not np.all(np.isfinite(x)):
        raise QuantError(f"{fmt}: refusing to quantize non-finite values")
    return x.reshape(-1, n)


# -- Q4_K -----------------------------------------------------------------------------------------


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    """f32 values (a multiple of 256) -> uint8 ``[n_blocks, 144]``, exactly as LARQL's ``quantize_q4_k``."""
    b = _blocks_of(x, QK_K, "Q4_K")
    nb = b.shape[0]
    sub = b.reshape(nb, 8, 32)
    mins = np.minimum(sub.min(axis=2), _F32(0))  # force min <= 0
    maxs = np.maximum(sub.max(axis=2), _F32(0))
    rng = maxs - mins
    gmr = np.maximum(rng.max(axis=1), _F32(0))
    gmin = mins.min(axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        d = np.where(gmr > 0, gmr / (_F32(15.0) * _F32(63.0)), _F32(0)).astype(_F32)
        dmin = np.where(gmin < 0, -gmin / _F32(63.0), _F32(0)).astype(_F32)
        qs = np.where(d[:, None] > 0, np.clip(round_half_away(rng / (_F32(15.0) * d)[:, None]), 0, 63), 0)
        qm = np.where(dmin[:, None] > 0, np.clip(round_half_away(-mins / dmin[:, None]), 0, 63), 0)
    qs = qs.astype(_U8)
    qm = qm.astype(_U8)

    packed = np.empty((nb, 12), dtype=_U8)
    packed[:, 0:4] = (qs[:, 0:4] & 0x3F) | (((qs[:, 4:8] >> 4) & 0x03) << 6)
    packed[:, 4:8] = (qm[:, 0:4] & 0x3F) | (((qm[:, 4:8] >> 4) & 0x03) << 6)
    packed[:, 8:12] = (qs[:, 4:8] & 0x0F) | ((qm[:, 4:8] & 0x0F) << 4)

    sc = d[:, None] * qs.astype(_F32)  # [nb, 8] d * q_scale
    mn = dmin[:, None] * qm.astype(_F32)
    with np.errstate(divide="ignore"):
        inv = np.where(sc > 0, _F32(1.0) / sc, _F32(0)).astype(_F32)
    codes = np.clip(round_half_away((sub + mn[:, :, None]) * inv[:, :, None]), 0, 15).astype(_U8)
    nibbles = codes[:, 0::2, :] | (codes[:, 1::2, :] << 4)  # [nb, 4 groups, 32]

    out = np.empty((nb, 144), dtype=_U8)
    out[:, 0:2] = f16_bits_kquant(d).astype("<u2").view(_U8).reshape(nb, 2)
    out[:, 2:4] = f16_bits_kquant(dmin).astype("<u2").view(_U8).reshape(nb, 2)
    out[:, 4:16] = packed
    out[:, 16:] = nibbles.reshape(nb, 128)
    return out


def _q4k_scale_min(p: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """llama.cpp's ``get_scale_min_k4`` for all 8 sub-blocks: (scales, mins) uint8 ``[nb, 8]``."""
    sc = np.empty((p.shape[0], 8), dtype=_U8)
    mn = np.empty_like(sc)
    sc[:, 0:4] = p[:, 0:4] & 0x3F
    mn[:, 0:4] = p[:, 4:8] & 0x3F
    sc[:, 4:8] = (p[:, 8:12] & 0x0F) | ((p[:, 0:4] >> 6) << 4)
    mn[:, 4:8] = (p[:, 8:12] >> 4) | ((p[:, 4:8] >> 6) << 4)
    return sc, mn


def dequantize_q4_k_larql(blocks: np.ndarray) -> np.ndarray:
    """Q4_K decode written from LARQL's ``dequantize_q4_k`` (its arithmetic order), for cross-checks."""
    b = _as_blocks(blocks, 144)
    d = _f16_to_f32(b[:, 0:2]).reshape(-1)
    dmin = _f16_to_f32(b[:, 2:4]).reshape(-1)
    sc, mn = _q4k_scale_min(b[:, 4:16])
    q = b[:, 16:].reshape(-1, 4, 32)
    codes = np.stack([q & 0x0F, q >> 4], axis=2).reshape(-1, 8, 32).astype(_F32)
    scale = d[:, None] * sc.astype(_F32)
    off = dmin[:, None] * mn.astype(_F32)
    return (scale[:, :, None] * codes - off[:, :, None]).reshape(-1)


# -- Q6_K -----------------------------------------------------------------------------------------


def quantize_q6_k(x: np.ndarray) -> np.ndarray:
    """f32 values (a multiple of 256) -> uint8 ``[n_blocks, 210]`` in LARQL's linear layout, exactly as
    LARQL's ``quantize_q6_k``: d = amax/(31*127), per-16 int8 scale = round(sub_amax/(31*d))."""
    b = _blocks_of(x, QK_K, "Q6_K")
    nb = b.shape[0]
    amax = np.maximum(np.abs(b).max(axis=1), _F32(0))
    d = (amax / (_F32(31.0) * _F32(127.0))).astype(_F32)
    sub = b.reshape(nb, 16, 16)
    sub_max = np.abs(sub).max(axis=2)
    with np.errstate(divide="ignore", invalid="ignore"):
        s = np.where(d[:, None] > 0, sub_max / (_F32(31.0) * d)[:, None], _F32(0)).astype(_F32)
    scales = np.clip(round_half_away(s), -128, 127).astype(np.int8)
    sc = d[:, None] * scales.astype(_F32)
    with np.errstate(divide="ignore"):
        inv = np.where(np.abs(sc) > _F32(1e-10), _F32(1.0) / sc, _F32(0)).astype(_F32)
    q = np.clip(round_half_away(sub * inv[:, :, None]), -32, 31).astype(np.int16)
    codes = (q + 32).astype(_U8).reshape(nb, 256)
    return _q6k_assemble(_q6k_pack_larql(codes), scales.view(_U8), f16_bits_kquant(d))


def _q6k_assemble(qlqh: np.ndarray, scales_u8: np.ndarray, d_bits: np.ndarray) -> np.ndarray:
    nb = qlqh.shape[0]
    out = np.empty((nb, 210), dtype=_U8)
    out[:, :192] = qlqh
    out[:, 192:208] = scales_u8
    out[:, 208:210] = np.asarray(d_bits).astype("<u2").view(_U8).reshape(nb, 2)
    return out


def _q6k_pack_larql(codes: np.ndarray) -> np.ndarray:
    """6-bit codes ``[nb, 256]`` -> ql|qh ``[nb, 192]`` in LARQL's linear layout."""
    nb = codes.shape[0]
    ql = (codes[:, 0::2] & 0x0F) | ((codes[:, 1::2] & 0x0F) << 4)
    hi = ((codes >> 4) & 0x03).reshape(nb, 64, 4)
    qh = hi[:, :, 0] | (hi[:, :, 1] << 2) | (hi[:, :, 2] << 4) | (hi[:, :, 3] << 6)
    return np.concatenate([ql, qh], axis=1).astype(_U8)


def _q6k_codes_larql(b: np.ndarray) -> np.ndarray:
    ql, qh = b[:, :128], b[:, 128:192]
    lo = np.stack([ql & 0x0F, ql >> 4], axis=2).reshape(-1, 256)
    hi = np.stack([(qh >> s) & 0x03 for s in (0, 2, 4, 6)], axis=2).reshape(-1, 256)
    return (lo | (hi << 4)).astype(_U8)


def _q6k_codes_ggml(b: np.ndarray) -> np.ndarray:
    """6-bit codes in element order from llama.cpp's layout (``dequantize_row_q6_K``)."""
    nb = b.shape[0]
    ql = b[:, :128].reshape(nb, 2, 1, 64)
    qh = b[:, 128:192].reshape(nb, 2, 1, 32)
    lo = (ql >> np.array([0, 4], dtype=_U8).reshape(1, 1, 2, 1)) & 0x0F  # [nb, half, nibble, 64]
    hi = (qh >> np.array([0, 2, 4, 6], dtype=_U8).reshape(1, 1, 4, 1)) & 0x03  # [nb, half, k, 32]
    return (lo.reshape(nb, 256) | (hi.reshape(nb, 256) << 4)).astype(_U8)


def _q6k_pack_ggml(codes: np.ndarray) -> np.ndarray:
    nb = codes.shape[0]
    c = codes.reshape(nb, 2, 128)
    ql = (c[:, :, 0:64] & 0x0F) | ((c[:, :, 64:128] & 0x0F) << 4)  # [nb, 2, 64]
    h = ((c >> 4) & 0x03).reshape(nb, 2, 4, 32)
    qh = h[:, :, 0] | (h[:, :, 1] << 2) | (h[:, :, 2] << 4) | (h[:, :, 3] << 6)  # [nb, 2, 32]
    return np.concatenate([ql.reshape(nb, 128), qh.reshape(nb, 64)], axis=1).astype(_U8)


def q6k_from_ggml(blocks: np.ndarray) -> np.ndarray:
    """GGUF (llama.cpp layout) Q6_K blocks -> LARQL layout. Lossless: same codes, scales and d."""
    b = _as_blocks(blocks, 210)
    return _q6k_assemble(_q6k_pack_larql(_q6k_codes_ggml(b)), b[:, 192:208], b[:, 208:210].copy().view("<u2"))


def q6k_to_ggml(blocks: np.ndarray) -> np.ndarray:
    """LARQL layout Q6_K blocks -> llama.cpp layout (the inverse of `q6k_from_ggml`)."""
    b = _as_blocks(blocks, 210)
    return _q6k_assemble(_q6k_pack_ggml(_q6k_codes_larql(b)), b[:, 192:208], b[:, 208:210].copy().view("<u2"))


def q5_0_to_q8_0(blocks: np.ndarray) -> np.ndarray:
    """Q5_0 blocks -> Q8_0 blocks of the same values: the same f16 scale, the same integers (q - 16 in
    [-16, 15]) one byte each. Lossless; 34 bytes a block instead of 22."""
    b = _as_blocks(blocks, 22)
    qh = b[:, 2:6].copy().view("<u4")[:, 0]
    qs = b[:, 6:22]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=1)  # values 0-15 low nibbles, 16-31 high nibbles
    q |= (((qh[:, None] >> np.arange(32, dtype=np.uint32)) & 1) << 4).astype(_U8)
    out = np.empty((b.shape[0], 34), _U8)
    out[:, 0:2] = b[:, 0:2]
    out[:, 2:] = (q.astype(np.int16) - 16).astype(np.int8).view(_U8)
    return out.reshape(-1)


def dequantize_q6_k_larql(blocks: np.ndarray) -> np.ndarray:
    """Decode LARQL-layout Q6_K (``q6_k.rs::dequantize_q6_k``): ``(d * scale) * (code - 32)``."""
    b = _as_blocks(blocks, 210)
    d = _f16_to_f32(b[:, 208:210]).reshape(-1)
    scales = np.ascontiguousarray(b[:, 192:208]).view(np.int8).astype(_F32)
    q = _q6k_codes_larql(b).astype(np.int16) - 32
    return ((d[:, None] * scales)[:, :, None] * q.reshape(-1, 16, 16).astype(_F32)).reshape(-1)


# -- Q8_0 -----------------------------------------------------------------------------------------


def quantize_q8_0(x: np.ndarray, f16: str = "larql") -> np.ndarray:
    """f32 values (a multiple of 32) -> uint8 ``[n_blocks, 34]``: d = amax/127, q = round(x/d).

    ``f16="larql"`` stores d with LARQL's truncating encoder (``quantize.rs::quantize_q8_0``);
    ``f16="ggml"`` rounds it to nearest as ggml/gguf-py do. The codes are the same either way.
    """
    b = _blocks_of(x, QK8_0, "Q8_0")
    amax = np.maximum(np.abs(b).max(axis=1), _F32(0))
    d = (amax / _F32(127.0)).astype(_F32)
    with np.errstate(divide="ignore"):
        inv = np.where(d > 0, _F32(1.0) / d, _F32(0)).astype(_F32)
    q = np.clip(round_half_away(b * inv[:, None]), -128, 127).astype(np.int8)
    if f16 == "larql":
        dbits = f16_bits_side(d)
    elif f16 == "ggml":
        dbits = d.astype(np.float16).view(np.uint16)
    else:
        raise QuantError(f"unknown f16 rounding {f16!r} (larql or ggml)")
    out = np.empty((b.shape[0], 34), dtype=_U8)
    out[:, 0:2] = dbits.astype("<u2").view(_U8).reshape(-1, 2)
    out[:, 2:] = q.view(_U8)
    return out


# -- dispatch -------------------------------------------------------------------------------------


def _as_blocks(blocks: np.ndarray, nbytes: int) -> np.ndarray:
    b = np.asarray(blocks)
    if b.dtype != _U8:
        raise QuantError(f"block data must be uint8, got {b.dtype}")
    if b.size % nbytes:
        raise QuantError(f"{b.size} bytes is not a whole number of {nbytes}-byte blocks")
    return np.ascontiguousarray(b).reshape(-1, nbytes)


def quantize(x: np.ndarray, fmt: str) -> np.ndarray:
    """f32 values -> blocks of ``fmt`` as LARQL encodes them (uint8 ``[n_blocks, block_bytes]``)."""
    if fmt == "Q4_K":
        return quantize_q4_k(x)
    if fmt == "Q6_K":
        return quantize_q6_k(x)
    if fmt == "Q8_0":
        return quantize_q8_0(x)
    if fmt in ("Q5_0", "Q4_1"):  # never LARQL's (it has no such slot): gguf-py's reference quantizer
        import gguf

        b = _blocks_of(x, QK8_0, fmt)
        return np.asarray(gguf.quants.quantize(b, gguf.GGMLQuantizationType[fmt]), dtype=_U8).reshape(b.shape[0], -1)
    raise QuantError(f"cannot quantize to {fmt!r} ({', '.join(BLOCK)})")


def dequantize(blocks: np.ndarray, fmt: str) -> np.ndarray:
    """Blocks -> flat f32 values. ``"Q6_K"`` is LARQL's layout; ``GGML_Q6_K`` llama.cpp's.

    Q4_K, Q8_0, Q5_0, Q4_1 and GGML_Q6_K go through gguf-py's ``gguf.quants.dequantize``.
    """
    import gguf

    if fmt == "Q6_K":
        return dequantize_q6_k_larql(blocks)
    if fmt == GGML_Q6_K:
        b = _as_blocks(blocks, 210)
        return np.asarray(gguf.quants.dequantize(b, gguf.GGMLQuantizationType.Q6_K), dtype=_F32).reshape(-1)
    if fmt in ("Q4_K", "Q8_0", "Q5_0", "Q4_1"):
        b = _as_blocks(blocks, BLOCK[fmt][1])
        return np.asarray(gguf.quants.dequantize(b, gguf.GGMLQuantizationType[fmt]), dtype=_F32).reshape(-1)
    raise QuantError(f"cannot dequantize {fmt!r}")


def quantize_matrix(w: np.ndarray, fmt: str) -> QBlocks:
    """Pad each row of ``w`` to whole blocks with zeros (256 columns for the K-quants, as LARQL's q4k
    writer does) and quantize it."""
    w = np.asarray(w, dtype=_F32)
    if w.ndim != 2 or w.shape[0] == 0 or w.shape[1] == 0:
        raise QuantError(f"expected a non-empty 2-D matrix, got shape {w.shape}")
    p = pad_rows(w, BLOCK[_known(fmt)][0])
    blocks = quantize(p, fmt)
    return QBlocks(fmt, w.shape[0], p.shape[1], w.shape[1], blocks.reshape(w.shape[0], -1))


def dequantize_matrix(q: QBlocks, logical: bool = True) -> np.ndarray:
    """``[rows, logical_cols]`` f32 (or ``[rows, padded_cols]`` with ``logical=False``)."""
    vals = dequantize(q.data, q.format).reshape(q.rows, q.padded_cols)
    return vals[:, : q.logical_cols] if logical else vals


# -- GGUF tensors -> vindex blocks -----------------------------------------------------------------

# What LARQL does with each GGUF tensor type (``larql convert gguf-to-vindex`` ->
# ``larql-models/src/loading/gguf.rs`` + ``quant/ggml/mod.rs::dequantize``): every tensor is
# dequantized to f32 (F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q6_K; Q2_K/Q3_K/Q5_K are
# refused) into a float vindex; the q4k layout is then produced from f32 by ``quantize_q4_k`` /
# ``quantize_q6_k`` (``vindex_to_q4k`` / ``write_q4k``). LARQL never keeps a GGUF block. larql-edge
# keeps the GGUF's Q4_K blocks where the slot is Q4_K and its Q6_K blocks (re-laid-out, losslessly)
# where the slot is Q6_K; every other case is dequantized with gguf-py and quantized as LARQL does.
KEEPABLE = {("Q4_K", "Q4_K"), ("Q6_K", "Q6_K")}  # (GGUF type, vindex format)
# ``target=None`` (a ``quant: gguf`` vindex) keeps every GGUF_FORMATS tensor in its own type.
KEEP_OWN = None


def transcode_gguf(
    qtype: str,
    data: np.ndarray,
    rows: int,
    cols: int,
    target: str | None,
    row_order: np.ndarray | None = None,
    transform=None,
    chunk_rows: int = 4096,
) -> tuple[QBlocks, bool]:
    """A GGUF tensor ``[rows, cols]`` (``[out, in]``) as blocks of ``target``; returns (blocks, kept).

    ``qtype`` is the GGUF type name (``ReaderTensor.tensor_type.name``), ``data`` its raw bytes
    (``ReaderTensor.data``, any dtype). ``row_order`` reorders rows (e.g. undoing llama.cpp's Q/K
    permutation: ``out[i] = in[row_order[i]]``), which is lossless on blocks since each row is whole
    blocks. ``transform`` (a row-wise f32 function, applied per chunk of rows) forces the dequantize
    path. Converted tensors go ``chunk_rows`` rows at a time, so the f32 copy stays bounded.
    ``target=None`` keeps the tensor's own type if it is one of `GGUF_FORMATS` (else `GGUF_FALLBACK`).
    """
    import gguf

    if target is None:
        target = qtype if qtype in GGUF_FORMATS else GGUF_FALLBACK
        keep = qtype in GGUF_FORMATS
    elif target not in VINDEX_FORMATS:
        raise QuantError(f"vindex blocks are Q4_K or Q6_K, not {target!r}")
    else:
        keep = (qtype, target) in KEEPABLE
    if rows <= 0 or cols <= 0:
        raise QuantError(f"bad tensor shape [{rows}, {cols}]")
    raw = np.ascontiguousarray(data).view(_U8).reshape(-1)
    if raw.size % rows:
        raise QuantError(f"{qtype} tensor [{rows}, {cols}]: {raw.size} bytes do not split into {rows} rows")
    src = raw.reshape(rows, -1)  # every GGUF row is whole blocks (ne0 is a multiple of the block size)
    order = None if row_order is None else np.asarray(row_order)
    if order is not None and sorted(order.tolist()) != list(range(rows)):
        raise QuantError(f"row_order is not a permutation of {rows} rows")
    if keep and transform is None:
        rb = row_bytes(qtype, cols)
        if src.shape[1] != rb:
            raise QuantError(f"{qtype} tensor [{rows}, {cols}] needs {rows * rb} bytes, has {raw.size}")
        b = src if order is None else src[order]
        if qtype == "Q6_K":
            b = q6k_from_ggml(b).reshape(rows, rb)
        return QBlocks(target, rows, cols, cols, np.ascontiguousarray(b)), True
    try:
        t = gguf.GGMLQuantizationType[qtype]
    except KeyError:
        raise QuantError(f"unknown GGUF tensor type {qtype!r}") from None
    out = np.empty((rows, row_bytes(target, padded_for(target, cols))), dtype=_U8)
    for r0 in range(0, rows, max(1, chunk_rows)):
        r1 = min(rows, r0 + chunk_rows)
        part = src[r0:r1] if order is None else src[order[r0:r1]]
        try:
            w = np.asarray(gguf.quants.dequantize(part, t), dtype=_F32).reshape(r1 - r0, cols)
        except (ValueError, NotImplementedError) as e:
            raise QuantError(f"cannot dequantize a {qtype} tensor [{rows}, {cols}] ({e})") from None
        if transform is not None:
            w = np.asarray(transform(w), dtype=_F32)
        out[r0:r1] = quantize_matrix(w, target).data
    return QBlocks(target, rows, padded_for(target, cols), cols, out), False
