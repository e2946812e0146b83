"""The embed server's settings: one frozen value built by the CLI and handed to every worker."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

from larql_edge.service.membership import GridSettings

# Path segments the unprefixed API uses: a model id may not shadow them in /v1/{model_id}/...
RESERVED_IDS = frozenset({"embed", "logits", "token", "stats", "health", "ready", "models", "metrics"})
MODEL_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


@dataclass(frozen=True)
class ModelSource:
    id: str
    path: str


@dataclass(frozen=True)
class Limits:
    """Every limit the server enforces; all are published in ``GET /v1/stats``."""

    max_tokens: int = 4096  # ids per /v1/embed request, per decode request, per encoded text
    max_body: int = 1 << 20  # bytes of a request body (413 above)
    max_top_k: int = 1000  # top_k of /v1/logits (also never above the vocabulary)
    max_text_chars: int = 100_000  # characters per text to encode
    batch_wait_ms: float = 0.0  # longest wait of an idle logits batcher for company (0: none; see batcher.py)
    max_batch: int = 64  # residuals per lm_head product

    def as_json(self) -> dict:
        return {
            "max_tokens_per_request": self.max_tokens,
            "max_body_bytes": self.max_body,
            "max_top_k": self.max_top_k,
            "max_text_chars": self.max_text_chars,
            "batch_wait_ms": self.batch_wait_ms,
            "max_batch": self.max_batch,
        }


@dataclass(frozen=True)
class EmbedConfig:
    models: tuple[ModelSource, ...]
    host: str = "127.0.0.1"
    port: int = 8082
    workers: int = 1
    hot_cache: int = 5000
    blas_threads: int = 1
    lm_head_cache: str | None = None  # None: keep an lm_head copy in process memory
    lm_head_format: str = "auto"  # larql_edge.model.lm_head.HEAD_FORMATS
    embed_only: bool = False
    access_log: bool = False
    limits: Limits = field(default_factory=Limits)
    weights: dict[str, dict] = field(default_factory=dict)  # model id -> what --verify-weights did (/v1/stats)
    grid: GridSettings | None = field(default=None, repr=False)  # holds the grid key: never print or serialise it

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


def model_id_for(path: str, model_name: str) -> str:
    """Default id: the last path component of index.json's ``model``, reduced to URL-safe characters."""
    base = model_name.rsplit("/", 1)[-1] or os.path.basename(os.path.normpath(path))
    mid = re.sub(r"[^A-Za-z0-9._-]+", "-", base).strip("-.").lower() or "model"
    return mid[:128]


def check_model_id(mid: str) -> None:
    if not MODEL_ID.match(mid):
        raise ValueError(f"model id {mid!r}: use letters, digits, '.', '_' and '-' (up to 128)")
    if mid in RESERVED_IDS:
        raise ValueError(f"model id {mid!r} is reserved (it is a route name); pick another with ID=PATH")
