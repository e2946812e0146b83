"""A machine-local cache of extracted vindexes, keyed by the source GGUF's sha256.

`larql-grid up`, the tests and the benchmarks all need the packaged models as vindexes; extracting
Gemma 3 270M takes ~20 s, so each (source sha256, level, dtype) is extracted once per machine.
``LARQL_CACHE_DIR`` moves the cache (default ``~/.cache/larql-edge``).
"""

from __future__ import annotations

import fcntl
import hashlib
from pathlib import Path

from larql_edge.config import cache_dir
from larql_edge.format.vindex import Vindex, sha256_file
from larql_edge.tools.slicer.extract import EXTRACTOR_REVISION, extract, resolve


def source_digest(path: Path) -> str:
    """sha256 of a source file, memoised beside the cache by (path, size, mtime)."""
    st = path.stat()
    ident = hashlib.sha256(f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:24]
    memo = cache_dir() / "digests" / f"{ident}.sha256"
    if memo.is_file():
        return memo.read_text().strip()
    digest = sha256_file(path)
    memo.parent.mkdir(parents=True, exist_ok=True)
    memo.write_text(digest)
    return digest


def _build_once(out: Path, build) -> Path:
    """Make ``out`` with ``build(out)`` unless it is complete; concurrent callers build it once.

    Several processes (pytest workers, grid roles) may ask at once: one builds, the rest wait on a
    lock beside ``out`` and then find it complete. Builders write atomically (index.json last).
    """
    if not (out / "index.json").is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        with open(out.parent / f".{out.name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not (out / "index.json").is_file():
                build(out)
    return out


def cached_vindex(source: str, level: str = "all", dtype: str = "f16", progress: bool = False, log=print,
                  quant: str = "none") -> Path:
    """Path of a complete vindex for ``source`` (a packaged alias or GGUF path), extracting on first use."""
    kind, path = resolve(source)
    key = source_digest(path) if kind == "gguf" else Path(path).resolve().name
    # The extractor's revision is part of the key: a newer larql-edge that writes more (or other)
    # files for the same source must not be handed an older extraction (e.g. one without the chat
    # template) from the cache.
    name = f"{key[:16]}-{level}-{dtype if quant == 'none' else quant}-r{EXTRACTOR_REVISION}"
    out = cache_dir() / "vindex" / name
    _build_once(out, lambda o: extract(str(path), o, level=level, dtype=dtype, force=True, progress=progress, log=log,
                                       quant=quant))
    Vindex.open(out)
    return out


def cached_slice(vindex: Path, preset: str) -> Path:
    """A preset slice of a cached vindex, kept beside it (hard links: no extra disk)."""
    from larql_edge.format.presets import canonical_preset
    from larql_edge.tools.slicer.slice import slice_vindex

    preset = canonical_preset(preset)
    out = vindex.parent / f"{vindex.name}.slices" / preset
    return _build_once(out, lambda o: slice_vindex(vindex, o, preset=preset, force=True, log=lambda m: None))
