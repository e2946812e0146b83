"""Block geometry of the compact formats (the package's error type, `KernelError`, is in errors.py)."""

from __future__ import annotations

from dataclasses import dataclass

from larql_edge.errors import KernelError

__all__ = ["FORMATS", "BlockFormat", "KernelError", "block_format"]


@dataclass(frozen=True)
class BlockFormat:
    name: str
    block_values: int  # values per block (1 for the plain float formats)
    block_bytes: int  # bytes per block
    group: int  # values per kernel group (x is zero-padded to a multiple of it)

    def blocks_per_row(self, cols: int) -> int:
        return -(-cols // self.block_values)

    def row_bytes(self, cols: int) -> int:
        """Bytes of one stored row: K-quant rows are padded with zeros to whole blocks."""
        return self.blocks_per_row(cols) * self.block_bytes

    def padded_cols(self, cols: int) -> int:
        """Columns the kernels read from x: ``cols`` rounded up to a whole group."""
        return -(-cols // self.group) * self.group


# ggml's block layouts (ggml-common.h): block_q8_0, block_q4_K, block_q6_K.
FORMATS: dict[str, BlockFormat] = {
    "q8_0": BlockFormat("q8_0", 32, 34, 32),
    "q4_k": BlockFormat("q4_k", 256, 144, 64),
    "q6_k": BlockFormat("q6_k", 256, 210, 128),
    "f16": BlockFormat("f16", 1, 2, 64),
    "f32": BlockFormat("f32", 1, 4, 1),
}


def block_format(fmt: str) -> BlockFormat:
    try:
        return FORMATS[fmt]
    except (KeyError, TypeError):
        raise KernelError(f"unknown compact format {fmt!r}: expected one of {', '.join(FORMATS)}") from None
