"""``POST /v1/completions``, ``POST /v1/chat/completions`` (SSE or not) and ``GET /v1/models``.

A request is parsed and checked, tokenized, admitted (429 when full) and handed to the scheduler; the
handler then only relays the scheduler's events. Whatever ends the handler (the reply sent, an error,
the client gone: Sanic cancels the handler of a closed connection) cancels the sequence in
``finally``, so a departed client's slot is free at once.
"""

from __future__ import annotations

import asyncio
import json as json_lib
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from sanic import Blueprint
from sanic.request import Request
from sanic.response import HTTPResponse, json

from larql_edge.errors import BadRequest, LarqlError
from larql_edge.service import JSON_KIND, body_kind, json_object

from . import api
from .scheduler import Event, Params, Seq, TokenInfo

bp = Blueprint("openai")


@bp.get("/v1/models", name="models")
async def models(request: Request) -> HTTPResponse:
    s = request.app.ctx.served
    return json({"object": "list", "data": [{"id": s.model_id, "object": "model", "created": s.created,
                                             "owned_by": "larql-edge"}]})


def _body(request: Request) -> dict:
    body_kind(request, (JSON_KIND,))
    return json_object(request)


def _prompt_ids(served, prompt: str | list[int], chat: bool) -> list[int]:
    if isinstance(prompt, list):
        if min(prompt) < 0 or max(prompt) >= served.vocab:
            raise api.bad(f"prompt token ids must be in [0, {served.vocab})", "prompt")
        return prompt
    # Chat text carries its own special tokens (the template's bos_token): as transformers'
    # apply_chat_template, it is encoded without adding them again.
    ids = served.tokenizer.encode(prompt, add_special_tokens=not chat).ids
    if not ids:
        raise api.bad("the prompt encodes to no tokens", "prompt")
    return ids


def _params(served, req: api.CompletionRequest | api.ChatCompletionRequest, n_prompt: int, chat: bool,
            logprobs: int | None) -> Params:
    room = served.context - n_prompt
    if room < 1:
        raise api.bad(f"the prompt is {n_prompt} tokens; this model's context is {served.context} tokens "
                      "(prompt and completion together)", "messages" if chat else "prompt",
                      "context_length_exceeded")
    if isinstance(req, api.ChatCompletionRequest):  # max_completion_tokens wins; max_tokens is still checked
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    else:
        max_tokens = 16 if req.max_tokens is None else req.max_tokens  # OpenAI's default for /v1/completions
    return Params(max_tokens=room if max_tokens is None else min(max_tokens, room),
                  temperature=1.0 if req.temperature is None else req.temperature,
                  top_p=(1.0 if req.top_p is None else req.top_p) or 1e-9,
                  seed=None if req.seed is None else abs(req.seed), stop=req.stop, logprobs=logprobs)


def _completion_logprobs(infos: list[TokenInfo], offset0: int) -> dict:
    out: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    at = offset0
    for t in infos:
        out["tokens"].append(t.text)
        out["token_logprobs"].append(t.logprob)
        out["top_logprobs"].append({text: lp for _, text, lp in t.top})
        out["text_offset"].append(at)
        at += len(t.text)
    return out


def _chat_logprobs(infos: list[TokenInfo]) -> dict:
    def entry(text: str, lp: float) -> dict:
        return {"token": text, "logprob": lp, "bytes": list(text.encode())}

    return {"content": [entry(t.text, t.logprob) | {"top_logprobs": [entry(x, lp) for _, x, lp in t.top]}
                        for t in infos]}


@dataclass
class Shape:
    """What a reply's chunks and choices look like: chat or completion, one JSON body or a stream.
    The collector and the streamer build every choice through it, so neither branches on the kind."""
    chat: bool
    model: str
    n_prompt: int
    logprobs: int | None = None
    include_usage: bool = False
    echo: str = ""  # completions' echo: the prompt's text, before the completion's
    rid: str = ""
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        self.rid = self.rid or ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex[:24]

    def body(self, obj: str, choices: list[dict], **extra: Any) -> dict:
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.model, "choices": choices,
                **extra}

    def usage(self, generated: int) -> dict:
        return {"prompt_tokens": self.n_prompt, "completion_tokens": generated,
                "total_tokens": self.n_prompt + generated}

    def _logprobs(self, infos: list[TokenInfo], offset: int) -> dict | None:
        if self.logprobs is None:
            return None
        return _chat_logprobs(infos) if self.chat else _completion_logprobs(infos, offset)

    def choice(self, index: int, text: str, infos: list[TokenInfo], finish: str | None) -> dict:
        """A whole choice of a JSON reply."""
        out: dict[str, Any] = {"index": index, "finish_reason": finish, "logprobs": self._logprobs(infos, 0)}
        if self.chat:
            out["message"] = {"role": "assistant", "content": text}
        else:
            out["text"] = text
        return out

    def delta(self, index: int, text: str | None, infos: list[TokenInfo], offset: int = 0,
              finish: str | None = None, role: bool = False) -> dict:
        """One streamed piece of a choice (``text`` None: the closing chunk that carries ``finish``)."""
        out: dict[str, Any] = {"index": index, "logprobs": None if text is None or role else self._logprobs(infos, offset),
                               "finish_reason": finish}
        if self.chat:
            out["delta"] = ({"role": "assistant", "content": ""} if role else
                            {} if text is None else {"content": text})
        else:
            out["text"] = text or ""
        return out


