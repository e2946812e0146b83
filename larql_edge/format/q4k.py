"""LARQL's ``quant: q4k`` vindex layout: the quantized weight files, read and written byte-exactly.

What LARQL's q4k writer emits (``crates/larql-vindex/src/format/weights/write_q4k/{mod,attn,ffn,norms,
lm_head}.rs``, ``weights/manifest.rs``, ``filenames.rs``; LARQL commit c880fb7):

- ``attn_weights_q4k.bin``: per layer Q, K, V, O (``[out, in]``), each row zero-padded to a multiple
  of 256 columns; Q/K/O Q4_K, V Q6_K (LARQL's Q6_K layout, see `quant`). Located by
  ``attn_weights_q4k_manifest.json``: a JSON array, 4 entries per layer in that order,
  ``{key, shape: [rows, padded_cols], format: "Q4_K"|"Q6_K", offset, length}``. LARQL's readers find a
  layer's tensors by position (``layer*4 + i``), not by key.
- ``interleaved_q4k.bin`` + ``interleaved_q4k_manifest.json``: per layer gate Q4_K, up Q4_K, down
  Q6_K (Q4_K with ``--down-q4k``), same entry shape; entry index = ``layer*3 + component``.
- ``norms.bin``: always f32. Per layer input_layernorm, post_attention_layernorm,
  pre_feedforward_layernorm, post_feedforward_layernorm, q_norm, k_norm (those the model has), then
  the final ``norm.weight``; each a ``weight_manifest.json`` entry ``kind: "vector"``.
- ``lm_head_q4.bin``: Q4_K of the output projection, rows padded, only when the source has a separate
  ``lm_head.weight`` (LARQL's streaming extractor writes none for tied models); its
  ``weight_manifest.json`` entry is ``{key: "lm_head.weight", kind: "tensor_q4k", shape: [vocab,
  padded_cols], offset: 0, length, file: "lm_head_q4.bin"}``, appended after the norms.
- ``weight_manifest.json``: the norm entries then the lm_head entry. The q4k writer writes no
  ``attn_weights.bin``/``up_weights.bin``/``down_weights.bin``/``lm_head.bin``.
- ``index.json`` gets ``has_model_weights: true``, ``quant: "q4k"`` and ``model_config``; the CLI
  forces ``dtype: "f16"`` for the float side files (``gate_vectors.bin``, ``embeddings.bin``).

**``quant: gguf``** is larql-edge's own variant of this layout (LARQL refuses it at ``index.json``): the
same files, manifests and positions, but every tensor keeps the block type its GGUF file gave it
(`quant.GGUF_FORMATS`: Q4_K, Q6_K in LARQL's layout, Q8_0, Q5_0, Q4_1), rows padded to whole blocks of
that type, so compute runs on exactly the GGUF's weights. An untied lm_head goes to ``lm_head_gguf.bin``
(``kind: "tensor_gguf"`` with a ``format`` field). GGUF files called "Q4_K_M" hold mostly other types
(Gemma 3 270M: Q5_0/Q8_0 for q, k, v, gate, up; SmolLM2: Q4_1), which LARQL's slots must requantize.

All JSON is ``serde_json::to_string_pretty`` (2-space indent, no trailing newline), which
``json.dumps(indent=2)`` reproduces byte for byte.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

import numpy as np

from larql_edge.errors import VindexError
from larql_edge.format.quant import (
    BLOCK,
    GGUF_FALLBACK,
    GGUF_FORMATS,
    VINDEX_FORMATS,
    QBlocks,
    QuantError,
    dequantize_matrix,
    padded_for,
    quantize_matrix,
    row_bytes,
)

ATTN_Q4K = "attn_weights_q4k.bin"
ATTN_Q4K_MANIFEST = "attn_weights_q4k_manifest.json"
FFN_Q4K = "interleaved_q4k.bin"
FFN_Q4K_MANIFEST = "interleaved_q4k_manifest.json"
LM_HEAD_Q4 = "lm_head_q4.bin"
LM_HEAD_GGUF = "lm_head_gguf.bin"  # quant: gguf (larql-edge's own)
QUANT_MODES = ("q4k", "gguf")
NORMS = "norms.bin"
WEIGHT_MANIFEST = "weight_manifest.json"
INDEX = "index.json"

ATTN_PROJ = ("q_proj", "k_proj", "v_proj", "o_proj")
FFN_PROJ = ("gate_proj", "up_proj", "down_proj")
ATTN_FORMATS = ("Q4_K", "Q4_K", "Q6_K", "Q4_K")


def ffn_formats(down_q4k: bool = False) -> tuple[str, str, str]:
    return ("Q4_K", "Q4_K", "Q4_K" if down_q4k else "Q6_K")


def attn_key(layer: int, i: int) -> str:
    return f"layers.{layer}.self_attn.{ATTN_PROJ[i]}.weight"


def ffn_key(layer: int, i: int) -> str:
    return f"layers.{layer}.mlp.{FFN_PROJ[i]}.weight"


# Norm order within a layer in LARQL's q4k norms.bin (``write_q4k/norms.rs``): keys the model lacks
# are skipped. The final ``norm.weight`` follows the last layer.
NORM_SUFFIXES = (
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
    "pre_feedforward_layernorm.weight",
    "post_feedforward_layernorm.weight",
    "self_attn.q_norm.weight",
    "self_attn.k_norm.weight",
)

# The only files LARQL checksums (``format/checksums.rs::compute_checksums``): no q4k file is covered.
LARQL_CHECKSUMMED = (
    "gate_vectors.bin", "embeddings.bin", "down_meta.bin", "down_meta.jsonl", "attn_weights.bin",
    "up_weights.bin", "down_weights.bin", "norms.bin", "lm_head.bin",
)


def larql_checksums(folder: str | os.PathLike[str]) -> dict[str, str]:
    """``index.json.checksums`` as LARQL computes it: sha256 of the listed files that exist."""
    from larql_edge.format.vindex import sha256_file

    folder = Path(folder)
    return {n: sha256_file(folder / n) for n in LARQL_CHECKSUMMED if (folder / n).is_file()}


def dump_json(obj: Any) -> str:
    """``serde_json::to_string_pretty`` output for plain JSON values (LARQL writes no final newline)."""
    return json.dumps(obj, indent=2, ensure_ascii=False)


@dataclass(frozen=True)
class Q4kEntry:
    """One manifest entry: a tensor's slice of its .bin file."""

    key: str
    format: str
    rows: int
    padded_cols: int
    offset: int
    length: int
    file: str

    def to_json(self) -> dict[str, Any]:
        # Field order of LARQL's Q4kManifestEntry.
        return {"key": self.key, "shape": [self.rows, self.padded_cols], "format": self.format,
                "offset": self.offset, "length": self.length}


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def manifest_formats(quant: str) -> tuple[str, ...]:
    """The block formats a manifest of a ``quant`` vindex may name."""
    return GGUF_FORMATS if quant == "gguf" else VINDEX_FORMATS


