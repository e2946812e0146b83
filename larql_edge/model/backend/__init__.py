"""Compute backends behind one small seam.

- ``compact`` (the default): products on the weights as the vindex stores them (quantized blocks,
  f16 tables) through numba kernels, no float32 copy of a table (DESIGN.md, "Kernels").
- ``numpy``: everything dequantized to float32 and multiplied by BLAS: the exact reference.
- ``mlx``: Metal, chosen automatically on Apple Silicon run natively (also runs on Linux CPUs as
  ``mlx[cpu]``, which is how its code path is tested off a Mac).

``LARQL_BACKEND=compact|numpy|mlx`` overrides. Every tier calls the same model math through
``get_backend()``, so a role never branches on the backend itself.
"""

from __future__ import annotations

import platform
from functools import lru_cache

from larql_edge.config import backend_name
from larql_edge.model.backend._base import Backend
from larql_edge.model.backend._numpy import NumpyBackend

__all__ = ["Backend", "NumpyBackend", "get_backend", "default_backend_name"]


def _mlx_available() -> bool:
    try:
        import mlx.core  # noqa: F401
    except Exception:
        return False
    return True


def default_backend_name() -> str:
    wanted = backend_name()
    if wanted:
        return wanted
    native_apple = platform.system() == "Darwin" and platform.machine() == "arm64"
    return "mlx" if native_apple and _mlx_available() else "compact"


@lru_cache(maxsize=None)
def get_backend(name: str | None = None) -> Backend:
    name = name or default_backend_name()
    if name == "numpy":
        return NumpyBackend()
    if name == "mlx":
        if not _mlx_available():
            raise RuntimeError("LARQL_BACKEND=mlx but mlx is not installed (pip install 'larql-edge[mlx]')")
        from larql_edge.model.backend._mlx import MlxBackend

        return MlxBackend()
    if name == "compact":
        from larql_edge.model.backend._compact import CompactBackend

        return CompactBackend()
    raise ValueError(f"unknown backend {name!r}")
