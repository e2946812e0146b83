"""Compute backends behind one small seam.

- ``compact`` (the default on every platform): products on the weights as the vindex stores them
  (quantized blocks, f16 tables) through ggml's own CPU kernels (``libggml-python``: AVX2 on x86-64,
  NEON on arm64 Linux and Apple Silicon), no float32 copy of a table (DESIGN.md, "Kernels").
- ``numpy``: everything dequantized to float32 and multiplied by BLAS: the exact reference.
- ``mlx``: Metal through MLX, opt-in (``LARQL_BACKEND=mlx``). Not the Mac default: it dequantizes every
  table to float32 (a 270M model's tied lm_head alone grows from 178 MB of Q8_0 to 671 MB) while ggml's
  NEON kernels read the stored blocks; ggml's own Metal backend (in the macOS wheel) is not wired up.
  Used only when ggml cannot be loaded on Apple Silicon.

``LARQL_BACKEND=compact|numpy|mlx`` overrides. Every tier calls the same model math through
``get_backend()``, so a role never branches on the backend itself.
"""

from __future__ import annotations

import platform
from functools import lru_cache

from larql_edge.config import backend_name
from larql_edge.model.backend._base import Backend
from larql_edge.model.backend._numpy import NumpyBackend

__all__ = ["Backend", "NumpyBackend", "backend_info", "choose_backend", "default_backend_name", "get_backend"]


def _mlx_available() -> bool:
    try:
        import mlx.core  # noqa: F401
    except Exception:
        return False
    return True


def _ggml_available() -> bool:
    from larql_edge.model.kernels._ggml import available

    return available()


def choose_backend(system: str, machine: str, ggml: bool, mlx: bool) -> str:
    """The automatic choice, as a pure function of the platform and what loads (tested on Linux):
    ggml wherever it loads; else MLX on Apple Silicon run natively; else the float32 reference."""
    if ggml:
        return "compact"
    if system == "Darwin" and machine == "arm64" and mlx:
        return "mlx"
    return "numpy"


def default_backend_name() -> str:
    wanted = backend_name()
    if wanted:
        return wanted
    ggml = _ggml_available()
    native_apple = platform.system() == "Darwin" and platform.machine() == "arm64"
    return choose_backend(platform.system(), platform.machine(), ggml, native_apple and not ggml and _mlx_available())


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
        from larql_edge.model.kernels._ggml import lib

        lib()  # a clear KernelError now if libggml-python is missing, not on the first product
        return CompactBackend()
    raise ValueError(f"unknown backend {name!r}")


def backend_info(name: str | None = None) -> dict:
    """What computes here: the backend's name and, for ``compact``, ggml's library, version, path,
    CPU features and kernel threads (``/v1/stats`` ``kernels``, ``larql-slicer inspect --backend``)."""
    name = name or default_backend_name()
    if name != "compact":
        return {"backend": name}
    from larql_edge.model.kernels import kernel_info

    return {"backend": name, **kernel_info()}
