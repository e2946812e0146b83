"""Compute backends behind one small seam.

numpy (BLAS) is the default everywhere. On Apple Silicon run natively, MLX (Metal) is chosen
automatically; ``LARQL_BACKEND=numpy|mlx`` overrides (MLX also runs on Linux CPUs as ``mlx[cpu]``,
which is how its code path is tested off a Mac). Every tier calls the same model math through
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
    return "mlx" if native_apple and _mlx_available() else "numpy"


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
    raise ValueError(f"unknown backend {name!r}")
