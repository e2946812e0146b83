"""larql-serve's app: the OpenAI routes on the service toolkit, with OpenAI's error envelope.

``Served`` is what the routes need (the model's id, tokenizer, chat template, context) and the
`Scheduler` steps every sequence. `remote_engine` builds the batch engine of a real deployment:
attention from the vindex (the ``attn`` preset carries it), embeddings, FFN and logits from the grid.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sanic import Sanic
from sanic.request import Request

from larql_edge.errors import ServiceUnavailable
from larql_edge.format.vindex import Vindex
from larql_edge.model.batch import BatchEngine, kv_bytes_per_token
from larql_edge.model.prefix_cache import PrefixCache
from larql_edge.model.speculative import Settings
from larql_edge.model.tokens import TextBound
from larql_edge.net.hops import HopLog
from larql_edge.net.remote import RemoteSettings, build_tiers
from larql_edge.service import Hooks, make_app
from larql_edge.service.metrics import HopMetrics

from .api import MAX_N, openai_error_body
from .auth import require_api_keys
from .chat import ChatTemplate
from .openapi import openapi_spec
from .routes import bp
from .scheduler import Scheduler
from .structured import Grammars

# The request bodies are small JSON (a prompt, messages): 4 MiB takes a context's worth of text.
MAX_BODY = 4 << 20
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
STEP_ROWS_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)


@dataclass
class Limits:
    max_active: int = 8
    max_queue: int = 64
    context: int = 2048
    kv_memory_bytes: int = 1 << 30
    step_tokens: int = 128
    prefix_cache_bytes: int | None = None  # None: what kv_memory_bytes leaves after max_active caches; 0: off

    def prefix_budget(self, spec) -> int:
        if self.prefix_cache_bytes is not None:
            return self.prefix_cache_bytes
        return max(0, self.kv_memory_bytes - self.max_active * self.context * kv_bytes_per_token(spec))

    def as_json(self, spec) -> dict:
        return {"max_active": self.max_active, "max_queue": self.max_queue, "context": self.context,
                "kv_memory_bytes": self.kv_memory_bytes, "kv_bytes_per_sequence": self.context * kv_bytes_per_token(spec),
                "step_tokens": self.step_tokens, "n": min(MAX_N, self.max_active), "max_body_bytes": MAX_BODY,
                "prefix_cache_bytes": self.prefix_budget(spec)}


@dataclass
class Served:
    model_id: str
    tokenizer: Any
    vocab: int
    context: int
    chat_template: ChatTemplate | None
    eos_ids: tuple[int, ...]
    names: frozenset[str] = frozenset()  # every name a request may give for the model (model_id too)
    grid: dict[str, Any] = field(default_factory=dict)  # what GET /v1/models/{id} says the model runs on
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        self.bound = TextBound(self.tokenizer)  # a prompt longer than this is refused untokenized


def effective_limits(limits: Limits, spec) -> Limits:
    """``max_active`` bounded by the KV memory: every active sequence may fill the whole context."""
    per_seq = limits.context * kv_bytes_per_token(spec)
    by_memory = max(0, limits.kv_memory_bytes // per_seq)
    return Limits(min(limits.max_active, by_memory), limits.max_queue, limits.context, limits.kv_memory_bytes,
                  limits.step_tokens, limits.prefix_cache_bytes)


def create_app(engine: BatchEngine, served: Served, limits: Limits, name: str = "larql_serve",
               api_keys: tuple[str, ...] = (), speculation: Settings | None = None) -> Sanic:
    """``api_keys``: when given, every route but health, readiness, metrics and /openapi.json needs one.
    ``speculation``: n-gram speculative decoding's settings (None: the defaults, on)."""
    budget = limits.prefix_budget(engine.spec)
    prefix = PrefixCache(budget, kv_bytes_per_token(engine.spec)) if budget else None
    sched = Scheduler(engine, served.tokenizer, context=limits.context, max_active=limits.max_active,
                      max_queue=limits.max_queue, step_tokens=limits.step_tokens, eos_ids=served.eos_ids,
                      prefix=prefix, speculation=speculation or Settings())

    def data_path() -> dict:
        path, hedger = getattr(engine.ffn, "path", None), getattr(engine.ffn, "hedger", None)
        return {"direct": bool(path is not None and path.enabled),
                "topology": path.topology.version if path is not None and path.topology is not None else None,
                "hedge": hedger.stats() if hedger is not None else None}

    def stats(request: Request) -> dict:
        return {"mode": "serve", "model": served.model_id, "num_layers": engine.spec.num_layers,
                "hidden_size": engine.spec.hidden_size, "vocab_size": served.vocab,
                "chat_template": served.chat_template is not None, "api_keys": bool(api_keys),
                "active": sched.active_count, "queued": sched.queued_count,
                "scheduler": sched.stats(), "limits": limits.as_json(engine.spec), "data_path": data_path(),
                "speculation": sched.speculation.as_json()}

    async def drain(seconds: float) -> None:
        """SIGTERM: new requests get a retryable 503, the sequences already admitted have ``seconds``
        to finish; any still running then ends with an error event and [DONE], never silence."""
        sched.draining = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + seconds * 0.8  # the rest: for the handlers to send their last events
        while sched.active_count + sched.queued_count and loop.time() < deadline:
            await asyncio.sleep(0.05)
        await asyncio.to_thread(sched.stop, ServiceUnavailable("this server is shutting down: retry the request"))

    hooks = Hooks(ready=lambda: {"ready": True, "model": served.model_id}, stats=stats,
                  inflight=lambda: sched.active_count + sched.queued_count, openapi=openapi_spec(), drain=drain)
    app = make_app(name, "serve", hooks, max_body=MAX_BODY, error_body=openai_error_body)
    app.config.RESPONSE_TIMEOUT = 3600  # a long generation streams for minutes
    app.ctx.served, app.ctx.scheduler, app.ctx.engine = served, sched, engine
    app.ctx.grammars = Grammars(served.tokenizer, served.vocab, served.eos_ids)
    app.blueprint(bp)
    require_api_keys(app, api_keys)

    m = app.ctx.metrics
    active = m.gauge("active_sequences", "Sequences holding a KV cache, stepped together")
    queued = m.gauge("queued_sequences", "Admitted sequences waiting for a slot")
    ttft = m.histogram("time_to_first_token_seconds", "From admission to the first generated token", buckets=TTFT_BUCKETS)
    itl = m.histogram("inter_token_latency_seconds", "Between two tokens of one sequence", buckets=ITL_BUCKETS)
    generated = m.counter("generated_tokens", "Tokens generated")
    prompt = m.counter("prompt_tokens", "Prompt tokens admitted")
    drafted = m.counter("speculative_drafted_tokens", "Draft tokens verified (n-gram or --draft model speculation)")
    accepted = m.counter("speculative_accepted_tokens", "Draft tokens accepted (each one a token without a pass of its own)")
    withheld = m.counter("speculative_withheld_tokens", "Draft tokens proposed but left out of their step: their "
                         "rows would not have paid (--spec-budget)")
    step_rows = m.histogram("step_positions", "Positions (rows) per batching step: prompt chunks, decoded tokens "
                            "and drafts of every sequence", buckets=STEP_ROWS_BUCKETS)
    sched.on_token = lambda kind, seconds: (ttft if kind == "ttft" else itl).observe(seconds)
    sched.on_step = step_rows.observe
    seen = {"generated": 0, "prompt": 0, "drafted": 0, "accepted": 0, "withheld": 0}

    def flush() -> None:
        active.set(sched.active_count)
        queued.set(sched.queued_count)
        g, p = sched.generated_tokens, sched.prompt_tokens
        generated.inc(g - seen["generated"])
        prompt.inc(p - seen["prompt"])
        seen["generated"], seen["prompt"] = g, p
        dr, ac = sched.drafted_tokens, sched.accepted_tokens
        drafted.inc(dr - seen["drafted"])
        accepted.inc(ac - seen["accepted"])
        seen["drafted"], seen["accepted"] = dr, ac
        withheld.inc(sched.withheld_tokens - seen["withheld"])
        seen["withheld"] = sched.withheld_tokens

    m.add_flusher(flush)
    hop_metrics = HopMetrics(m)
    hops = getattr(getattr(engine.ffn, "replicas", None), "hops", None)
    hedger = getattr(engine.ffn, "hedger", None)

    def flush_hops() -> None:
        if hops is not None:
            hop_metrics.record(hops.drain())
        while engine.step_local:
            hop_metrics.local.observe(engine.step_local.popleft())
        while sched.step_draft:
            hop_metrics.draft.observe(sched.step_draft.popleft())
        if hedger is not None:
            hop_metrics.hedged(hedger.sent, hedger.won)

    m.add_flusher(flush_hops)

    @app.after_server_stop
    async def _stop_scheduler(app_):
        sched.stop()  # already stopped by the drain, unless the app stopped without one

    return app