def parse_q4k_manifest(path: Path, file_size: int, formats: tuple[str, ...] = VINDEX_FORMATS) -> list[Q4kEntry]:
    """Read and validate a ``*_q4k_manifest.json`` against the size of the .bin it describes."""
    where = str(path)
    try:
        rows = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:  # RecursionError: nested too deep
        raise VindexError(f"{where}: unreadable manifest ({e})") from None
    if not isinstance(rows, list):
        raise VindexError(f"{where}: manifest is not a JSON array")
    binary = path.name.removesuffix("_manifest.json") + ".bin"
    out: list[Q4kEntry] = []
    for i, r in enumerate(rows):
        tag = f"{where}: entry {i}"
        if not isinstance(r, dict):
            raise VindexError(f"{tag} is not an object")
        key = r.get("key")
        if not isinstance(key, str) or not key:
            raise VindexError(f"{tag} has no key")
        tag = f"{where}: entry {i} ({key})"
        fmt, shape = r.get("format"), r.get("shape")
        if fmt not in formats:
            raise VindexError(f"{tag}: unknown format {fmt!r} ({' or '.join(formats)})")
        if not (isinstance(shape, list) and len(shape) == 2 and all(_int(s) and s > 0 for s in shape)):
            raise VindexError(f"{tag}: shape {shape!r} is not [rows, padded_cols]")
        off, length = r.get("offset"), r.get("length")
        if not (_int(off) and _int(length)):
            raise VindexError(f"{tag}: offset/length must be non-negative integers")
        nrows, pcols = shape
        n = BLOCK[fmt][0]
        if pcols % n:
            raise VindexError(f"{tag}: padded_cols {pcols} is not a multiple of {n}")
        want = nrows * row_bytes(fmt, pcols)
        if length != want:
            raise VindexError(f"{tag}: length {length} but {fmt} {shape} needs {want} bytes")
        if off + length > file_size:
            raise VindexError(f"{tag}: bytes {off}..{off + length} lie outside {binary} ({file_size} bytes; truncated?)")
        out.append(Q4kEntry(key, fmt, nrows, pcols, int(off or 0), int(length or 0), binary))
    return out


