"""The LARQL vindex v2 format: one module owns reading, writing and verifying it.

A vindex is a folder of role-split weight files plus ``index.json`` (see DESIGN.md §1):

- ``embeddings.bin``   ``[vocab, hidden]`` f16 or f32 (told apart by size), unscaled
- ``gate_vectors.bin`` per-layer ``[num_features, hidden]`` located by ``index.json.layers``
- ``attn_weights.bin``, ``norms.bin``, ``up_weights.bin``, ``down_weights.bin``, ``lm_head.bin``:
  raw tensors located by ``weight_manifest.json`` (``[out, in]`` orientation)
- ``tokenizer.json``   Hugging Face tokenizers format

Readers never copy weight data: arrays are read-only memory maps of the files. Unknown
``index.json`` keys are kept on rewrite. Writers stream into a temporary folder beside the
target and rename at the end, so a failed write leaves nothing partial.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from larql_edge.tools.slicer.errors import ChecksumMismatch, OutputExists, VindexError

FORMAT_VERSION = 2
INDEX = "index.json"
MANIFEST = "weight_manifest.json"
EMBEDDINGS = "embeddings.bin"
GATE = "gate_vectors.bin"
NORMS = "norms.bin"
ATTN = "attn_weights.bin"
UP = "up_weights.bin"
DOWN = "down_weights.bin"
LM_HEAD = "lm_head.bin"
TOKENIZER = "tokenizer.json"

EXTRACT_LEVELS = ("browse", "attention", "inference", "all")
DTYPES = {"f16": np.dtype("<f2"), "f32": np.dtype("<f4")}

REQUIRED_INDEX_FIELDS = ("version", "num_layers", "hidden_size", "vocab_size")


def level_rank(level: str) -> int:
    try:
        return EXTRACT_LEVELS.index(level)
    except ValueError:
        raise VindexError(f"unknown extract_level {level!r} (one of {', '.join(EXTRACT_LEVELS)})") from None


def sha256_file(path: Path, chunk: int = 8 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


@dataclass(frozen=True)
class ManifestEntry:
    key: str
    kind: str  # "tensor" | "vector"
    shape: tuple[int, ...]
    offset: int
    length: int
    file: str

    def to_json(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "kind": self.kind,
            "shape": list(self.shape),
            "offset": self.offset,
            "length": self.length,
            "file": self.file,
        }


def _dtype_for(nbytes: int, count: int, where: str) -> np.dtype:
    """Storage dtype told apart by size, as LARQL does (a vindex may mix f16 and f32 files)."""
    if nbytes == count * 4:
        return DTYPES["f32"]
    if nbytes == count * 2:
        return DTYPES["f16"]
    raise VindexError(f"{where}: {nbytes} bytes is neither f16 nor f32 for {count} values")


class Vindex:
    """A vindex folder opened for reading. Cheap to open: nothing is mapped until asked for."""

    def __init__(self, path: Path, index: dict[str, Any]):
        self.path = path
        self.index = index
        self._manifest: dict[str, ManifestEntry] | None = None
        self._maps: dict[str, np.memmap] = {}

    # -- opening -----------------------------------------------------------------------------
    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> "Vindex":
        p = Path(path)
        if not p.is_dir():
            raise VindexError(f"{p}: not a vindex folder (no such directory)")
        ip = p / INDEX
        if not ip.is_file():
            raise VindexError(f"{p}: missing {INDEX}")
        try:
            index = json.loads(ip.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise VindexError(f"{ip}: unreadable index.json ({e})") from None
        if not isinstance(index, dict):
            raise VindexError(f"{ip}: index.json is not a JSON object")
        missing = [k for k in REQUIRED_INDEX_FIELDS if k not in index]
        if missing:
            raise VindexError(f"{ip}: index.json lacks {', '.join(missing)}")
        if index.get("version") != FORMAT_VERSION:
            raise VindexError(f"{ip}: unsupported vindex version {index.get('version')!r} (expected 2)")
        for k in ("num_layers", "hidden_size", "vocab_size"):
            if not isinstance(index[k], int) or index[k] <= 0:
                raise VindexError(f"{ip}: {k} must be a positive integer")
        return cls(p, index)

    # -- metadata ------------------------------------------------------------------------------
    @property
    def model(self) -> str:
        return str(self.index.get("model", self.path.name))

    @property
    def family(self) -> str:
        return str(self.index.get("family", ""))

    @property
    def hidden_size(self) -> int:
        return int(self.index["hidden_size"])

    @property
    def vocab_size(self) -> int:
        return int(self.index["vocab_size"])

    @property
    def num_layers(self) -> int:
        return int(self.index["num_layers"])

    @property
    def model_config(self) -> dict[str, Any]:
        return dict(self.index.get("model_config") or {})

    @property
    def checksums(self) -> dict[str, str]:
        return dict(self.index.get("checksums") or {})

    @property
    def tied(self) -> bool:
        """Tied when no lm_head file exists: the embeddings then serve as the lm_head."""
        return not any(self.path.glob("lm_head*.bin"))

    def has(self, name: str) -> bool:
        return (self.path / name).is_file()

    def files(self) -> list[Path]:
        return sorted(f for f in self.path.iterdir() if f.is_file())

    # -- raw arrays ----------------------------------------------------------------------------
    def _map(self, name: str) -> np.memmap:
        m = self._maps.get(name)
        if m is None:
            fp = self.path / name
            if not fp.is_file():
                raise VindexError(f"{self.path}: missing {name}")
            if fp.stat().st_size == 0:
                raise VindexError(f"{fp}: empty file")
            m = np.memmap(fp, dtype=np.uint8, mode="r")
            self._maps[name] = m
        return m

    def embeddings(self) -> np.ndarray:
        """The raw (unscaled) embedding table as a read-only ``[vocab, hidden]`` memory map."""
        raw = self._map(EMBEDDINGS)
        count = self.vocab_size * self.hidden_size
        dt = _dtype_for(raw.size, count, EMBEDDINGS)
        return raw.view(dt).reshape(self.vocab_size, self.hidden_size)

    @property
    def embed_scale(self) -> float:
        return float(self.index.get("embed_scale", 1.0))

    @property
    def manifest(self) -> dict[str, ManifestEntry]:
        if self._manifest is None:
            mp = self.path / MANIFEST
            if not mp.is_file():
                self._manifest = {}
            else:
                try:
                    rows = json.loads(mp.read_text())
                    self._manifest = {
                        r["key"]: ManifestEntry(
                            key=r["key"],
                            kind=r.get("kind", "tensor"),
                            shape=tuple(int(s) for s in r["shape"]),
                            offset=int(r["offset"]),
                            length=int(r["length"]),
                            file=r.get("file") or "model_weights.bin",
                        )
                        for r in rows
                    }
                except (OSError, ValueError, KeyError, TypeError) as e:
                    raise VindexError(f"{mp}: malformed weight manifest ({e})") from None
        return self._manifest

    def has_tensor(self, key: str) -> bool:
        e = self.manifest.get(key)
        return e is not None and self.has(e.file)

    def tensor(self, key: str) -> np.ndarray:
        """A manifest tensor as a read-only memory map (f16 or f32 as stored)."""
        e = self.manifest.get(key)
        if e is None:
            raise VindexError(f"{self.path}: no tensor {key!r} in {MANIFEST}")
        raw = self._map(e.file)
        if e.offset < 0 or e.offset + e.length > raw.size:
            raise VindexError(f"{self.path / e.file}: tensor {key!r} lies outside the file (truncated?)")
        count = int(np.prod(e.shape))
        dt = _dtype_for(e.length, count, f"{e.file}:{key}")
        return raw[e.offset : e.offset + e.length].view(dt).reshape(e.shape)

    def tensor_f32(self, key: str) -> np.ndarray:
        return np.asarray(self.tensor(key), dtype=np.float32)

    @property
    def layers(self) -> list[dict[str, Any]]:
        return list(self.index.get("layers") or [])

    def has_gate(self) -> bool:
        return self.has(GATE) and bool(self.layers)

    def gate(self, layer: int) -> np.ndarray:
        """Layer ``layer``'s gate projection ``[num_features, hidden]`` from gate_vectors.bin."""
        for info in self.layers:
            if int(info["layer"]) == layer:
                raw = self._map(GATE)
                off, length = int(info["offset"]), int(info["length"])
                if off + length > raw.size:
                    raise VindexError(f"{self.path / GATE}: layer {layer} lies outside the file (truncated?)")
                n = int(info["num_features"])
                dt = _dtype_for(length, n * self.hidden_size, f"{GATE}:layer {layer}")
                return raw[off : off + length].view(dt).reshape(n, self.hidden_size)
        raise VindexError(f"{self.path}: no gate vectors for layer {layer}")

    @property
    def tokenizer_path(self) -> Path:
        return self.path / TOKENIZER

    # -- verification ----------------------------------------------------------------------------
    def verify(self) -> list[str]:
        """Recompute every checksum; return one problem line per missing or corrupt file."""
        problems: list[str] = []
        sums = self.checksums
        if not sums:
            problems.append(f"{INDEX} records no checksums")
        for name, want in sorted(sums.items()):
            fp = self.path / name
            if not fp.is_file():
                problems.append(f"{name}: missing")
                continue
            got = sha256_file(fp)
            if got != want:
                problems.append(f"{name}: corrupt (sha256 {got[:12]}…, index.json says {want[:12]}…)")
        return problems

    def verify_or_raise(self) -> None:
        problems = self.verify()
        if problems:
            raise ChecksumMismatch(problems)


