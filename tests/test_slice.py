"""larql-slicer slice: presets, parts, the index.json rewrite, links vs copies, refusals."""

from __future__ import annotations

import errno
import json
import os

import pytest

from larql_edge.errors import SliceError, VindexError
from larql_edge.format.presets import PRESETS, resolve_parts
from larql_edge.format.vindex import Vindex
from larql_edge.tools.slicer.slice import slice_vindex
from tests._cli import slicer

TOKENIZER = {"tokenizer.json", "tokenizer_config.json", "generation_config.json"}
EXPECTED = {
    "client": {"embeddings.bin", "norms.bin", "attn_weights.bin", "weight_manifest.json"} | TOKENIZER,
    "attn": {"norms.bin", "attn_weights.bin", "weight_manifest.json"} | TOKENIZER,
    "embed": {"embeddings.bin", "norms.bin", "weight_manifest.json", "lm_head.bin"} | TOKENIZER,
    "server": {"embeddings.bin", "norms.bin", "gate_vectors.bin", "up_weights.bin", "down_weights.bin",
               "weight_manifest.json"} | TOKENIZER,
    "browse": {"embeddings.bin", "gate_vectors.bin"} | TOKENIZER,
    "router": {"weight_manifest.json"} | TOKENIZER,
}
LEVEL = {"client": "attention", "attn": "attention", "embed": "browse", "server": "browse", "browse": "browse",
         "router": "browse", "all": "all"}


@pytest.mark.parametrize("preset", sorted(EXPECTED))
def test_presets_keep_their_files_and_rewrite_index(tiny_models, tmp_path, preset):
    src = tiny_models["llama"]  # untied: has lm_head.bin
    dst = tmp_path / preset
    slice_vindex(src, dst, preset=preset, log=lambda m: None)
    files = {f.name for f in dst.iterdir()} - {"index.json"}
    assert files == EXPECTED[preset]
    vx = Vindex.open(dst)
    assert vx.index.extract_level == LEVEL[preset]
    assert vx.index.has_model_weights == bool({"attn_weights.bin", "up_weights.bin", "norms.bin", "lm_head.bin"} & files)
    assert set(vx.checksums) == files
    assert vx.verify() == []
    # Everything else of index.json is kept (unknown keys included).
    src_ix = Vindex.open(src).index
    for k in ("model", "family", "model_config", "num_layers", "hidden_size", "layers", "source", "lm_head_tied"):
        assert getattr(vx.index, k) == getattr(src_ix, k)


def test_all_preset_keeps_level(tiny_models, tmp_path):
    slice_vindex(tiny_models["gemma3"], tmp_path / "all", preset="all", log=lambda m: None)
    assert Vindex.open(tmp_path / "all").index.extract_level == "all"


def test_aliases_and_parts_union():
    assert resolve_parts("attention") == resolve_parts("attn")
    assert resolve_parts("embed-server") == resolve_parts("embed")
    assert resolve_parts("ffn") == resolve_parts("server")
    assert resolve_parts("attn", ["gate"]) == [p for p in resolve_parts("all") if p in set(PRESETS["attn"]) | {"gate"}]
    assert resolve_parts(None, ["embed", "tokenizer"]) == ["embed", "tokenizer"]


def test_same_filesystem_links_and_cross_filesystem_copies(tiny_models, tmp_path, monkeypatch):
    src = tiny_models["gemma3"]
    plan = slice_vindex(src, tmp_path / "linked", preset="attn", log=lambda m: None)
    assert set(plan.actions.values()) == {"linked"}
    assert os.stat(tmp_path / "linked" / "attn_weights.bin").st_ino == os.stat(src / "attn_weights.bin").st_ino

    def exdev(a, b):
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    monkeypatch.setattr(os, "link", exdev)
    plan = slice_vindex(src, tmp_path / "copied", preset="attn", log=lambda m: None)
    assert set(plan.actions.values()) == {"copied"}
    assert os.stat(tmp_path / "copied" / "attn_weights.bin").st_ino != os.stat(src / "attn_weights.bin").st_ino
    assert Vindex.open(tmp_path / "copied").verify() == []


def test_rewriting_a_slice_index_does_not_touch_the_source(tiny_models, tmp_path):
    src = tiny_models["gemma3"]
    before = (src / "index.json").read_text()
    slice_vindex(src, tmp_path / "s", preset="client", log=lambda m: None)
    assert (src / "index.json").read_text() == before


def test_refusals(tiny_models, tmp_path):
    src = tiny_models["gemma3"]
    with pytest.raises(SliceError, match="unknown preset"):
        slice_vindex(src, tmp_path / "x", preset="nope")
    with pytest.raises(SliceError, match="unknown part"):
        slice_vindex(src, tmp_path / "x", parts=["embed", "wings"])
    with pytest.raises(SliceError, match="inside"):
        slice_vindex(src, src / "sub", preset="attn")
    with pytest.raises(SliceError, match="is the source"):
        slice_vindex(src, src, preset="attn")
    (tmp_path / "noindex").mkdir()
    with pytest.raises(VindexError, match="missing index.json"):
        slice_vindex(tmp_path / "noindex", tmp_path / "y", preset="attn")
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


def test_cli_dry_run_writes_nothing_and_prints_plan(tiny_models, tmp_path):
    dst = tmp_path / "dry"
    r = slicer("slice", str(tiny_models["llama"]), "-o", str(dst),
                        "--preset", "embed", "--dry-run")
    assert r.returncode == 0, r.stderr
    assert not dst.exists()
    assert "would keep" in r.stdout and "lm_head.bin" in r.stdout and "skipped" in r.stdout
    assert "all -> browse" in r.stdout


def test_cli_output_and_errors(tiny_models, tmp_path):
    dst = tmp_path / "s"
    r = slicer("slice", str(tiny_models["llama"]), "-o", str(dst),
                        "--preset", "attn")
    assert r.returncode == 0 and "linked" in r.stdout and "all -> attention" in r.stdout
    r = slicer("slice", str(tiny_models["llama"]), "-o", str(dst),
                        "--preset", "attn")
    assert r.returncode == 1 and "--force" in r.stderr and "Traceback" not in r.stderr
    r = slicer("slice", str(tiny_models["llama"]), "-o", str(tmp_path / "z"),
                        "--parts", "embed,bogus")
    assert r.returncode == 1 and "unknown part 'bogus'" in r.stderr
    assert json.loads((dst / "index.json").read_text())["extract_level"] == "attention"
