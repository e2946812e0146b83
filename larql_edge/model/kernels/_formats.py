"""Block geometry of the compact formats: gguf-py's ``GGML_QUANT_SIZES``, the one table (format/quant.py's
``BLOCK`` is the same table for the vindex's block names); the error type, `KernelError`, is in errors.py."""

from __future__ import annotations

from dataclasses import dataclass

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from larql_edge.errors import KernelError

__all__ = ["FORMATS", "BlockFormat", "KernelError", "block_format"]


@dataclass(frozen=True)
class BlockFormat:
    name: str
    block_values: int  # values per block (1 for the plain float formats)
    block_bytes: int  # bytes per block

    def blocks_per_row(self, cols: int) -> int:
        return -(-cols // self.block_values)

    def row_bytes(self, cols: int) -> int:
        """Bytes of one stored row: quantized rows are padded with zeros to whole blocks (K-quants: 256)."""
        return self.blocks_per_row(cols) * self.block_bytes

    def padded_cols(self, cols: int) -> int:
        """Columns ggml reads from x: ``cols`` rounded up to whole blocks (x is zero past ``cols``)."""
        return self.blocks_per_row(cols) * self.block_values


def _fmt(name: str) -> BlockFormat:
    n, b = GGML_QUANT_SIZES[GGMLQuantizationType[name.upper()]]
    return BlockFormat(name, n, b)


# the kernels' names (lower case) for the ggml types they compute on, as the vindex stores them
FORMATS: dict[str, BlockFormat] = {f: _fmt(f) for f in ("q4_k", "q6_k", "q8_0", "q5_0", "q4_1", "f16", "f32")}


def block_format(fmt: str) -> BlockFormat:
    try:
        return FORMATS[fmt]
    except (KeyError, TypeError):
        raise KernelError(f"unknown compact format {fmt!r}: expected one of {', '.join(FORMATS)}") from None
