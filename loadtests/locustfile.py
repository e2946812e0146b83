"""Locust users for the embed server, the edge caches in front of it, the FFN grid and the
OpenAI-compatible serve role. loadtests/run.py runs them as scenarios with pass/fail thresholds
(loadtests/scenarios.toml); they also run by hand:

    # 6 users for 30 s against an embed server you started:
    LARQL_LOAD_EMBED_URL=http://127.0.0.1:8082 \
      locust -f loadtests/locustfile.py --headless -u 6 -r 6 -t 30s EmbedRowUser EmbedPrefillUser LogitsUser

Every user class talks to one target, whose URL comes from LARQL_LOAD_<TARGET>_URL (EMBED, EDGE,
ROUTER, SERVE) or, when that is unset, from --host. Request names start with the target
(`embed GET /v1/embed/{id}`), so one run can load several targets and still report per route.

- EmbedRowUser, EdgeRowUser: the CDN-cacheable GET /v1/embed/{id} (binary 4 : JSON 1), ids from a
  Zipf law over the vocabulary (natural-language-like reuse); EdgeRowUser counts X-Cache HIT/MISS
- EmbedPrefillUser: POST /v1/embed with 32 ids (a prefill)
- LogitsUser: POST /v1/logits with a random residual (the server's micro-batcher)
- TokenStepUser: one decode step the way the attention-only client makes it through the router:
  POST /v1/embed (1 id), POST /v1/walk-ffn for every layer in order, POST /v1/logits; the whole
  step is reported as `router STEP token` (attention itself is left out: it runs on the client)
- RouterRowUser: GET /v1/embed/{id} through the router's embed proxy
- ServeUser: POST /v1/completions {"model", "prompt", "max_tokens"} to larql-serve (port 8000)

LARQL_LOAD_VOCAB, LARQL_LOAD_HIDDEN, LARQL_LOAD_LAYERS override what is otherwise learned from the
targets (/v1/stats, /v1/grid). LARQL_LOAD_SUMMARY=FILE makes the run write its X-Cache counts there
(JSON) when it ends. Load only servers you run yourself, on this machine.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import numpy as np
from locust import FastHttpUser, between, events, task

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from larql_edge.wire import embed as embed_wire  # noqa: E402
from larql_edge.wire import ffn as ffn_wire  # noqa: E402

BINARY = "application/x-larql-ffn"
TARGETS = ("embed", "edge", "router", "serve")
SHAPE: dict[str, int] = {}
CACHE_COUNTS = {"HIT": 0, "MISS": 0, "other": 0}


def target_url(target: str) -> str | None:
    return os.environ.get(f"LARQL_LOAD_{target.upper()}_URL") or None


def _get_json(url: str) -> dict:
    import requests  # locust's own dependency; httpx does not survive gevent's monkey-patching

    r = requests.get(url, timeout=10)
    r.raise_for_status()
    return r.json()


@events.test_start.add_listener
def _discover(environment, **_kw):
    """Vocab, hidden size and layer count: the environment, else the targets themselves."""
    SHAPE["vocab"] = int(os.environ.get("LARQL_LOAD_VOCAB", 0))
    SHAPE["hidden"] = int(os.environ.get("LARQL_LOAD_HIDDEN", 0))
    SHAPE["layers"] = int(os.environ.get("LARQL_LOAD_LAYERS", 0))
    hosts = [u for u in (target_url("embed"), target_url("edge"), environment.host) if u]
    for host in hosts:  # an embed server, or a cache passing /v1/stats to one
        if SHAPE["vocab"] and SHAPE["hidden"]:
            break
        try:
            stats = _get_json(host.rstrip("/") + "/v1/stats")
            SHAPE["vocab"] = SHAPE["vocab"] or int(stats.get("vocab_size") or 0)
            SHAPE["hidden"] = SHAPE["hidden"] or int(stats.get("hidden_size") or 0)
        except Exception:  # noqa: BLE001 - the user can still pass the LARQL_LOAD_* variables
            pass
    router = target_url("router") or environment.host
    if router and not SHAPE["layers"]:
        try:
            SHAPE["layers"] = int(_get_json(router.rstrip("/") + "/v1/grid").get("num_layers") or 0)
        except Exception:  # noqa: BLE001
            pass


@events.request.add_listener
def _count_cache(name, response, exception, **_kw):
    if not name.startswith("edge ") or exception is not None or response is None:
        return
    verdict = (response.headers.get("X-Cache") or response.headers.get("x-cache") or "").upper()
    CACHE_COUNTS[verdict if verdict in ("HIT", "MISS") else "other"] += 1


@events.quitting.add_listener
def _write_summary(environment, **_kw):
    path = os.environ.get("LARQL_LOAD_SUMMARY")
    if path:
        Path(path).write_text(json.dumps({"x_cache": CACHE_COUNTS, "shape": SHAPE}) + "\n")


def _zipf_id(rng: np.random.Generator) -> int:
    vocab = SHAPE.get("vocab") or 1000
    return int(min(rng.zipf(1.1), vocab) - 1)


class LarqlUser(FastHttpUser):
    """One target per class (its URL from LARQL_LOAD_<TARGET>_URL); names prefixed with it."""

    abstract = True
    target = "embed"
    wait_time = between(0, 0.02)

    def __init__(self, environment):
        self.host = target_url(self.target) or environment.host
        if not self.host:
            raise ValueError(f"{type(self).__name__}: set LARQL_LOAD_{self.target.upper()}_URL or --host")
        super().__init__(environment)
        self.rng = np.random.default_rng()

    def name(self, method: str, route: str) -> str:
        return f"{self.target} {method} {route}"

    def post_binary(self, path: str, body: bytes, route: str, content_type: str = BINARY):
        with self.client.post(path, data=body, headers={"Content-Type": content_type}, name=self.name("POST", route),
                              catch_response=True) as r:
            if r.status_code != 200:
                r.failure(f"HTTP {r.status_code}: {r.text[:200] if r.text else ''}")
            return r


class _RowUser(LarqlUser):
    abstract = True

    def _row(self, suffix: str, route: str):
        with self.client.get(f"/v1/embed/{_zipf_id(self.rng)}{suffix}", name=self.name("GET", route),
                             catch_response=True) as r:
            if r.status_code != 200:
                r.failure(f"HTTP {r.status_code}")
            elif not suffix and SHAPE.get("hidden") and len(r.content) != SHAPE["hidden"] * 4:
                r.failure(f"row of {len(r.content)} bytes, want {SHAPE['hidden'] * 4}")

    @task(4)
    def row_binary(self):
        self._row("", "/v1/embed/{id}")

    @task(1)
    def row_json(self):
        self._row(".json", "/v1/embed/{id}.json")


class EmbedRowUser(_RowUser):
    target = "embed"


class EdgeRowUser(_RowUser):
    target = "edge"


class RouterRowUser(_RowUser):
    target = "router"


class EmbedPrefillUser(LarqlUser):
    target = "embed"

    @task
    def prefill(self):
        ids = [_zipf_id(self.rng) for _ in range(32)]
        self.post_binary("/v1/embed", embed_wire.encode_embed_request(ids), "/v1/embed (32 ids)")


class LogitsUser(LarqlUser):
    target = "embed"

    @task
    def logits(self):
        h = self.rng.standard_normal(SHAPE.get("hidden") or 640).astype(np.float32)
        self.post_binary("/v1/logits", embed_wire.encode_logits_request(h), "/v1/logits top-k")


class WalkFfnUser(LarqlUser):
    """Single-layer POST /v1/walk-ffn with a random layer (to a shard, or the router)."""

    target = "router"

    @task
    def walk(self):
        x = self.rng.standard_normal((1, SHAPE.get("hidden") or 640)).astype(np.float32)
        layer = int(self.rng.integers(SHAPE.get("layers") or 1))
        self.post_binary("/v1/walk-ffn", ffn_wire.encode_request(layer, x), "/v1/walk-ffn", ffn_wire.CONTENT_TYPE)


class TokenStepUser(LarqlUser):
    target = "router"

    @task
    def step(self):
        hidden, layers = SHAPE.get("hidden") or 640, SHAPE.get("layers") or 1
        t0 = time.perf_counter()
        ok = self.post_binary("/v1/embed", embed_wire.encode_embed_request([_zipf_id(self.rng)]), "/v1/embed (1 id)").status_code == 200
        x = (self.rng.standard_normal((1, hidden)) * 0.1).astype(np.float32)
        for layer in range(layers):
            if not ok:
                break
            ok = self.post_binary("/v1/walk-ffn", ffn_wire.encode_request(layer, x), "/v1/walk-ffn",
                                  ffn_wire.CONTENT_TYPE).status_code == 200
        if ok:
            ok = self.post_binary("/v1/logits", embed_wire.encode_logits_request(x[0]), "/v1/logits top-k").status_code == 200
        events.request.fire(request_type="STEP", name=self.name("STEP", "token"), response_time=(time.perf_counter() - t0) * 1000,
                            response_length=0, exception=None if ok else RuntimeError("a request of the step failed"),
                            context={})


class ServeUser(LarqlUser):
    """The OpenAI-compatible completions API of larql-serve (LARQL_LOAD_SERVE_URL, port 8000)."""

    target = "serve"
    wait_time = between(0, 0.1)
    max_tokens = int(os.environ.get("LARQL_LOAD_MAX_TOKENS", 4))
    prompts = ("The capital of France is", "Once upon a time", "def fibonacci(n):", "The quick brown fox")

    def on_start(self):
        model = os.environ.get("LARQL_LOAD_MODEL")
        if not model:
            r = self.client.get("/v1/models", name=self.name("GET", "/v1/models"))
            data = r.json().get("data") if r.status_code == 200 else None
            model = data[0]["id"] if data else "default"
        self.model = model

    @task
    def completion(self):
        body = {"model": self.model, "prompt": self.prompts[int(self.rng.integers(len(self.prompts)))],
                "max_tokens": self.max_tokens}
        with self.client.post("/v1/completions", json=body, name=self.name("POST", "/v1/completions"),
                              catch_response=True) as r:
            if r.status_code != 200:
                r.failure(f"HTTP {r.status_code}: {r.text[:200] if r.text else ''}")
            elif not (r.json().get("choices") or [{}])[0].get("text") and self.max_tokens:
                r.failure("no choices[0].text in the answer")
