"""The models one server process serves, and how a request picks one.

A request names its model by path (``/v1/{model_id}/...``), else by the ``X-Model-Id`` header,
else gets the default model (the first VINDEX on the command line). The content-addressed routes
(``/v1/models/{sha}/embed/{id}``) pick it by the sha256 of its embeddings instead.
"""

from __future__ import annotations

import logging
from pathlib import Path

from larql_edge.errors import NotFound, ServiceUnavailable
from larql_edge.roles.embed.config import EmbedConfig
from larql_edge.roles.embed.model import ServedModel

log = logging.getLogger("larql.embed")

MODEL_HEADER = "x-model-id"


class ModelRegistry:
    def __init__(self, cfg: EmbedConfig):
        self.models: dict[str, ServedModel] = {}
        for src in cfg.models:
            if src.id in self.models:
                raise ValueError(f"model id {src.id!r} is given twice (name them apart with ID=PATH)")
            self.models[src.id] = ServedModel(src)
        if not self.models:
            raise ValueError("no model to serve")
        self.default_id = next(iter(self.models))
        self.ready = False
        self.error: str | None = None

    @property
    def multi(self) -> bool:
        return len(self.models) > 1

    def load_all(self, hot_cache: int, lm_head_cache: Path | None, lm_head_format: str = "auto") -> bool:
        """Load every model (runs in a thread after the server listens); records the first failure.

        The caller sets `ready` once it has wired the loaded models up (batchers, metrics).
        """
        try:
            for m in self.models.values():
                m.load(hot_cache, lm_head_cache, lm_head_format)
        except Exception as e:  # a broken vindex must not kill the server silently: /v1/ready says why
            log.exception("loading failed")
            self.error = f"{type(e).__name__}: {e}"
            return False
        return True

    def _usable(self, m: ServedModel) -> ServedModel:
        if not m.ready:
            raise ServiceUnavailable(self.error or f"model {m.id!r} is still loading")
        return m

    def pick(self, path_id: str | None, header_id: str | None) -> ServedModel:
        mid = path_id or header_id or self.default_id
        m = self.models.get(mid)
        if m is None:
            raise NotFound(f"unknown model {mid!r} (served: {', '.join(self.models)})")
        return self._usable(m)

    def by_sha(self, sha: str) -> ServedModel:
        sha = sha.lower()
        for m in self.models.values():
            if m.sha256 == sha:
                return self._usable(m)
        if not self.ready and any(m.sha256 is None for m in self.models.values()):
            raise ServiceUnavailable(self.error or "models are still loading")
        raise NotFound(f"no served model has embeddings sha256 {sha!r}")