async def _collect(seqs: list[Seq], shape: Shape) -> HTTPResponse:
    """Every sequence to its end, then one JSON body."""
    texts: list[list[str]] = [[] for _ in seqs]
    infos: list[list[TokenInfo]] = [[] for _ in seqs]
    finish: list[str | None] = [None] * len(seqs)
    events = seqs[0].events
    left = len(seqs)
    while left:
        ev: Event = await events.get()
        if ev.kind == "error":
            assert ev.error is not None
            raise ev.error
        if ev.kind == "done":
            finish[ev.index] = ev.finish_reason
            left -= 1
            continue
        texts[ev.index].append(ev.text)
        infos[ev.index].extend(ev.tokens)
    choices = [shape.choice(i, shape.echo + "".join(texts[i]), infos[i], finish[i]) for i in range(len(seqs))]
    obj = "chat.completion" if shape.chat else "text_completion"
    return json(shape.body(obj, choices, usage=shape.usage(sum(len(s.generated) for s in seqs))))


async def _stream(request: Request, seqs: list[Seq], shape: Shape) -> None:
    """Server-sent events: one chunk per released piece of text, then [DONE]."""
    response = await request.respond(content_type="text/event-stream",
                                     headers={"cache-control": "no-cache", "x-accel-buffering": "no"})
    obj = "chat.completion.chunk" if shape.chat else "text_completion"

    async def send(choices: list[dict], usage: dict | None = None) -> None:
        data = shape.body(obj, choices, **({"usage": usage} if shape.include_usage else {}))
        await response.send(f"data: {json_lib.dumps(data, ensure_ascii=False)}\n\n")

    for s in seqs:
        if shape.chat:
            await send([shape.delta(s.index, "", [], role=True)])
        elif shape.echo:
            await send([shape.delta(s.index, shape.echo, [])])
    offsets = [len(shape.echo)] * len(seqs)
    events = seqs[0].events
    left = len(seqs)
    while left:
        ev = await events.get()
        if ev.kind == "error":
            err = ev.error if isinstance(ev.error, LarqlError) else None
            payload = api.openai_error_body(err.status if err else 500,
                                            err.message if err else "internal server error", ev.error or Exception())
            await response.send(f"data: {json_lib.dumps(payload)}\n\n")
            break
        if ev.kind == "done":
            left -= 1
            await send([shape.delta(ev.index, None, [], finish=ev.finish_reason)])
            if not left and shape.include_usage:
                await send([], shape.usage(sum(len(s.generated) for s in seqs)))
            continue
        await send([shape.delta(ev.index, ev.text, ev.tokens, offsets[ev.index])])
        offsets[ev.index] += len(ev.text)
    await response.send("data: [DONE]\n\n")
    await response.eof()


async def _run(request: Request, req: api.CompletionRequest | api.ChatCompletionRequest, prompt_ids: list[int],
               chat: bool, echo: str = "") -> HTTPResponse | None:
    app = request.app
    served, sched = app.ctx.served, app.ctx.scheduler
    if isinstance(req, api.ChatCompletionRequest):
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
    else:
        logprobs = req.logprobs
    params = _params(served, req, len(prompt_ids), chat, logprobs)
    stream = bool(req.stream)
    shape = Shape(chat, served.model_id, len(prompt_ids), logprobs,
                  include_usage=stream and bool(req.stream_options and req.stream_options.include_usage),
                  echo=echo)
    seq = Seq(prompt_ids, params, asyncio.get_running_loop())
    seqs = [seq]
    sched.admit(seq)  # 429 before any byte of a stream is sent
    try:
        if not stream:
            return await _collect(seqs, shape)
        await _stream(request, seqs, shape)
        return None
    finally:
        for s in seqs:
            sched.cancel(s)  # a no-op for a finished sequence; frees a departed client's slot at once


@bp.post("/v1/completions", name="completions")
async def completions(request: Request):
    served = request.app.ctx.served
    req = api.completion_request(_body(request), served.model_id, served.names)
    if req.echo and req.logprobs is not None:
        raise api.bad("echo with logprobs is not supported (the prompt's own log-probabilities are not computed)",
                      "echo", "unsupported_value")
    # Tokenizing a large prompt takes a while: off the event loop, in the app's compute thread.
    ids = await request.app.ctx.compute.run(_prompt_ids, served, req.prompt, False)
    echo = ""
    if req.echo:
        echo = req.prompt if isinstance(req.prompt, str) else served.tokenizer.decode(ids, skip_special_tokens=False)
    return await _run(request, req, ids, chat=False, echo=echo)


@bp.post("/v1/chat/completions", name="chat_completions")
async def chat_completions(request: Request):
    served = request.app.ctx.served
    req = api.chat_request(_body(request), served.model_id, served.names)
    messages = [m.for_template() for m in req.messages]
    if served.chat_template is None:
        raise api.api_error(BadRequest, f"the model {served.model_id!r} has no chat template (its vindex has no "
                            "tokenizer_config.json chat_template): use /v1/completions, or start larql-serve with "
                            "--chat-template FILE", "messages", "no_chat_template")
    template = served.chat_template

    def prompt_ids() -> list[int]:  # rendering and tokenizing: off the event loop
        return _prompt_ids(served, template.render(messages, add_generation_prompt=True), True)

    return await _run(request, req, await request.app.ctx.compute.run(prompt_ids), chat=True)
