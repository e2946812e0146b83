"""The LARQL vindex v2 format: one module owns reading, writing and verifying the folder.

A vindex is a folder of role-split weight files plus ``index.json`` (DESIGN.md §1):

- ``embeddings.bin``   ``[vocab, hidden]`` f16 or f32, unscaled
- ``gate_vectors.bin`` per-layer ``[num_features, hidden]`` located by ``index.json.layers``
- ``attn_weights.bin``, ``norms.bin``, ``up_weights.bin``, ``down_weights.bin``, ``lm_head.bin``:
  raw tensors located by ``weight_manifest.json`` (``[out, in]`` orientation)
- ``tokenizer.json``   Hugging Face tokenizers format

Everything else in larql-edge reads a vindex through `Vindex`: typed metadata (`VindexIndex`),
tensors by manifest key, gate vectors by layer, rows by index; no raw offsets or ``open()`` of a
weight file anywhere else. Readers never copy weight data: arrays are read-only memory maps.
Writers stream into a staging folder beside the target and rename it at the end, so a failed or
killed write leaves nothing partial (and the next write removes a killed one's staging folder).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from larql_edge.errors import ChecksumMismatch, OutputExists, VindexError

from .index import DTYPES as DTYPE_NAMES
from .index import EXTRACT_LEVELS, FORMAT_VERSION, LayerInfo, ModelConfig, VindexIndex, level_rank
from .q4k import QUANT_MODES, Q4kWeights
from .quant import QBlocks, dequantize_matrix

__all__ = [
    "ATTN", "DOWN", "DTYPES", "EMBEDDINGS", "EXTRACT_LEVELS", "FORMAT_VERSION", "GATE", "INDEX", "LM_HEAD",
    "GENERATION_CONFIG", "MANIFEST", "NORMS", "TOKENIZER", "TOKENIZER_CONFIG",
    "UP", "LayerInfo", "ManifestEntry", "ModelConfig", "Vindex", "VindexIndex",
    "VindexWriter", "checksum_folder", "level_rank", "sha256_file", "staged_output", "write_index",
]  # fmt: skip

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
# Hugging Face's names, as LARQL's extractor copies them: the chat template and special tokens, and
# the ids that end a generation (a chat model's end-of-turn token among them).
TOKENIZER_CONFIG = "tokenizer_config.json"
GENERATION_CONFIG = "generation_config.json"
LM_HEAD_KEY = "lm_head.weight"

DTYPES = {name: np.dtype("<f2" if name == "f16" else "<f4") for name in DTYPE_NAMES}
MANIFEST_KINDS = ("vector", "tensor", "tensor_f16", "tensor_q4k", "packed_bf16", "tensor_gguf")  # the last: larql-edge's gguf


def sha256_file(path: Path, chunk: int = 8 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


@dataclass(frozen=True)
class ManifestEntry:
    key: str
    kind: str  # one of MANIFEST_KINDS
    shape: tuple[int, ...]
    offset: int
    length: int
    file: str

    @classmethod
    def from_json(cls, r: Any, where: str) -> "ManifestEntry":
        try:
            entry = cls(key=str(r["key"]), kind=str(r.get("kind", "tensor")), shape=tuple(int(s) for s in r["shape"]),
                        offset=int(r["offset"]), length=int(r["length"]), file=str(r.get("file") or "model_weights.bin"))
        except (KeyError, TypeError, ValueError, AttributeError) as err:
            raise VindexError(f"{where}: malformed entry ({type(err).__name__}: {err})") from None
        if entry.kind not in MANIFEST_KINDS:
            raise VindexError(f"{where}: {entry.key}: unknown kind {entry.kind!r}")
        if (entry.offset < 0 or entry.length < 0 or any(s < 0 for s in entry.shape) or "/" in entry.file
                or entry.file.startswith(".")):
            raise VindexError(f"{where}: {entry.key}: bad offset, length, shape or file name")
        return entry

    def to_json(self) -> dict[str, Any]:
        return {"key": self.key, "kind": self.kind, "shape": list(self.shape), "offset": self.offset,
                "length": self.length, "file": self.file}


class RowFile:
    """A ``[rows, cols]`` table in a file, read row by row with ``pread``: indexes like an array
    (``t[i]``, ``t[ids]``), returns fresh arrays, maps nothing. Safe to share between threads."""

    def __init__(self, path: Path, dtype: np.dtype, rows: int, cols: int):
        self.path, self.dtype, self.shape = Path(path), np.dtype(dtype), (rows, cols)
        self.ndim = 2
        self.row_nbytes = cols * self.dtype.itemsize
        self.nbytes = rows * self.row_nbytes
        if self.path.stat().st_size != self.nbytes:
            raise VindexError(f"{self.path}: {self.path.stat().st_size} bytes, expected {self.nbytes}")
        self._fd = os.open(self.path, os.O_RDONLY)

    def _row(self, i: int) -> bytes:
        b = os.pread(self._fd, self.row_nbytes, i * self.row_nbytes)
        if len(b) != self.row_nbytes:
            raise VindexError(f"{self.path}: truncated at row {i}")
        return b

    def __getitem__(self, idx) -> np.ndarray:
        rows, cols = self.shape
        if isinstance(idx, (int, np.integer)):
            i = int(idx)
            if not 0 <= i < rows:
                raise IndexError(f"row {i} outside [0, {rows})")
            return np.frombuffer(self._row(i), dtype=self.dtype)
        ids = np.asarray(idx).reshape(-1)
        if ids.size and (ids.min() < 0 or ids.max() >= rows):
            raise IndexError(f"row outside [0, {rows})")
        raw = b"".join(self._row(int(i)) for i in ids.tolist())
        return np.frombuffer(raw, dtype=self.dtype).reshape(ids.size, cols)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __del__(self) -> None:
        self.close()


class Vindex:
    """A vindex folder opened for reading. Cheap to open: nothing is mapped until asked for."""

    def __init__(self, path: Path, index: VindexIndex):
        self.path = path
        self.index = index
        self._manifest: dict[str, ManifestEntry] | None = None
        self._maps: dict[str, np.ndarray] = {}
        self._q4k: Q4kWeights | None = None

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
            raw = json.loads(ip.read_text())
        except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:  # RecursionError: nested too deep
            raise VindexError(f"{ip}: unreadable index.json ({e})") from None
        return cls(p, VindexIndex.from_json(raw, str(ip)))

    # -- metadata ------------------------------------------------------------------------------
    @property
    def model(self) -> str:
        return self.index.model or self.path.name

    @property
    def family(self) -> str:
        return self.index.family

    @property
    def hidden_size(self) -> int:
        return self.index.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.index.vocab_size

    @property
    def num_layers(self) -> int:
        return self.index.num_layers

    @property
    def dtype(self) -> str:
        return self.index.dtype

    @property
    def checksums(self) -> dict[str, str]:
        return dict(self.index.checksums)

    @property
    def embed_scale(self) -> float:
        return self.index.embed_scale

    @property
    def quantized(self) -> bool:
        """A ``quant: q4k`` (or larql-edge's ``gguf``) vindex: attention, FFN and an untied lm_head are
        blocks (Q4_K/Q6_K; in gguf each tensor's own GGUF type)."""
        return self.index.quant in QUANT_MODES

    @property
    def q4k(self) -> Q4kWeights:
        if not self.quantized:
            raise VindexError(f"{self.path}: not a quantized vindex (index.json quant={self.index.quant!r})")
        if self._q4k is None:
            self._q4k = Q4kWeights(self.path, self.index.to_json())
        return self._q4k

    @property
    def tied(self) -> bool:
        """Whether the embeddings serve as the lm_head.

        ``lm_head_tied`` says so when index.json has it; otherwise LARQL's rule: tied when no
        ``lm_head*.bin`` exists. (A tied larql-edge vindex also has ``lm_head.bin``: a link to
        ``embeddings.bin``, so LARQL's embed-only server finds its lm_head.)
        """
        if self.index.lm_head_tied is not None:
            return self.index.lm_head_tied
        heads = [p for p in self.path.glob("lm_head*.bin")]
        if not heads:
            return True
        # LARQL's extractor may write a tied model's lm_head.bin as a copy or a link of the embeddings.
        emb = self.path / EMBEDDINGS
        return heads == [self.path / LM_HEAD] and emb.is_file() and os.path.samefile(heads[0], emb)

    def has(self, name: str) -> bool:
        return (self.path / name).is_file()

    def files(self) -> list[Path]:
        return sorted(f for f in self.path.iterdir() if f.is_file() and not f.name.startswith("."))

    # -- raw arrays ----------------------------------------------------------------------------
    def _map(self, name: str) -> np.ndarray:
        m = self._maps.get(name)
        if m is None:
            fp = self.path / name
            if not fp.is_file():
                raise VindexError(f"{self.path}: missing {name}")
            if fp.stat().st_size == 0:
                raise VindexError(f"{fp}: empty file")
            # A plain ndarray view of the memory map: numpy's memmap subclass costs microseconds of
            # bookkeeping on every slice, and the map stays alive through the view's base.
            m = np.memmap(fp, dtype=np.uint8, mode="r").view(np.ndarray)
            self._maps[name] = m
        return m

    def embeddings_dtype(self) -> np.dtype:
        """The embedding table's storage type: index.json's ``dtype``.

        LARQL's loader decides this one file by its size (embeddings may stay f16 in a vindex whose
        other files were converted), so a table whose size fits the other type is read as that.
        """
        size = (self.path / EMBEDDINGS).stat().st_size
        count = self.vocab_size * self.hidden_size
        declared = DTYPES[self.dtype]
        if size == count * declared.itemsize:
            return declared
        for dt in DTYPES.values():
            if size == count * dt.itemsize:
                return dt
        raise VindexError(f"{self.path / EMBEDDINGS}: {size} bytes fits neither f16 nor f32 "
                          f"[{self.vocab_size}, {self.hidden_size}]")

    def embeddings(self) -> np.ndarray:
        """The raw (unscaled) embedding table as a read-only ``[vocab, hidden]`` memory map."""
        if not self.has(EMBEDDINGS):
            raise VindexError(f"{self.path}: missing {EMBEDDINGS}")
        dt = self.embeddings_dtype()
        return self._map(EMBEDDINGS).view(dt).reshape(self.vocab_size, self.hidden_size)

    def embedding_rows(self) -> RowFile:
        """The embedding table for scattered row reads (an embed server's lookups), read with ``pread``:
        through a memory map each page fault also maps up to 15 neighbouring pages (the kernel's
        fault-around, which MADV_RANDOM does not stop), so 10,000 lookups of Gemma's table left ~300 MB
        of it resident instead of the ~13 MB they read."""
        if not self.has(EMBEDDINGS):
            raise VindexError(f"{self.path}: missing {EMBEDDINGS}")
        return RowFile(self.path / EMBEDDINGS, self.embeddings_dtype(), self.vocab_size, self.hidden_size)

    @property
    def manifest(self) -> dict[str, ManifestEntry]:
        if self._manifest is None:
            mp = self.path / MANIFEST
            if not mp.is_file():
                self._manifest = {}
            else:
                try:
                    rows = json.loads(mp.read_text())
                except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
                    raise VindexError(f"{mp}: malformed weight manifest ({e})") from None
                if not isinstance(rows, list):
                    raise VindexError(f"{mp}: the weight manifest must be a JSON array")
                entries = [ManifestEntry.from_json(r, str(mp)) for r in rows]
                self._manifest = {e.key: e for e in entries}
        return self._manifest

    def has_tensor(self, key: str) -> bool:
        e = self.manifest.get(key)
        return e is not None and self.has(e.file)

    def _entry(self, key: str) -> ManifestEntry:
        e = self.manifest.get(key)
        if e is None:
            raise VindexError(f"{self.path}: no tensor {key!r} in {MANIFEST}")
        return e

    def tensor_dtype(self, key: str) -> np.dtype:
        """The storage type of a float tensor: index.json's ``dtype``, except where LARQL's writers
        fix it (``tensor_f16`` entries are f16; a q4k vindex keeps norms in f32)."""
        e = self._entry(key)
        if e.kind == "tensor_f16":
            dt = DTYPES["f16"]
        elif e.kind in ("tensor_q4k", "packed_bf16", "tensor_gguf"):
            raise VindexError(f"{self.path}: tensor {key!r} is {e.kind}, not a float tensor")
        elif self.quantized and e.file == NORMS:
            dt = DTYPES["f32"]
        else:
            dt = DTYPES[self.dtype]
        count = int(np.prod(e.shape))
        if e.length != count * dt.itemsize:
            raise VindexError(f"{self.path / e.file}: tensor {key!r} has {e.length} bytes, expected "
                              f"{count * dt.itemsize} for {list(e.shape)} {dt.name} (index.json dtype {self.dtype})")
        return dt

    def tensor(self, key: str) -> np.ndarray:
        """A manifest tensor as a read-only memory map (f16 or f32 as stored)."""
        e = self._entry(key)
        dt = self.tensor_dtype(key)
        raw = self._map(e.file)
        if e.offset + e.length > raw.size:
            raise VindexError(f"{self.path / e.file}: tensor {key!r} lies outside the file (truncated?)")
        return raw[e.offset : e.offset + e.length].view(dt).reshape(e.shape)

    def tensor_f32(self, key: str) -> np.ndarray:
        return np.asarray(self.tensor(key), dtype=np.float32)

    def weight(self, key: str) -> np.ndarray | QBlocks:
        """A weight matrix as the vindex stores it: a float memory map, or, in a q4k vindex, the
        projection's (or the untied lm_head's) blocks, zero-copy. What the roles load."""
        if self.quantized and (key != LM_HEAD_KEY or self.has(self.q4k.lm_head_file)):
            if key.startswith("layers.") or key == LM_HEAD_KEY:
                return self.q4k.tensor(key)
        return self.tensor(key)

    def has_weight(self, key: str) -> bool:
        if self.quantized and key == LM_HEAD_KEY and self.has(self.q4k.lm_head_file):
            return True
        if self.quantized and key.startswith("layers.") and key.endswith("_proj.weight"):
            return True
        return self.has_tensor(key)

    def read_rows(self, key: str | None, start: int, count: int) -> np.ndarray:
        """Rows ``[start, start + count)`` of a 2-D tensor (``None``: the embedding table) as a
        fresh array in the stored type, read with ``pread``: converting a whole table through its
        memory map would leave all of it resident in this process."""
        if key is None:
            name, offset, dt = EMBEDDINGS, 0, self.embeddings_dtype()
            rows, cols = self.vocab_size, self.hidden_size
        else:
            e = self._entry(key)
            if len(e.shape) != 2:
                raise VindexError(f"{self.path}: tensor {key!r} is not 2-D")
            name, offset, dt = e.file, e.offset, self.tensor_dtype(key)
            rows, cols = e.shape
        if start < 0 or count < 0 or start + count > rows:
            raise VindexError(f"rows {start}..{start + count} outside [0, {rows})")
        nbytes = count * cols * dt.itemsize
        fd = os.open(self.path / name, os.O_RDONLY)
        try:
            buf = os.pread(fd, nbytes, offset + start * cols * dt.itemsize)
        finally:
            os.close(fd)
        if len(buf) != nbytes:
            raise VindexError(f"{self.path / name}: truncated while reading rows {start}..{start + count}")
        return np.frombuffer(buf, dtype=dt).reshape(count, cols)

    def has_gate(self) -> bool:
        return self.has(GATE) and bool(self.index.layers)

    def gate(self, layer: int) -> np.ndarray:
        """Layer ``layer``'s gate projection ``[num_features, hidden]`` from gate_vectors.bin (a q4k
        vindex without that file: dequantized from its interleaved gate blocks, as LARQL does)."""
        info = self.index.layer(layer)
        if self.quantized and not self.has(GATE):
            return dequantize_matrix(self.q4k.ffn(layer)[0]).astype(np.float16)
        if info is None:
            raise VindexError(f"{self.path}: no gate vectors for layer {layer}")
        raw = self._map(GATE)
        if info.offset + info.length > raw.size:
            raise VindexError(f"{self.path / GATE}: layer {layer} lies outside the file (truncated?)")
        dt = DTYPES[self.dtype]
        if info.length != info.num_features * self.hidden_size * dt.itemsize:
            raise VindexError(f"{self.path / GATE}: layer {layer} has {info.length} bytes, expected "
                              f"{info.num_features} x {self.hidden_size} {self.dtype}")
        return raw[info.offset : info.offset + info.length].view(dt).reshape(info.num_features, self.hidden_size)

    @property
    def tokenizer_path(self) -> Path:
        return self.path / TOKENIZER

    def load_tokenizer(self):
        """tokenizer.json as a Hugging Face ``tokenizers.Tokenizer`` (VindexError when absent or unreadable)."""
        from tokenizers import Tokenizer

        path = self.tokenizer_path
        if not path.is_file():
            raise VindexError(f"{self.path}: no tokenizer.json")
        try:
            return Tokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises its own Exception type
            raise VindexError(f"{path}: unreadable tokenizer ({e})") from None

    def tokenizer_config(self) -> dict[str, Any]:
        """tokenizer_config.json (chat_template, bos_token, eos_token, ...), {} when the vindex has none."""
        return self._optional_json(TOKENIZER_CONFIG)

    def generation_config(self) -> dict[str, Any]:
        """generation_config.json (eos_token_id: the ids that end a generation), {} when absent."""
        return self._optional_json(GENERATION_CONFIG)

    def _optional_json(self, name: str) -> dict[str, Any]:
        fp = self.path / name
        if not fp.is_file():
            return {}
        try:
            data = json.loads(fp.read_text())
        except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:  # RecursionError: nested too deep
            raise VindexError(f"{fp}: unreadable ({e})") from None
        if not isinstance(data, dict):
            raise VindexError(f"{fp}: expected a JSON object")
        return data

    # -- verification ----------------------------------------------------------------------------
    def verify(self) -> list[str]:
        """Recompute every checksum; return one problem line per missing or corrupt file."""
        problems: list[str] = []
        sums = self.checksums
        if not sums:
            problems.append(f"{INDEX} records no checksums")
        if self.has(EMBEDDINGS):  # the shapes index.json claims must be those of its files
            try:
                self.embeddings_dtype()
            except VindexError as e:
                problems.append(f"{EMBEDDINGS}: contradicts {INDEX} ({e})")
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

_STAGING_SUFFIX = ".partial"


def _staging_pid(name: str, target: str) -> int | None:
    """The writer's pid from a staging folder name ``.<target>.<pid>.partial``."""
    prefix = f".{target}."
    if not (name.startswith(prefix) and name.endswith(_STAGING_SUFFIX)):
        return None
    mid = name[len(prefix) : -len(_STAGING_SUFFIX)]
    return int(mid) if mid.isdigit() else None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_staging(out: Path) -> list[Path]:
    """Remove staging folders beside ``out`` whose writer is gone (a killed extract or slice)."""
    removed: list[Path] = []
    if not out.parent.is_dir():
        return removed
    for p in out.parent.iterdir():
        pid = _staging_pid(p.name, out.name)
        if pid is not None and pid != os.getpid() and not _alive(pid) and p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
    return removed


def _replaceable(out: Path) -> bool:
    """--force replaces a vindex folder (or an empty one), never any other folder or file."""
    if out.is_dir():
        return (out / INDEX).is_file() or not any(out.iterdir())
    return False


@contextmanager
def staged_output(out: str | os.PathLike[str], force: bool = False) -> Iterator[Path]:
    """Yield a staging folder beside ``out``; rename it to ``out`` only if the block succeeds.

    A failed or interrupted write removes the staging folder; a killed one leaves it, and the next
    write to the same ``out`` removes it. ``out`` is either the old content or the complete new one.
    """
    out = Path(out)
    if out.exists() or out.is_symlink():
        if not force:
            raise OutputExists(f"{out} exists (use --force to replace it)")
        if not _replaceable(out):
            raise OutputExists(f"{out} exists and is not a vindex folder: --force replaces only a vindex "
                               "(or an empty folder); remove it yourself if you mean it")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_staging(out)
        tmp = out.parent / f".{out.name}.{os.getpid()}{_STAGING_SUFFIX}"
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
    except PermissionError as e:
        raise OutputExists(f"cannot write {out}: permission denied ({e.filename or out.parent})") from None
    except OSError as e:
        raise OutputExists(f"cannot write {out}: {e.strerror or e}") from None
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
        self.layers: list[LayerInfo] = []

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
        self.layers.append(LayerInfo(layer=layer, num_features=int(arr.shape[0]), offset=off, length=n))

    def write_embeddings(self, arr: np.ndarray) -> None:
        with open(self.folder / EMBEDDINGS, "wb") as f:
            # Row blocks keep peak memory at one block above the source table.
            step = 16384
            for i in range(0, arr.shape[0], step):
                block = np.ascontiguousarray(arr[i : i + step], dtype=self.dtype)
                if not np.all(np.isfinite(block)):
                    raise VindexError("refusing to write non-finite embedding values")
                f.write(block.tobytes())

    def link_tied_lm_head(self, vocab: int, hidden: int) -> None:
        """A tied model's ``lm_head.bin``: a link to ``embeddings.bin`` (no second copy on disk,
        ADR-0008), with its manifest entry, so LARQL's embed-only server finds an lm_head. A hard
        link where the filesystem allows one (slicing and publishing then see an ordinary file with
        the same sha256, which the Hub stores once), else a relative symlink."""
        try:
            os.link(self.folder / EMBEDDINGS, self.folder / LM_HEAD)
        except OSError:
            os.symlink(EMBEDDINGS, self.folder / LM_HEAD)
        n = vocab * hidden * self.dtype.itemsize
        self.entries.append(ManifestEntry(key=LM_HEAD_KEY, kind="tensor", shape=(vocab, hidden), offset=0,
                                          length=n, file=LM_HEAD))

    def write_json(self, name: str, obj: Any) -> None:
        (self.folder / name).write_text(json.dumps(obj, indent=2) + "\n")

    def close_files(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()

    def finish(self, index: VindexIndex) -> VindexIndex:
        """Close the data files, write the manifest, checksum everything, write index.json."""
        self.close_files()
        if self.entries:
            self.write_json(MANIFEST, [e.to_json() for e in self.entries])
        index = index.replace(version=FORMAT_VERSION, dtype=self.dtype_name,
                              layers=tuple(sorted(self.layers, key=lambda r: r.layer)),
                              checksums=checksum_folder(self.folder))
        write_index(self.folder, index)
        return index


def checksum_folder(folder: Path) -> dict[str, str]:
    return {
        f.name: sha256_file(f)
        for f in sorted(Path(folder).iterdir())
        if f.is_file() and f.name != INDEX and not f.name.startswith(".")
    }


def write_index(folder: Path, index: VindexIndex) -> None:
    """Write index.json atomically (temp file + rename)."""
    folder = Path(folder)
    tmp = folder / f".{INDEX}.tmp"
    tmp.write_text(json.dumps(index.to_json(), indent=2) + "\n")
    os.replace(tmp, folder / INDEX)
