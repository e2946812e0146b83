"""The FFN shard's model state: the FFN weights of its own layers, its work bounds, and its figures."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from larql_edge.errors import BadRequest, PayloadTooLarge, VindexError
from larql_edge.format.layers import LayerRange
from larql_edge.format.vindex import Vindex
from larql_edge.model.backend import Backend, get_backend
from larql_edge.model.forward import LocalFfn
from larql_edge.model.spec import ModelSpec
from larql_edge.service.identity import WeightsCheck, verify_weights, vindex_hash
from larql_edge.wire import ffn as wire

# Exponential moving average weight for per-layer latency: recent enough to follow load changes.
EMA = 0.2
# Rows multiplied at once: bounds the [rows, intermediate] temporaries of one request whatever its size.
ROW_CHUNK = 256


@dataclass(frozen=True)
class Limits:
    """The work one request may ask for, checked before any work starts (published in /v1/stats)."""

    max_rows: int = 8192  # positions per request (a long prefill)
    max_reply_bytes: int = 64 << 20  # rows x layers x hidden x 4: what the reply may hold

    def as_json(self, shard: "Shard") -> dict:
        return {
            "max_rows": self.max_rows,
            "max_layers_per_request": len(shard.range),
            "repeated_layers": False,
            "max_reply_bytes": self.max_reply_bytes,
            "max_rows_x_layers": self.max_reply_bytes // (4 * shard.hidden),
            "max_body_bytes": shard.max_body,
        }


class Shard:
    def __init__(self, vindex: str | Path, layers: LayerRange | None, backend: Backend | None = None,
                 limits: Limits | None = None, verify: str = "off"):
        """``verify``: ``--verify-weights`` (auto, on, off): checksums before anything is loaded."""
        self.vx = Vindex.open(vindex)
        self.weights: WeightsCheck = verify_weights(self.vx, verify)
        self.spec = ModelSpec.from_index(self.vx.index)
        n = self.spec.num_layers
        self.range = layers if layers is not None else LayerRange(0, n - 1)
        if self.range.end >= n:
            raise VindexError(f"layer range {self.range} is outside the model's {n} layers (0-{n - 1})")
        self.limits = limits or Limits()
        t0 = time.perf_counter()
        # LocalFfn loads exactly the listed layers: nothing of any other layer is touched.
        self.ffn = LocalFfn(self.vx, self.spec, layers=list(self.range), backend=backend or get_backend())
        for w in self.ffn.layers.values():  # ggml's repacked copies (Q4_K) now, not on the first hops
            for m in (w.gate, w.up, w.down):
                getattr(m, "repacked", None)
        self.load_seconds = time.perf_counter() - t0
        self.model = self.vx.model
        self.hidden = self.spec.hidden_size
        self.vindex_hash = vindex_hash(self.vx)
        self.requests = 0
        self.latency_ms: dict[int, float] = {}
        self.started = time.time()
        self.on_layer: Callable[[int, float], None] = lambda layer, seconds: None

    @property
    def max_body(self) -> int:
        """The largest legal request: a batch of every served layer over ``max_rows`` positions
        (JSON is larger per value; its limit is the same bytes, so JSON requests carry fewer rows)."""
        return 12 + 4 * (1 + len(self.range)) + self.limits.max_rows * self.hidden * 4

    def check(self, req: wire.FfnRequest) -> None:
        """Every bound, before any work: layers served and not repeated, rows, reply size."""
        if not req.full_output:
            raise BadRequest("only full_output=1 is served: the reply is the FFN output for every position")
        outside = sorted({layer for layer in req.layers if layer not in self.range})
        if outside:
            names = ", ".join(map(str, outside[:8])) + (" ..." if len(outside) > 8 else "")
            raise BadRequest(f"layer {names} not served here: this shard serves layers {self.range}")
        if len(set(req.layers)) != len(req.layers):
            dup = next(layer for layer in req.layers if req.layers.count(layer) > 1)
            raise BadRequest(f"layer {dup} is listed more than once: a batch names each layer once")
        if req.seq_len > self.limits.max_rows:
            raise PayloadTooLarge(f"{req.seq_len} positions; the limit is {self.limits.max_rows} per request")
        reply = req.seq_len * len(req.layers) * self.hidden * 4
        if reply > self.limits.max_reply_bytes:
            raise PayloadTooLarge(f"{req.seq_len} positions x {len(req.layers)} layers makes a {reply}-byte reply; "
                                  f"the limit is {self.limits.max_reply_bytes} (send fewer layers or positions)")

    def compute(self, layer: int, x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """The layer's FFN of ``x`` ``[rows, hidden]``, into ``out`` when given (float32, or float16:
        rounded from the float32 result)."""
        t0 = time.perf_counter()
        n = x.shape[0]
        if out is None:
            out = np.empty((n, self.hidden), np.float32)
        for i in range(0, n, ROW_CHUNK):
            dst = out[i : i + ROW_CHUNK]
            if dst.dtype == np.float32:
                self.ffn.ffn(layer, x[i : i + ROW_CHUNK], out=dst)
            else:
                dst[...] = self.ffn.ffn(layer, x[i : i + ROW_CHUNK])
        seconds = time.perf_counter() - t0
        self.on_layer(layer, seconds)
        ms = seconds * 1e3
        prev = self.latency_ms.get(layer)
        self.latency_ms[layer] = ms if prev is None else prev + EMA * (ms - prev)
        return out

    def run(self, layers: Sequence[int], x: np.ndarray) -> tuple[list[tuple[int, np.ndarray]], float]:
        """Every requested layer on the same input (runs in the compute thread)."""
        t0 = time.perf_counter()
        results = [(layer, self.compute(layer, x)) for layer in layers]
        return results, (time.perf_counter() - t0) * 1e3

    def run_into(self, layers: Sequence[int], x: np.ndarray, outs: Sequence[np.ndarray]) -> None:
        """Every requested layer on the same input, each into its own output (a reply's views)."""
        for layer, out in zip(layers, outs, strict=True):
            self.compute(layer, x, out)

    def describe(self, inflight: int = 0) -> dict:
        """The announcement and load a membership heartbeat carries (larql_edge.service.membership)."""
        return {
            "model": self.model,
            "num_layers": self.spec.num_layers,
            "hidden_size": self.hidden,
            "layer_start": self.range.start,
            "layer_end": self.range.end,
            "vindex_hash": self.vindex_hash,
            "inflight": inflight,
            "layer_latency_ms": {str(k): round(v, 3) for k, v in sorted(self.latency_ms.items())},
        }
