"""The FFN shard's model state: only the FFN weights of its own layers, and per-layer load figures."""

from __future__ import annotations

import time
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from larql_edge.tools.slicer.errors import VindexError
from larql_edge.format.vindex import Vindex

from larql_edge.model.backend import Backend, get_backend
from larql_edge.errors import BadRequest
from larql_edge.service.identity import vindex_hash
from larql_edge.format.layers import LayerRange
from larql_edge.model.forward import LocalFfn
from larql_edge.model.spec import ModelSpec

# Exponential moving average weight for per-layer latency: recent enough to follow load changes.
EMA = 0.2


class Shard:
    def __init__(self, vindex: str | Path, layers: LayerRange | None, backend: Backend | None = None):
        self.vx = Vindex.open(vindex)
        self.spec = ModelSpec.from_index(self.vx.index)
        n = self.spec.num_layers
        self.range = layers if layers is not None else LayerRange(0, n - 1)
        if self.range.end >= n:
            raise VindexError(f"layer range {self.range} is outside the model's {n} layers (0-{n - 1})")
        t0 = time.perf_counter()
        # LocalFfn loads exactly the listed layers: nothing of any other layer is touched.
        self.ffn = LocalFfn(self.vx, self.spec, layers=list(self.range), backend=backend or get_backend())
        self.load_seconds = time.perf_counter() - t0
        self.model = self.vx.model
        self.hidden = self.spec.hidden_size
        self.vindex_hash = vindex_hash(self.vx)
        self.inflight = 0
        self.requests = 0
        self.latency_ms: dict[int, float] = {}

    def check_layers(self, layers: Iterable[int]) -> None:
        outside = sorted({layer for layer in layers if layer not in self.range})
        if outside:
            names = ", ".join(map(str, outside[:8])) + (" ..." if len(outside) > 8 else "")
            raise BadRequest(f"layer {names} not served here: this shard serves layers {self.range}")

    def compute(self, layer: int, x: np.ndarray) -> np.ndarray:
        t0 = time.perf_counter()
        out = self.ffn.ffn(layer, x)
        ms = (time.perf_counter() - t0) * 1e3
        prev = self.latency_ms.get(layer)
        self.latency_ms[layer] = ms if prev is None else prev + EMA * (ms - prev)
        return out

    def describe(self) -> dict:
        """The announcement and load a membership heartbeat carries (see larql_edge.service.membership)."""
        return {
            "model": self.model,
            "num_layers": self.spec.num_layers,
            "hidden_size": self.hidden,
            "layer_start": self.range.start,
            "layer_end": self.range.end,
            "vindex_hash": self.vindex_hash,
            "inflight": self.inflight,
            "layer_latency_ms": {str(k): round(v, 3) for k, v in sorted(self.latency_ms.items())},
        }
