"""What tests share about the kernels' thread count."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from larql_edge.model.kernels import get_threads, set_threads


@contextmanager
def kernel_threads(n: int) -> Iterator[None]:
    """Products and graphs at ``n`` kernel threads inside the block; the count before is restored after."""
    before = get_threads()
    set_threads(n)
    try:
        yield
    finally:
        set_threads(before)
