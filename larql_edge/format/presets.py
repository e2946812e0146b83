"""What each deployment preset of a vindex contains: the one source of truth (ADR-0007).

A vindex's files fall into *parts* (file name patterns); a *preset* is a set of parts. The slicer
carves presets, the embed server checks a folder against what it needs, tests and benchmarks build
their role folders by slicing; none of them lists files of its own.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable

from larql_edge.errors import SliceError

from .index import level_rank

# Part -> file name patterns (the ADR-0007 catalogue).
PARTS: dict[str, tuple[str, ...]] = {
    "embed": ("embeddings.bin",),
    "norms": ("norms.bin",),
    "attn": ("attn_weights*.bin", "attn_weights*.json"),
    "gate": ("gate_vectors.bin", "gate_vectors_q4.bin"),
    "down_meta": ("down_meta.bin", "down_meta.jsonl"),
    "ffn": ("interleaved*.bin", "interleaved*.json", "up_weights.bin", "down_weights.bin", "up_features.bin",
            "down_features.bin", "down_features_q4k*.bin", "down_features_q4k*.json"),
    "lm_head": ("lm_head*.bin",),
    "router": ("router_weights.bin",),
    # The Hugging Face metadata LARQL's extractor copies beside the tokenizer (the chat template lives there).
    "tokenizer": ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
                  "chat_template.jinja"),
    "manifest": ("weight_manifest.json",),
    "labels": ("feature_labels.json", "feature_clusters.jsonl", "relation_clusters.json"),
    "readme": ("README.md",),
}

PRESETS: dict[str, tuple[str, ...]] = {
    # 2-tier: the client holds the embeddings itself.
    "client": ("embed", "norms", "attn", "tokenizer", "manifest", "labels"),
    # 3-tier client (ADR-0008): attention and norms only. larql-edge adds the tokenizer so the
    # client can encode prompts and stream text without a round trip per token.
    "attn": ("norms", "attn", "tokenizer", "manifest", "labels"),
    # Embed server: larql-edge adds what /v1/logits needs (final norm via norms + manifest, lm_head
    # when untied), so this preset alone serves every embed-server endpoint.
    "embed": ("embed", "tokenizer", "labels", "norms", "manifest", "lm_head"),
    "server": ("embed", "norms", "gate", "down_meta", "ffn", "tokenizer", "manifest", "labels"),
    "browse": ("embed", "gate", "down_meta", "tokenizer", "labels", "readme"),
    "router": ("router", "tokenizer", "manifest", "labels", "readme"),
    "all": tuple(PARTS),
}
ALIASES = {"attention": "attn", "embed-server": "embed", "ffn": "server"}
DEFAULT_SLICES = ("client", "attn", "embed", "server", "browse")
# The preset each running role serves from (DESIGN.md §1: the embed preset serves logits too).
ROLE_PRESETS = {"embed": "embed", "ffn": "server", "client": "attn", "serve": "attn"}


def canonical_preset(name: str) -> str:
    name = ALIASES.get(name, name)
    if name not in PRESETS:
        known = ", ".join(sorted(set(PRESETS) | set(ALIASES)))
        raise SliceError(f"unknown preset {name!r} (known: {known})")
    return name


def resolve_parts(preset: str | None, parts: Iterable[str] = ()) -> list[str]:
    """The union of a preset's parts and explicit parts, in catalogue order."""
    chosen: set[str] = set(PRESETS[canonical_preset(preset)]) if preset else set()
    for p in parts:
        p = p.strip()
        if not p:
            continue
        if p not in PARTS:
            raise SliceError(f"unknown part {p!r} (known: {', '.join(PARTS)})")
        chosen.add(p)
    if not chosen:
        raise SliceError("nothing to slice: give --preset and/or --parts")
    return [p for p in PARTS if p in chosen]


def part_of(filename: str) -> str | None:
    for part, patterns in PARTS.items():
        if any(fnmatch.fnmatchcase(filename, pat) for pat in patterns):
            return part
    return None


def level_for(present_parts: set[str], source_level: str, kept_everything: bool) -> str:
    """The strongest tier the kept files support, never above the source's."""
    if kept_everything:
        return source_level
    if {"attn", "norms"} <= present_parts:
        level = "inference" if {"gate", "ffn"} <= present_parts else "attention"
    else:
        level = "browse"
    return level if level_rank(level) <= level_rank(source_level) else source_level
