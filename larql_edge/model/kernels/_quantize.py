"""Float weights -> ggml block bytes (Q8_0, Q4_K, Q6_K), row by row, zero-padding rows to whole blocks.

Q8_0 is gguf-py's own quantizer (ggml's reference: d = max|w| / 127, q = round(w / d)). gguf-py has
no K-quant quantizer, so Q4_K and Q6_K are plain round-to-nearest ones written here with numpy:
min/max scales per sub-block, then 6-bit (Q4_K) or int8 (Q6_K) scales of those against the block's
f16 super-scale. They produce valid ggml blocks (gguf-py dequantizes them; the tests check it) but
skip ggml's iterative scale search (make_qkx2_quants), so their error is somewhat above llama.cpp's.
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType, quants

from larql_edge.model.kernels._formats import block_format


def _blocks(w: np.ndarray, block: int) -> np.ndarray:
    """[rows, cols] float32 -> [rows * nblocks, block], rows zero-padded to whole blocks."""
    rows, cols = w.shape
    nb = -(-cols // block)
    if nb * block != cols:
        w = np.concatenate([w, np.zeros((rows, nb * block - cols), np.float32)], axis=1)
    return w.reshape(rows * nb, block)


def _f16_bytes(v: np.ndarray) -> np.ndarray:
    return v.astype(np.float16).reshape(-1, 1).view(np.uint8)


def quantize_q8_0(w: np.ndarray) -> np.ndarray:
    fmt = block_format("q8_0")
    rows, cols = w.shape
    b = _blocks(w, fmt.block_values)
    return np.ascontiguousarray(quants.quantize(b, GGMLQuantizationType.Q8_0)).reshape(rows, fmt.row_bytes(cols))


def quantize_q4_k(w: np.ndarray) -> np.ndarray:
    rows = w.shape[0]
    b = _blocks(w, 256).reshape(-1, 8, 32)  # [blocks, sub-block, value]
    lo = np.minimum(b.min(axis=-1), 0.0)  # ggml keeps the offset non-positive: w = d*sc*q - dmin*m
    scale = (b.max(axis=-1) - lo) / 15.0
    d = (scale.max(axis=-1) / 63.0).astype(np.float16).astype(np.float32)
    dmin = ((-lo).max(axis=-1) / 63.0).astype(np.float16).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d[:, None] > 0, np.round(scale / d[:, None]), 0).clip(0, 63).astype(np.uint8)
        m = np.where(dmin[:, None] > 0, np.round(-lo / dmin[:, None]), 0).clip(0, 63).astype(np.uint8)
        step = (d[:, None] * sc)[..., None]
        q = np.where(step > 0, np.round((b + (dmin[:, None] * m)[..., None]) / step), 0).clip(0, 15).astype(np.uint8)
    # 12 bytes of scales/mins (inverse of ggml's get_scale_min_k4)
    s12 = np.empty((b.shape[0], 12), np.uint8)
    s12[:, 0:4] = sc[:, 0:4] | ((sc[:, 4:8] >> 4) << 6)
    s12[:, 4:8] = m[:, 0:4] | ((m[:, 4:8] >> 4) << 6)
    s12[:, 8:12] = (sc[:, 4:8] & 0xF) | ((m[:, 4:8] & 0xF) << 4)
    # qs: chunk c holds sub-block 2c in the low nibbles and 2c+1 in the high nibbles
    q = q.reshape(-1, 4, 2, 32)
    qs = (q[:, :, 0, :] | (q[:, :, 1, :] << 4)).reshape(-1, 128)
    out = np.concatenate([_f16_bytes(d), _f16_bytes(dmin), s12, qs], axis=1)
    return out.reshape(rows, -1)


def quantize_q6_k(w: np.ndarray) -> np.ndarray:
    rows = w.shape[0]
    b = _blocks(w, 256).reshape(-1, 16, 16)  # [blocks, sub-block of 16, value]
    amax_i = np.abs(b).argmax(axis=-1)
    vmax = np.take_along_axis(b, amax_i[..., None], axis=-1)[..., 0]
    scale = vmax / -32.0  # the signed extreme maps to -32, as ggml does
    amax = np.abs(scale).argmax(axis=-1)
    smax = np.take_along_axis(scale, amax[:, None], axis=-1)[:, 0]
    d = (smax / -128.0).astype(np.float16).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d[:, None] != 0, np.round(scale / d[:, None]), 0).clip(-128, 127).astype(np.int8)
        step = (d[:, None] * sc)[..., None]
        q16 = np.where(step != 0, np.round(b / step), 0).clip(-32, 31).astype(np.int16) + 32
    q = q16.astype(np.uint8).reshape(-1, 2, 4, 32)  # [blocks, half, run k, l]: value 128h + 32k + l
    ql = np.empty((q.shape[0], 2, 64), np.uint8)
    ql[:, :, :32] = (q[:, :, 0] & 0xF) | ((q[:, :, 2] & 0xF) << 4)
    ql[:, :, 32:] = (q[:, :, 1] & 0xF) | ((q[:, :, 3] & 0xF) << 4)
    qh = (q[:, :, 0] >> 4) | ((q[:, :, 1] >> 4) << 2) | ((q[:, :, 2] >> 4) << 4) | ((q[:, :, 3] >> 4) << 6)
    out = np.concatenate([ql.reshape(-1, 128), qh.reshape(-1, 64), sc.view(np.uint8), _f16_bytes(d)], axis=1)
    return out.reshape(rows, -1)


QUANTIZERS = {"q8_0": quantize_q8_0, "q4_k": quantize_q4_k, "q6_k": quantize_q6_k}