def remote_engine(vx: Vindex, s: RemoteSettings) -> BatchEngine:
    """Attention here; embeddings and logits from ``s.embed`` (default: the ``s.ffn`` router, which
    proxies the embed server), the FFN of each layer from ``s.ffn``."""
    from larql_edge.errors import RemoteError
    from larql_edge.model.backend import get_backend
    from larql_edge.model.forward import load_attention
    from larql_edge.model.spec import ModelSpec

    spec = ModelSpec.from_index(vx.index)
    be = get_backend()
    tiers = build_tiers(s, spec.hidden_size, spec.num_layers, spec.vocab_size, hops=HopLog())
    if tiers.ffn is None:
        raise RemoteError("--ffn is required")
    return BatchEngine(spec, load_attention(vx, spec, be), tiers.embedder, tiers.ffn, tiers.head, be)


def served_model(vx: Vindex, tokenizer, context: int, chat_template_file: str | None,
                 names: tuple[str, ...] = ()) -> Served:
    """``names``: what /v1/models lists (the first) and requests may say, beside the vindex's own model name."""
    from larql_edge.model.spec import ModelSpec

    from .chat import eos_from_generation_config, load_chat_template

    spec = ModelSpec.from_index(vx.index)
    chat = load_chat_template(Path(vx.path), chat_template_file, tokenizer, vx.index.family)
    turn_end = (tokenizer.token_to_id(chat.end_of_turn),) if chat is not None and chat.end_of_turn else ()
    eos = tuple(dict.fromkeys(spec.eos_token_ids + eos_from_generation_config(Path(vx.path)) + turn_end))
    return Served(model_id=names[0] if names else vx.model, tokenizer=tokenizer, vocab=spec.vocab_size, context=context,
                  chat_template=chat, eos_ids=eos,
                  names=frozenset((*names, vx.model)))
