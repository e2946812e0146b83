"""The logits head of the embed server: `larql_edge.model.head.LocalHead` (final norm, lm_head, final
softcap: written once, in model/), built with the server's lm_head cache folder and ``--lm-head-format``."""

from __future__ import annotations

from pathlib import Path

from larql_edge.format.vindex import Vindex
from larql_edge.model.backend import Backend
from larql_edge.model.head import LocalHead, log_normaliser, top_k_ids
from larql_edge.model.spec import ModelSpec

__all__ = ["LogitsHead", "log_normaliser", "top_k_ids"]


class LogitsHead(LocalHead):
    """``softcap(lm_head @ final_norm(x))`` for a batch of pre-final-norm residuals."""

    def __init__(self, vx: Vindex, spec: ModelSpec, cache_dir: Path | None, backend: Backend | None = None,
                 lm_head_format: str = "auto"):
        super().__init__(vx, spec, backend, cache_dir, lm_head_format)
