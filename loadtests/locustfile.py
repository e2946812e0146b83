"""Locust load tests for the embed server, the edge cache in front of it, and the FFN grid.

    # 20 users for 30 s against an embed server (or nginx/varnish in front of it):
    locust -f loadtests/locustfile.py --headless -u 20 -r 5 -t 30s --host http://127.0.0.1:8082 EmbedGetUser

User classes (pick one or several on the command line):
- EmbedGetUser: the CDN-cacheable GET /v1/embed/{id}, ids drawn from a Zipf law (natural-language-like reuse)
- EmbedPostUser: POST /v1/embed binary prefill batches
- LogitsUser: POST /v1/logits binary residuals (exercises the server's micro-batcher)
- WalkFfnUser: POST /v1/walk-ffn binary single-layer requests (to a shard or the router)
LARQL_LOAD_VOCAB, LARQL_LOAD_HIDDEN, LARQL_LOAD_LAYERS override what is otherwise read from /v1/stats.
Load only servers you run yourself, on this machine.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
from locust import HttpUser, between, events, task

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from larql_edge.wire import embed as embed_wire  # noqa: E402
from larql_edge.wire import ffn as ffn_wire  # noqa: E402

SHAPE: dict[str, int] = {}


@events.test_start.add_listener
def _discover(environment, **_kw):
    """Vocab and hidden size from the target's /v1/stats unless given in the environment."""
    import requests  # locust's own dependency; httpx does not survive gevent's monkey-patching

    SHAPE["vocab"] = int(os.environ.get("LARQL_LOAD_VOCAB", 0))
    SHAPE["hidden"] = int(os.environ.get("LARQL_LOAD_HIDDEN", 0))
    SHAPE["layers"] = int(os.environ.get("LARQL_LOAD_LAYERS", 0))
    if not (SHAPE["vocab"] and SHAPE["hidden"]) and environment.host:
        try:
            stats = requests.get(environment.host.rstrip("/") + "/v1/stats", timeout=5).json()
            SHAPE["vocab"] = SHAPE["vocab"] or int(stats.get("vocab_size", 0))
            SHAPE["hidden"] = SHAPE["hidden"] or int(stats.get("hidden_size", 0))
            SHAPE["layers"] = SHAPE["layers"] or int(stats.get("num_layers", 0) or 0)
        except Exception:  # the user can still pass the LARQL_LOAD_* variables
            pass
    SHAPE.setdefault("vocab", 0)


def _zipf_id(rng: np.random.Generator) -> int:
    vocab = SHAPE.get("vocab") or 1000
    return int(min(rng.zipf(1.1), vocab) - 1)


class EmbedGetUser(HttpUser):
    wait_time = between(0, 0.01)

    def on_start(self):
        self.rng = np.random.default_rng()

    @task(4)
    def embed_binary(self):
        self.client.get(f"/v1/embed/{_zipf_id(self.rng)}", name="/v1/embed/{id}")

    @task(1)
    def embed_json(self):
        self.client.get(f"/v1/embed/{_zipf_id(self.rng)}.json", name="/v1/embed/{id}.json")


class EmbedPostUser(HttpUser):
    wait_time = between(0, 0.01)

    def on_start(self):
        self.rng = np.random.default_rng()

    @task
    def prefill(self):
        ids = [_zipf_id(self.rng) for _ in range(32)]
        self.client.post("/v1/embed", data=embed_wire.encode_embed_request(ids),
                         headers={"Content-Type": "application/x-larql-ffn"}, name="/v1/embed (32 ids)")


class LogitsUser(HttpUser):
    wait_time = between(0, 0.01)

    def on_start(self):
        self.rng = np.random.default_rng()

    @task
    def logits(self):
        h = self.rng.standard_normal(SHAPE.get("hidden") or 640).astype(np.float32)
        self.client.post("/v1/logits", data=embed_wire.encode_logits_request(h),
                         headers={"Content-Type": "application/x-larql-ffn"}, name="/v1/logits top-k")


class WalkFfnUser(HttpUser):
    wait_time = between(0, 0.01)

    def on_start(self):
        self.rng = np.random.default_rng()

    @task
    def walk(self):
        layers = SHAPE.get("layers") or 1
        x = self.rng.standard_normal((1, SHAPE.get("hidden") or 640)).astype(np.float32)
        body = ffn_wire.encode_request(int(self.rng.integers(layers)), x)
        self.client.post("/v1/walk-ffn", data=body, headers={"Content-Type": ffn_wire.CONTENT_TYPE},
                         name="/v1/walk-ffn")
