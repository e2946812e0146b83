"""Round trips for every file the vindex writer writes, and the reader's tolerance rules."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from larql_edge.errors import OutputExists, VindexError
from larql_edge.format.vindex import ATTN, DOWN, LM_HEAD, NORMS, UP, Vindex, VindexIndex, VindexWriter, staged_output, write_index

V, H, F, L = 50, 16, 24, 3


def _write(folder, dtype, rng):
    arrays = {}
    w = VindexWriter(folder, dtype=dtype)
    arrays["emb"] = rng.standard_normal((V, H)).astype(np.float32)
    w.write_embeddings(arrays["emb"])
    for i in range(L):
        arrays[f"gate{i}"] = rng.standard_normal((F, H)).astype(np.float32)
        w.add_gate(i, arrays[f"gate{i}"])
        for file, key, shape in [
            (ATTN, f"layers.{i}.self_attn.q_proj.weight", (H, H)),
            (NORMS, f"layers.{i}.input_layernorm.weight", (H,)),
            (UP, f"layers.{i}.mlp.up_proj.weight", (F, H)),
            (DOWN, f"layers.{i}.mlp.down_proj.weight", (H, F)),
        ]:
            arrays[key] = rng.standard_normal(shape).astype(np.float32)
            w.add(file, key, arrays[key])
    arrays["lm_head.weight"] = rng.standard_normal((V, H)).astype(np.float32)
    w.add(LM_HEAD, "lm_head.weight", arrays["lm_head.weight"])
    (folder / "tokenizer.json").write_text('{"version": "1.0"}')
    ix = w.finish(VindexIndex.from_json({"version": 2, "model": "t", "family": "llama", "num_layers": L, "hidden_size": H,
                                         "vocab_size": V, "intermediate_size": F, "future_field": {"kept": True}}))
    return arrays, ix


@pytest.mark.parametrize("dtype,np_dtype", [("f32", np.float32), ("f16", np.float16)])
def test_every_file_round_trips(tmp_path, dtype, np_dtype):
    arrays, ix = _write(tmp_path, dtype, np.random.default_rng(0))
    vx = Vindex.open(tmp_path)
    assert vx.embeddings().dtype == np_dtype
    np.testing.assert_array_equal(vx.embeddings(), arrays["emb"].astype(np_dtype))
    for i in range(L):
        np.testing.assert_array_equal(vx.gate(i), arrays[f"gate{i}"].astype(np_dtype))
    for key, arr in arrays.items():
        if "." in key:
            np.testing.assert_array_equal(vx.tensor(key), arr.astype(np_dtype))
    assert not vx.tied
    assert vx.verify() == []
    manifest = json.loads((tmp_path / "weight_manifest.json").read_text())
    assert {m["file"] for m in manifest} == {ATTN, NORMS, UP, DOWN, LM_HEAD}
    assert all(set(m) == {"key", "kind", "shape", "offset", "length", "file"} for m in manifest)
    assert {m["kind"] for m in manifest if m["file"] == NORMS} == {"vector"}


def test_unknown_index_keys_are_ignored_and_kept_on_rewrite(tmp_path):
    _write(tmp_path, "f32", np.random.default_rng(1))
    vx = Vindex.open(tmp_path)
    assert vx.index.extra["future_field"] == {"kept": True}
    write_index(tmp_path, vx.index.replace(extract_level="attention"))
    again = Vindex.open(tmp_path).index
    assert again.extra["future_field"] == {"kept": True} and again.extract_level == "attention"
    assert json.loads((tmp_path / "index.json").read_text())["future_field"] == {"kept": True}


def test_reader_loads_a_vindex_without_gate_vectors(tmp_path):
    _write(tmp_path, "f16", np.random.default_rng(2))
    (tmp_path / "gate_vectors.bin").unlink()
    vx = Vindex.open(tmp_path)  # a client slice: attention only
    assert not vx.has_gate()
    assert vx.tensor("layers.0.self_attn.q_proj.weight").shape == (H, H)
    with pytest.raises(VindexError, match="gate_vectors.bin"):
        vx.gate(0)


def test_mixed_dtypes_are_told_apart_by_size(tmp_path):
    arrays, _ = _write(tmp_path, "f16", np.random.default_rng(3))
    (tmp_path / "embeddings.bin").write_bytes(arrays["emb"].astype("<f4").tobytes())
    assert Vindex.open(tmp_path).embeddings().dtype == np.float32


@pytest.mark.parametrize("damage,match", [
    (lambda p: (p / "index.json").unlink(), "missing index.json"),
    (lambda p: (p / "index.json").write_text("{not json"), "unreadable index.json"),
    (lambda p: (p / "index.json").write_text('{"version": 1, "num_layers": 1, "hidden_size": 1, "vocab_size": 1}'), "version"),
    (lambda p: (p / "index.json").write_text('{"version": 2}'), "lacks"),
])
def test_bad_index_is_a_clear_error(tmp_path, damage, match):
    _write(tmp_path, "f32", np.random.default_rng(4))
    damage(tmp_path)
    with pytest.raises(VindexError, match=match):
        Vindex.open(tmp_path)


def test_truncated_weight_file_is_detected(tmp_path):
    _write(tmp_path, "f32", np.random.default_rng(5))
    data = (tmp_path / UP).read_bytes()
    (tmp_path / UP).write_bytes(data[:100])
    with pytest.raises(VindexError, match="outside the file"):
        Vindex.open(tmp_path).tensor(f"layers.{L - 1}.mlp.up_proj.weight")
    (tmp_path / "embeddings.bin").write_bytes(b"\0" * 7)
    with pytest.raises(VindexError, match="neither f16 nor f32"):
        Vindex.open(tmp_path).embeddings()


def test_staged_output_is_all_or_nothing(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(RuntimeError):
        with staged_output(out) as tmp:
            (tmp / "a").write_text("x")
            raise RuntimeError("fail midway")
    assert not out.exists() and list(tmp_path.iterdir()) == []
    with staged_output(out) as tmp:
        (tmp / "a").write_text("x")
    assert (out / "a").read_text() == "x"
    with pytest.raises(OutputExists):
        with staged_output(out):
            pass
    shutil.rmtree(out)


def test_row_file_reads_rows_like_the_map_without_mapping(tiny_models):
    """`Vindex.embedding_rows()`: the embed server's lookups, read with pread (a memory map's
    fault-around would leave neighbouring pages resident); same values as the map, bounds checked."""
    vx = Vindex.open(tiny_models["gemma3"])
    table, rows = vx.embeddings(), vx.embedding_rows()
    assert rows.shape == table.shape and rows.dtype == table.dtype and rows.nbytes == table.nbytes
    assert np.array_equal(rows[3], table[3]) and np.array_equal(rows[np.int64(5)], table[5])
    ids = np.array([0, 7, 7, rows.shape[0] - 1])
    assert np.array_equal(rows[ids], table[ids]) and rows[np.array([], dtype=np.int64)].shape == (0, table.shape[1])
    for bad in (-1, rows.shape[0]):
        with pytest.raises(IndexError):
            rows[bad]
        with pytest.raises(IndexError):
            rows[np.array([0, bad])]
    rows.close()