class Q4kWeights:
    """The quantized weights of a q4k vindex folder, opened for reading.

    Tensors come back as `QBlocks` whose ``data`` is a read-only, zero-copy memory map of the .bin
    file, ``[rows, row_bytes]`` uint8. Manifests are validated when first used; nothing is copied.
    """

    def __init__(self, path: str | os.PathLike[str], index: dict[str, Any] | None = None):
        self.path = Path(path)
        if index is None:
            ip = self.path / INDEX
            try:
                index = json.loads(ip.read_text())
            except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:  # RecursionError: nested too deep
                raise VindexError(f"{ip}: unreadable index.json ({e})") from None
        if not isinstance(index, dict):
            raise VindexError(f"{self.path / INDEX}: index.json is not a JSON object")
        if index.get("quant") not in QUANT_MODES:
            raise VindexError(f"{self.path}: not a quantized vindex (index.json quant={index.get('quant', 'none')!r})")
        for k in ("num_layers", "hidden_size"):
            if not (_int(index.get(k)) and index[k] > 0):
                raise VindexError(f"{self.path / INDEX}: {k} must be a positive integer")
        self.index = index
        self.quant = str(index["quant"])
        self.formats = manifest_formats(self.quant)
        self.lm_head_file = LM_HEAD_GGUF if self.quant == "gguf" else LM_HEAD_Q4
        self.num_layers = int(index["num_layers"])
        self.hidden_size = int(index["hidden_size"])
        self._maps: dict[str, np.memmap] = {}
        self._positional: dict[str, list[Q4kEntry]] = {}
        self._weights: dict[str, dict[str, Any]] | None = None

    # -- files ---------------------------------------------------------------------------------
    def has(self, name: str) -> bool:
        return (self.path / name).is_file()

    @property
    def has_attn(self) -> bool:
        return self.has(ATTN_Q4K)

    @property
    def has_ffn(self) -> bool:
        return self.has(FFN_Q4K)

    def _map(self, name: str) -> np.memmap:
        m = self._maps.get(name)
        if m is None:
            fp = self.path / name
            if not fp.is_file():
                raise VindexError(f"{self.path}: missing {name} (sliced out of this vindex?)")
            if fp.stat().st_size == 0:
                raise VindexError(f"{fp}: empty file")
            m = np.memmap(fp, dtype=np.uint8, mode="r")
            self._maps[name] = m
        return m

    def _entries(self, binary: str, manifest: str, per_layer: int, key_of) -> list[Q4kEntry]:
        got = self._positional.get(binary)
        if got is None:
            size = self._map(binary).size
            mp = self.path / manifest
            if not mp.is_file():
                raise VindexError(f"{self.path}: {binary} has no {manifest}")
            got = parse_q4k_manifest(mp, size, self.formats)
            want = per_layer * self.num_layers
            if len(got) != want:
                raise VindexError(f"{mp}: {len(got)} entries, expected {want} ({per_layer} per layer x {self.num_layers} layers)")
            for i, e in enumerate(got):  # LARQL reads by position: keys must agree with positions
                expect = key_of(i // per_layer, i % per_layer)
                if e.key != expect:
                    raise VindexError(f"{mp}: entry {i} is {e.key!r}, expected {expect!r} (LARQL indexes entries by position)")
            self._positional[binary] = got
        return got

    def attn_entries(self) -> list[Q4kEntry]:
        return self._entries(ATTN_Q4K, ATTN_Q4K_MANIFEST, 4, attn_key)

    def ffn_entries(self) -> list[Q4kEntry]:
        return self._entries(FFN_Q4K, FFN_Q4K_MANIFEST, 3, ffn_key)

    # -- tensors -------------------------------------------------------------------------------
    def _blocks(self, e: Q4kEntry, logical: int) -> QBlocks:
        if padded_for(e.format, logical) != e.padded_cols:
            raise VindexError(f"{self.path / e.file}: {e.key} has {e.padded_cols} padded columns, "
                              f"which does not fit a {logical}-column matrix")
        raw = self._map(e.file)[e.offset : e.offset + e.length]
        return QBlocks(e.format, e.rows, e.padded_cols, logical, raw.reshape(e.rows, -1))

    def attn(self, layer: int) -> tuple[QBlocks, QBlocks, QBlocks, QBlocks]:
        """Layer ``layer``'s (q, k, v, o) projections."""
        es = self._layer(self.attn_entries(), layer, 4)
        h = self.hidden_size
        return (self._blocks(es[0], h), self._blocks(es[1], h), self._blocks(es[2], h), self._blocks(es[3], es[0].rows))

    def ffn(self, layer: int) -> tuple[QBlocks, QBlocks, QBlocks]:
        """Layer ``layer``'s (gate, up, down) projections; down's width is gate's row count."""
        es = self._layer(self.ffn_entries(), layer, 3)
        h = self.hidden_size
        return (self._blocks(es[0], h), self._blocks(es[1], h), self._blocks(es[2], es[0].rows))

    def _layer(self, entries: list[Q4kEntry], layer: int, per: int) -> list[Q4kEntry]:
        if not (isinstance(layer, int) and 0 <= layer < self.num_layers):
            raise VindexError(f"{self.path}: no layer {layer} (num_layers={self.num_layers})")
        return entries[layer * per : (layer + 1) * per]

    def tensor(self, key: str) -> QBlocks:
        """A quantized tensor by key: ``layers.N.self_attn.{q,k,v,o}_proj.weight``,
        ``layers.N.mlp.{gate,up,down}_proj.weight`` or ``lm_head.weight``."""
        parts = key.split(".")
        if key == "lm_head.weight":
            lm = self.lm_head()
            if lm is None:
                raise VindexError(f"{self.path}: no {self.lm_head_file} (tied model: the embeddings are the lm_head)")
            return lm
        if len(parts) == 5 and parts[0] == "layers" and parts[1].isdigit() and parts[4] == "weight":
            layer, group, name = int(parts[1]), parts[2], parts[3]
            if group == "self_attn" and name in ATTN_PROJ:
                return self.attn(layer)[ATTN_PROJ.index(name)]
            if group == "mlp" and name in FFN_PROJ:
                return self.ffn(layer)[FFN_PROJ.index(name)]
        raise VindexError(f"{self.path}: {key!r} is not a quantized tensor of a {self.quant} vindex")

    def matrix(self, key: str) -> np.ndarray:
        """``tensor(key)`` dequantized to f32 ``[rows, logical_cols]`` (padding dropped)."""
        return dequantize_matrix(self.tensor(key))

    # -- weight_manifest.json: norms and lm_head ------------------------------------------------
    @property
    def weight_entries(self) -> dict[str, dict[str, Any]]:
        if self._weights is None:
            mp = self.path / WEIGHT_MANIFEST
            if not mp.is_file():
                self._weights = {}
                return self._weights
            try:
                rows = json.loads(mp.read_text())
            except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:  # RecursionError: nested too deep
                raise VindexError(f"{mp}: unreadable weight manifest ({e})") from None
            if not isinstance(rows, list):
                raise VindexError(f"{mp}: weight manifest is not a JSON array")
            out: dict[str, dict[str, Any]] = {}
            for i, r in enumerate(rows):
                ok = (isinstance(r, dict) and isinstance(r.get("key"), str) and isinstance(r.get("kind"), str)
                      and isinstance(r.get("shape"), list) and all(_int(s) for s in r["shape"])
                      and _int(r.get("offset")) and _int(r.get("length")))
                if not ok:
                    raise VindexError(f"{mp}: entry {i} is not {{key, kind, shape, offset, length, file}}")
                out[r["key"]] = r
            self._weights = out
        return self._weights

    def lm_head(self) -> QBlocks | None:
        """The untied lm_head as blocks (Q4_K in q4k; its GGUF type in gguf), or None when the vindex
        has none (tied model)."""
        mp = self.path / WEIGHT_MANIFEST
        file, kind = self.lm_head_file, "tensor_gguf" if self.quant == "gguf" else "tensor_q4k"
        e = self.weight_entries.get("lm_head.weight")
        if not self.has(file):
            if e is not None and e.get("kind") == kind:
                raise VindexError(f"{mp} lists lm_head.weight in {file}, which is missing (sliced out?)")
            return None
        if e is None or e.get("kind") != kind or e.get("file", file) != file:
            raise VindexError(f"{mp}: {file} exists but has no lm_head.weight entry of kind {kind}")
        fmt = e.get("format", "Q4_K") if self.quant == "gguf" else "Q4_K"
        if fmt not in self.formats:
            raise VindexError(f"{mp}: lm_head.weight format {fmt!r} is not one of {', '.join(self.formats)}")
        shape = e["shape"]
        if len(shape) != 2 or shape[0] <= 0 or shape[1] % BLOCK[fmt][0]:
            raise VindexError(f"{mp}: lm_head.weight shape {shape!r} is not [vocab, padded_cols]")
        size = self._map(file).size
        want = shape[0] * row_bytes(fmt, shape[1])
        if e["length"] != want or e["offset"] + e["length"] > size:
            raise VindexError(f"{self.path / file}: lm_head.weight needs {want} bytes at offset "
                              f"{e['offset']}, manifest says {e['length']}, file has {size}")
        entry = Q4kEntry("lm_head.weight", fmt, shape[0], shape[1], e["offset"], e["length"], file)
        return self._blocks(entry, self.hidden_size)

    def vector(self, key: str) -> np.ndarray:
        """A norm vector from its manifest file (f32 in LARQL's q4k norms.bin; f16 told apart by size)."""
        e = self.weight_entries.get(key)
        if e is None or e.get("kind") != "vector":
            raise VindexError(f"{self.path / WEIGHT_MANIFEST}: no vector {key!r}")
        file = e.get("file") or NORMS
        raw = self._map(file)
        n = int(np.prod(e["shape"]))
        off, length = e["offset"], e["length"]
        if off + length > raw.size:
            raise VindexError(f"{self.path / file}: vector {key!r} lies outside the file (truncated?)")
        if length == 4 * n:
            return raw[off : off + length].view("<f4")
        if length == 2 * n:
            return raw[off : off + length].view("<f2")
        raise VindexError(f"{self.path / file}: vector {key!r} is {length} bytes, neither f32 nor f16 for {n} values")

    def keys(self) -> list[str]:
        out: list[str] = []
        if self.has_attn:
            out += [e.key for e in self.attn_entries()]
        if self.has_ffn:
            out += [e.key for e in self.ffn_entries()]
        if self.has(self.lm_head_file):
            out.append("lm_head.weight")
        return out

    def validate(self) -> None:
        """Check every manifest present against its file (each entry's size, bounds and format)."""
        if self.has_attn:
            self.attn_entries()
            for i in range(self.num_layers):
                self.attn(i)
        if self.has_ffn:
            self.ffn_entries()
            for i in range(self.num_layers):
                self.ffn(i)
        self.lm_head()
        for key, e in self.weight_entries.items():
            if e.get("kind") == "vector":
                self.vector(key)


QUANTIZE_ROWS = 4096  # rows quantized at a time: bounds the padded f32 copy, not the output bytes


def _check_blocks(q: QBlocks, fmt: str | None, what: str) -> QBlocks:
    if fmt is None:  # quant: gguf keeps the tensor's own type
        if q.format not in GGUF_FORMATS:
            raise VindexError(f"{what}: {q.format} blocks cannot go into a gguf vindex ({', '.join(GGUF_FORMATS)})")
        fmt = q.format
    if q.format != fmt:
        raise VindexError(f"{what}: the slot is {fmt}, given {q.format} blocks (convert with quant.transcode_gguf)")
    try:
        need = q.rows * row_bytes(fmt, q.padded_cols)
    except QuantError as e:
        raise VindexError(f"{what}: {e}") from None
    if q.data.dtype != np.uint8 or q.data.size != need:
        raise VindexError(f"{what}: {q.data.size} bytes is not {fmt} [{q.rows}, {q.padded_cols}]")
    if padded_for(fmt, q.logical_cols) != q.padded_cols:
        raise VindexError(f"{what}: {q.logical_cols} columns do not pad to {q.padded_cols}")
    return q


def _quantized_parts(w, fmt: str | None, what: str):
    """(format, rows, logical_cols, padded_cols, iterator of uint8 row blocks) for an array or `QBlocks`.

    ``fmt=None`` (quant: gguf): blocks keep their own format; an array is quantized to `GGUF_FALLBACK`.
    """
    if isinstance(w, QBlocks):
        q = _check_blocks(w, fmt, what)
        return q.format, q.rows, q.logical_cols, q.padded_cols, iter([q.data])
    fmt = fmt or GGUF_FALLBACK
    a = np.asarray(w)
    if a.ndim != 2 or a.shape[0] == 0 or a.shape[1] == 0:
        raise VindexError(f"{what}: expected a non-empty [out, in] matrix, got shape {a.shape}")

    def chunks():
        for r in range(0, a.shape[0], QUANTIZE_ROWS):
            try:
                yield quantize_matrix(a[r : r + QUANTIZE_ROWS], fmt).data
            except QuantError as e:
                raise VindexError(f"{what}: {e}") from None

    return fmt, a.shape[0], a.shape[1], padded_for(fmt, a.shape[1]), chunks()


class Q4kWriter:
    """Streams the q4k weight files into ``folder``: one tensor in memory at a time.

    Call `add_attn` and `add_ffn` for layers 0, 1, ... in order (LARQL locates tensors by position),
    `add_norm` in LARQL's norm order (`NORM_SUFFIXES` per layer, then ``norm.weight``), `add_lm_head`
    for an untied model, then `finish`. Tensors are f32 ``[out, in]`` arrays (row-padded and quantized
    here as LARQL does) or `QBlocks` already in the slot's format (GGUF blocks kept as they are).
    """

    def __init__(self, folder: str | os.PathLike[str], num_layers: int, hidden_size: int, down_q4k: bool = False,
                 quant: str = "q4k"):
        if quant not in QUANT_MODES:
            raise VindexError(f"unknown quantized layout {quant!r} ({' or '.join(QUANT_MODES)})")
        self.quant = quant
        self.folder = Path(folder)
        self.num_layers = num_layers
        self.hidden_size = hidden_size
        self.ffn_formats = ffn_formats(down_q4k)
        self._files: dict[str, Any] = {}
        self._offsets: dict[str, int] = {}
        self.attn_manifest: list[Q4kEntry] = []
        self.ffn_manifest: list[Q4kEntry] = []
        self.weight_manifest: list[dict[str, Any]] = []
        self._next = {ATTN_Q4K: 0, FFN_Q4K: 0}
        self._lm_head: dict[str, Any] | None = None
        self.kept = 0  # tensors whose source blocks were kept as they are

    def _write(self, name: str, data: np.ndarray) -> tuple[int, int]:
        f = self._files.get(name)
        if f is None:
            f = open(self.folder / name, "wb")  # noqa: SIM115 - stays open across calls; closed in close()
            self._files[name] = f
            self._offsets[name] = 0
        off = self._offsets[name]
        buf = np.ascontiguousarray(data)
        f.write(buf.tobytes())
        self._offsets[name] = off + buf.nbytes
        return off, buf.nbytes

    def _expect_layer(self, file: str, layer: int) -> None:
        if layer != self._next[file]:
            raise VindexError(f"{file}: layer {layer} given, expected layer {self._next[file]} (layers go in order)")
        if layer >= self.num_layers:
            raise VindexError(f"{file}: layer {layer} is beyond num_layers={self.num_layers}")

    def _slot(self, fmt: str) -> str | None:
        return None if self.quant == "gguf" else fmt

    def _stream(self, file: str, key: str, fmt: str, w, in_cols: int, out_rows: int | None) -> tuple[str, int, int, int, int]:
        fmt_, rows, cols, pcols, parts = _quantized_parts(w, self._slot(fmt), key)
        if cols != in_cols:
            raise VindexError(f"{key}: {cols} input columns, expected {in_cols}")
        if out_rows is not None and rows != out_rows:
            raise VindexError(f"{key}: {rows} rows, expected {out_rows}")
        start, total = self._offsets.get(file, 0), 0
        for part in parts:
            _, n = self._write(file, part)
            total += n
        self.kept += isinstance(w, QBlocks)
        return fmt_, rows, pcols, start, total

    def _add(self, file: str, manifest: list[Q4kEntry], key: str, fmt: str, w, in_cols: int, out_rows: int | None) -> int:
        fmt_, rows, pcols, off, n = self._stream(file, key, fmt, w, in_cols, out_rows)
        manifest.append(Q4kEntry(key, fmt_, rows, pcols, off, n, file))
        return rows

    def add_attn(self, layer: int, q, k, v, o) -> None:
        self._expect_layer(ATTN_Q4K, layer)
        h, fm = self.hidden_size, ATTN_FORMATS
        q_rows = self._add(ATTN_Q4K, self.attn_manifest, attn_key(layer, 0), fm[0], q, h, None)
        self._add(ATTN_Q4K, self.attn_manifest, attn_key(layer, 1), fm[1], k, h, None)
        self._add(ATTN_Q4K, self.attn_manifest, attn_key(layer, 2), fm[2], v, h, None)
        self._add(ATTN_Q4K, self.attn_manifest, attn_key(layer, 3), fm[3], o, q_rows, h)
        self._next[ATTN_Q4K] += 1

    def add_ffn(self, layer: int, gate, up, down) -> None:
        self._expect_layer(FFN_Q4K, layer)
        h, fm = self.hidden_size, self.ffn_formats
        g_rows = self._add(FFN_Q4K, self.ffn_manifest, ffn_key(layer, 0), fm[0], gate, h, None)
        self._add(FFN_Q4K, self.ffn_manifest, ffn_key(layer, 1), fm[1], up, h, g_rows)
        self._add(FFN_Q4K, self.ffn_manifest, ffn_key(layer, 2), fm[2], down, g_rows, h)
        self._next[FFN_Q4K] += 1

    def add_norm(self, key: str, vec: np.ndarray) -> None:
        """A norm vector, stored f32 in norms.bin (``kind: "vector"``)."""
        v = np.asarray(vec, dtype="<f4")
        if v.ndim != 1 or v.size == 0:
            raise VindexError(f"{key}: a norm must be a non-empty vector, got shape {v.shape}")
        if not np.all(np.isfinite(v)):
            raise VindexError(f"refusing to write non-finite values into {NORMS} ({key})")
        off, n = self._write(NORMS, v)
        self.weight_manifest.append({"key": key, "kind": "vector", "shape": [int(v.size)], "offset": off,
                                     "length": n, "file": NORMS})

    def add_lm_head(self, w) -> None:
        """The untied lm_head ``[vocab, hidden]``: Q4_K into lm_head_q4.bin (q4k), or its own blocks
        into lm_head_gguf.bin (gguf)."""
        file = LM_HEAD_GGUF if self.quant == "gguf" else LM_HEAD_Q4
        if self._lm_head:
            raise VindexError(f"{file}: lm_head given twice")
        fmt, rows, pcols, off, n = self._stream(file, "lm_head.weight", "Q4_K", w, self.hidden_size, None)
        # LARQL appends this entry after every norm entry, whenever it is given.
        self._lm_head = {"key": "lm_head.weight", "kind": "tensor_q4k", "shape": [rows, pcols],
                         "offset": off, "length": n, "file": file}
        if self.quant == "gguf":
            self._lm_head |= {"kind": "tensor_gguf", "format": fmt}

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def finish(self) -> dict[str, Any]:
        """Close the files, write the three manifests; return the index.json fields LARQL's writer sets."""
        self.close()
        for file in (ATTN_Q4K, FFN_Q4K):
            if self._next[file] != self.num_layers:
                raise VindexError(f"{file}: {self._next[file]} of {self.num_layers} layers written")
        (self.folder / ATTN_Q4K_MANIFEST).write_text(dump_json([e.to_json() for e in self.attn_manifest]))
        (self.folder / FFN_Q4K_MANIFEST).write_text(dump_json([e.to_json() for e in self.ffn_manifest]))
        entries = self.weight_manifest + ([self._lm_head] if self._lm_head else [])
        (self.folder / WEIGHT_MANIFEST).write_text(dump_json(entries))
        return {"dtype": "f16", "quant": self.quant, "has_model_weights": True}
