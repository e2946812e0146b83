"""The logits head of the embed server: `larql_edge.model.head.LocalHead` (final norm, lm_head, final
softcap: written once, in model/), built with the server's lm_head cache folder and ``--lm-head-format``."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from larql_edge.errors import ServiceUnavailable
from larql_edge.format.vindex import Vindex
from larql_edge.model.backend import Backend
from larql_edge.model.head import LocalHead, log_normaliser, top_k_ids
from larql_edge.model.spec import ModelSpec

__all__ = ["LogitsHead", "log_normaliser", "top_k_ids"]

log = logging.getLogger("larql.embed")

# Every residual reaching the head is finite and bounded (`larql_edge.wire.numbers.finite_f32`), and the
# final norm and softcap keep good weights' logits finite: a NaN or Inf logit is a damaged lm_head
# (a corrupted block scale, a bad row), never the caller's doing.


class LogitsHead(LocalHead):
    """``softcap(lm_head @ final_norm(x))`` for a batch of pre-final-norm residuals."""

    def __init__(self, vx: Vindex, spec: ModelSpec, cache_dir: Path | None, backend: Backend | None = None,
                 lm_head_format: str = "auto"):
        super().__init__(vx, spec, backend, cache_dir, lm_head_format)

    def warm_up(self) -> None:
        """A damaged lm_head is seen here already (zeros times a NaN scale): said at start, and every
        logits request is then a 503. Not a load failure: the embedding rows (and, tied, all but the
        damaged ones) still serve, each checked on its own."""
        try:
            super().warm_up()
        except ServiceUnavailable as e:
            log.error("%s: every /v1/logits request will be a 503", e)

    def logits(self, h: np.ndarray) -> np.ndarray:
        """As `LocalHead.logits`, and damaged weights are this server's failure: a 503 (the router
        and clients fail over to another embed member and cool this one down), never a 200 carrying
        NaN or Inf that a sampler would turn into a wrong token or the caller's error."""
        out = super().logits(h)
        if not np.isfinite(out).all():
            bad = np.nonzero(~np.isfinite(out).all(axis=0))[0]
            raise ServiceUnavailable(f"non-finite logits for {bad.size} token(s) (first: token {int(bad[0])}) from "
                                     "finite input: the lm_head is damaged; run larql-slicer verify on the vindex")
        return out
