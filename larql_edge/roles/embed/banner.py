"""The start-up banner of the design record (ADR-0008 "CLI"), printed once the models are loaded."""

from __future__ import annotations

from importlib import metadata

from larql_edge.roles.embed.config import EmbedConfig
from larql_edge.roles.embed.model import MODE, ServedModel


def _version() -> str:
    try:
        return metadata.version("larql-edge")
    except metadata.PackageNotFoundError:
        return "dev"


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB"


def model_lines(m: ServedModel) -> list[str]:
    store, head = m.store, m.head
    lines = [
        f"  Model:      {m.name}  (id {m.id})",
        f"  Vocab:      {m.vocab_size:,} tokens",
        f"  Hidden:     {m.hidden_size:,}",
        f"  Embeddings: {_gb(m.embed_nbytes)}  ({store.storage_dtype}, read per row; hot cache {store.cache.capacity:,} rows)",
    ]
    tied = "tied" if m.tied else "untied, lm_head.bin"
    lines.append(f"  lm_head:    {_gb(head.copy.nbytes)}  ({tied}; computed as {head.copy.format}, "
                 f"{head.copy.storage}; {head.backend.name} backend)")
    lines.append(f"  Tokenizer:  {'loaded' if m.loaded['tokenizer'] else 'missing'}")
    return lines


def banner(cfg: EmbedConfig, models: list[ServedModel]) -> str:
    lines = [f"LARQL Embed Server (larql-edge {_version()})"]
    for i, m in enumerate(models):
        if i:
            lines.append("")
        lines += model_lines(m)
    lines += [
        f"  Mode:       {MODE}",
        f"  Workers:    {cfg.workers}",
        f"  Listening:  {cfg.url}",
        "  Ready.",
    ]
    return "\n".join(lines)
