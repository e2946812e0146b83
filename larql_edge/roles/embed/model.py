"""One served model: the vindex files the embed server reads, loaded into store, head and tokenizer.

The server needs only the ``embed`` preset of a vindex (`larql_edge.format.presets`): embeddings,
tokenizer, manifest and norms (of which it reads ``norm.weight`` alone), and the lm_head when the
model is untied. `check_files` says what is
missing before anything binds a port; `ServedModel.load` does the slow part (tokenizer parse,
lm_head compute copy, warm-up) after the server listens, so ``/v1/ready`` can answer 503 meanwhile.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from tokenizers import Tokenizer

from larql_edge.errors import ServiceUnavailable, VindexError
from larql_edge.format.vindex import EMBEDDINGS, MANIFEST, TOKENIZER, Vindex, sha256_file
from larql_edge.model.spec import ModelSpec
from larql_edge.roles.embed.batcher import LogitsBatcher
from larql_edge.roles.embed.config import ModelSource
from larql_edge.roles.embed.head import LogitsHead
from larql_edge.roles.embed.store import EmbeddingStore
from larql_edge.service.identity import release_freed_memory

log = logging.getLogger("larql.embed")

MODE = "embed-service"
def check_files(vx: Vindex) -> list[str]:
    """Problems that keep ``vx`` from serving every embed-server endpoint (empty when it can)."""
    problems: list[str] = []
    if not vx.has(EMBEDDINGS):
        problems.append(f"missing {EMBEDDINGS}")
    else:
        try:
            vx.embeddings_dtype()
        except VindexError as e:
            problems.append(str(e))
    if not vx.has(TOKENIZER):
        problems.append(f"missing {TOKENIZER}")
    try:
        if not vx.has(MANIFEST):
            problems.append(f"missing {MANIFEST} (locates the final norm)")
        elif not vx.has_tensor("norm.weight"):
            problems.append("no final norm: norm.weight is absent from the manifest or its file is missing")
        if not vx.tied and not vx.has_tensor("lm_head.weight"):
            problems.append("untied model (an lm_head file exists) but lm_head.weight is not in the manifest")
    except VindexError as e:
        problems.append(str(e))
    try:
        ModelSpec.from_index(vx.index)
    except VindexError as e:
        problems.append(str(e))
    return problems


class ServedModel:
    def __init__(self, source: ModelSource):
        self.id = source.id
        self.vindex = Vindex.open(source.path)
        self.path = self.vindex.path
        self.spec = ModelSpec.from_index(self.vindex.index)
        # The sha256 pins the weights in ETags and /v1/models/{sha}/...; computed at load if absent.
        self.sha256: str | None = self.vindex.checksums.get(EMBEDDINGS)
        # Loaded after the server listens (`load`); the properties below are what routes use.
        self._store: EmbeddingStore | None = None
        self._head: LogitsHead | None = None
        self._tokenizer: Tokenizer | None = None
        self._batcher: LogitsBatcher | None = None  # set by the app once the head is loaded
        self.load_seconds: dict[str, float] = {}
        self.error: str | None = None

    # -- metadata ------------------------------------------------------------------------------
    @property
    def name(self) -> str:
        return self.vindex.model

    @property
    def vocab_size(self) -> int:
        return self.spec.vocab_size

    @property
    def hidden_size(self) -> int:
        return self.spec.hidden_size

    @property
    def tied(self) -> bool:
        return self.vindex.tied

    @property
    def loaded(self) -> dict[str, bool]:
        return {
            "embeddings": self._store is not None,
            "lm_head": self._head is not None,
            "tokenizer": self._tokenizer is not None,
        }

    @property
    def ready(self) -> bool:
        # The batcher is attached last, once everything else has loaded (checked on every request).
        return self._batcher is not None

    def _loaded(self, part, what: str):
        if part is None:
            raise ServiceUnavailable(self.error or f"model {self.id!r}: the {what} is still loading")
        return part

    @property
    def store(self) -> EmbeddingStore:
        return self._loaded(self._store, "embedding table")

    @property
    def head(self) -> LogitsHead:
        return self._loaded(self._head, "lm_head")

    @property
    def tokenizer(self) -> Tokenizer:
        return self._loaded(self._tokenizer, "tokenizer")

    @property
    def batcher(self) -> LogitsBatcher:
        return self._loaded(self._batcher, "logits batcher")

    @batcher.setter
    def batcher(self, b: LogitsBatcher) -> None:
        self._batcher = b

    @property
    def embed_nbytes(self) -> int:
        return (self.path / EMBEDDINGS).stat().st_size

    # -- loading -------------------------------------------------------------------------------
    def load(self, hot_cache: int, lm_head_cache: Path | None, lm_head_format: str = "auto") -> None:
        t = time.perf_counter()
        table = self.vindex.embedding_rows()
        self._store = EmbeddingStore(table, self.spec.embed_scale, hot_cache)
        if self.sha256 is None:
            log.warning("%s: index.json records no sha256 for %s; hashing it", self.path, EMBEDDINGS)
            self.sha256 = sha256_file(self.path / EMBEDDINGS)
        self.load_seconds["embeddings"] = time.perf_counter() - t

        t = time.perf_counter()
        self._tokenizer = self.vindex.load_tokenizer()
        self.load_seconds["tokenizer"] = time.perf_counter() - t

        t = time.perf_counter()
        head = LogitsHead(self.vindex, self.spec, lm_head_cache, lm_head_format=lm_head_format)
        head.warm_up()
        self._head = head
        self.load_seconds["lm_head"] = time.perf_counter() - t
        release_freed_memory()

    # -- lookups used by the routes -------------------------------------------------------------
    def token_text(self, i: int) -> str:
        return self.tokenizer.decode([int(i)], skip_special_tokens=False)

    def etag(self, token_id: int, representation: str) -> str:
        return f'"{self.sha256}-{token_id}-{representation}"'

    def stats(self) -> dict:
        store, head = self._store, self._head
        out = {
            "model": self.name,
            "model_id": self.id,
            "family": self.spec.family.name,
            "hidden_size": self.hidden_size,
            "vocab_size": self.vocab_size,
            "embed_size_gb": round(self.embed_nbytes / 1e9, 3),
            "embeddings": {
                "dtype": "f16" if self.vindex.embeddings_dtype().itemsize == 2 else "f32",
                "storage": "pread",  # rows read from the file per lookup: nothing of the table stays resident
                "bytes": self.embed_nbytes,
                "embed_scale": self.spec.embed_scale,
                "sha256": self.sha256,
            },
            "lm_head_tied": self.tied,
            "lm_head": (
                {"format": head.copy.format, "storage": head.copy.storage, "bytes": head.copy.nbytes,
                 "path": head.copy.path, "backend": head.backend.name}
                if head is not None
                else None
            ),
            "final_logit_softcapping": self.spec.final_logit_softcapping,
            "mode": MODE,
            "loaded": self.loaded,
            "load_seconds": {k: round(v, 3) for k, v in self.load_seconds.items()},
            "hot_cache": store.cache.stats() if store is not None else None,
            "logits_batching": self._batcher.stats() if self._batcher is not None else None,
        }
        if self.error:
            out["error"] = self.error
        return out