# -- writing ------------------------------------------------------------------------------------


@contextmanager
def staged_output(out: str | os.PathLike[str], force: bool = False) -> Iterator[Path]:
    """Yield a temporary folder beside ``out``; rename it to ``out`` only if the block succeeds.

    A failed or interrupted write removes the temporary folder, so ``out`` is either the old
    content (nothing) or the complete new one.
    """
    out = Path(out)
    if out.exists() and not force:
        raise OutputExists(f"{out} exists (use --force to replace it)")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes 0700; the result is an ordinary folder
    try:
        yield tmp
        if out.exists():
            trash = out.with_name(f".{out.name}.old-{os.getpid()}")
            os.replace(out, trash)
            os.replace(tmp, out)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


class VindexWriter:
    """Streams tensors into the role files of a vindex folder, then writes manifest and index."""

    def __init__(self, folder: Path, dtype: str = "f16"):
        if dtype not in DTYPES:
            raise VindexError(f"unknown dtype {dtype!r} (f16 or f32)")
        self.folder = Path(folder)
        self.dtype_name = dtype
        self.dtype = DTYPES[dtype]
        self._files: dict[str, Any] = {}
        self._offsets: dict[str, int] = {}
        self.entries: list[ManifestEntry] = []
        self.layers: list[dict[str, Any]] = []

    def _append(self, file: str, arr: np.ndarray, dtype: np.dtype | None = None) -> tuple[int, int]:
        data = np.ascontiguousarray(arr, dtype=dtype or self.dtype)
        if not np.all(np.isfinite(data)):
            raise VindexError(f"refusing to write non-finite values into {file}")
        f = self._files.get(file)
        if f is None:
            f = open(self.folder / file, "wb")
            self._files[file] = f
            self._offsets[file] = 0
        off = self._offsets[file]
        f.write(data.tobytes())
        self._offsets[file] = off + data.nbytes
        return off, data.nbytes

    def add(self, file: str, key: str, arr: np.ndarray) -> ManifestEntry:
        kind = "vector" if arr.ndim == 1 else "tensor"
        off, n = self._append(file, arr)
        e = ManifestEntry(key=key, kind=kind, shape=tuple(arr.shape), offset=off, length=n, file=file)
        self.entries.append(e)
        return e

    def add_gate(self, layer: int, arr: np.ndarray) -> None:
        off, n = self._append(GATE, arr)
        self.layers.append({"layer": layer, "num_features": int(arr.shape[0]), "offset": off, "length": n})

    def write_embeddings(self, arr: np.ndarray) -> None:
        with open(self.folder / EMBEDDINGS, "wb") as f:
            # Row blocks keep peak memory at one block above the source table.
            step = 16384
            for i in range(0, arr.shape[0], step):
                block = np.ascontiguousarray(arr[i : i + step], dtype=self.dtype)
                if not np.all(np.isfinite(block)):
                    raise VindexError("refusing to write non-finite embedding values")
                f.write(block.tobytes())

    def write_json(self, name: str, obj: Any) -> None:
        (self.folder / name).write_text(json.dumps(obj, indent=2) + "\n")

    def close_files(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()

    def finish(self, index: dict[str, Any]) -> dict[str, Any]:
        """Close the data files, write the manifest, checksum everything, write index.json."""
        self.close_files()
        if self.entries:
            self.write_json(MANIFEST, [e.to_json() for e in self.entries])
        index = dict(index)
        index["version"] = FORMAT_VERSION
        index["dtype"] = self.dtype_name
        index["layers"] = sorted(self.layers, key=lambda r: r["layer"])
        index["checksums"] = checksum_folder(self.folder)
        write_index(self.folder, index)
        return index


def checksum_folder(folder: Path) -> dict[str, str]:
    return {
        f.name: sha256_file(f)
        for f in sorted(Path(folder).iterdir())
        if f.is_file() and f.name != INDEX and not f.name.startswith(".")
    }


def write_index(folder: Path, index: dict[str, Any]) -> None:
    """Write index.json atomically (temp file + rename)."""
    folder = Path(folder)
    tmp = folder / f".{INDEX}.tmp"
    tmp.write_text(json.dumps(index, indent=2) + "\n")
    os.replace(tmp, folder / INDEX)


def read_index(folder: str | os.PathLike[str]) -> dict[str, Any]:
    return Vindex.open(folder).index
