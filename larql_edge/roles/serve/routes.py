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
from typing import Any

from sanic import Blueprint
from sanic.request import Request
from sanic.response import HTTPResponse, json

from larql_edge.errors import BadRequest, LarqlError
from larql_edge.model import tokens
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
    if served.bound.exceeds(prompt, served.context):  # more tokens than the context whatever it encodes to
        raise api.bad(f"the prompt is {len(prompt)} characters, more than this model's context of {served.context} "
                      f"tokens can hold (at most {served.bound.chars(served.context)} characters)",
                      "messages" if chat else "prompt", "context_length_exceeded")
    # Chat text carries its own special tokens (the template's bos_token): as transformers'
    # apply_chat_template, it is encoded without adding them again.
    ids = tokens.encode(served.tokenizer, prompt, add_special_tokens=not chat)
    if not ids:
        raise api.bad("the prompt encodes to no tokens", "prompt")
    return ids


def _params(served, c: api.Common, n_prompt: int, chat: bool) -> Params:
    room = served.context - n_prompt
    if room < 1:
        raise api.bad(f"the prompt is {n_prompt} tokens; this model's context is {served.context} tokens "
                      "(prompt and completion together)", "messages" if chat else "prompt",
                      "context_length_exceeded")
    max_tokens = room if c.max_tokens is None else min(c.max_tokens, room)
    return Params(max_tokens=max_tokens, temperature=c.temperature, top_p=c.top_p, seed=c.seed, stop=c.stop,
                  logprobs=c.logprobs)


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


def _usage(n_prompt: int, n_gen: int) -> dict:
    return {"prompt_tokens": n_prompt, "completion_tokens": n_gen, "total_tokens": n_prompt + n_gen}


async def _run(request: Request, c: api.Common, prompt_ids: list[int], chat: bool) -> HTTPResponse | None:
    app = request.app
    served, sched = app.ctx.served, app.ctx.scheduler
    params = _params(served, c, len(prompt_ids), chat)
    seq = Seq(prompt_ids, params, asyncio.get_running_loop())
    sched.admit(seq)  # 429 before any byte of a stream is sent
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
    created = int(time.time())
    obj = "chat.completion" if chat else "text_completion"
    try:
        if not c.stream:
            text, infos, finish = [], [], None
            while True:
                ev: Event = await seq.events.get()
                if ev.kind == "error":
                    assert ev.error is not None
                    raise ev.error
                if ev.kind == "done":
                    finish = ev.finish_reason
                    break
                text.append(ev.text)
                infos.extend(ev.tokens)
            full = "".join(text)
            choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "logprobs": None}
            if chat:
                choice["message"] = {"role": "assistant", "content": full}
                if c.logprobs is not None:
                    choice["logprobs"] = _chat_logprobs(infos)
            else:
                choice["text"] = full
                if c.logprobs is not None:
                    choice["logprobs"] = _completion_logprobs(infos, 0)
            return json({"id": rid, "object": obj, "created": created, "model": served.model_id,
                         "choices": [choice], "usage": _usage(len(prompt_ids), len(seq.generated))})
        # Streaming: server-sent events, one chunk per released piece of text, then [DONE].
        response = await request.respond(content_type="text/event-stream",
                                         headers={"cache-control": "no-cache", "x-accel-buffering": "no"})
        chunk_obj = "chat.completion.chunk" if chat else "text_completion"

        async def send(choice: dict, usage: dict | None = None, with_choice: bool = True) -> None:
            data: dict[str, Any] = {"id": rid, "object": chunk_obj, "created": created, "model": served.model_id,
                                    "choices": [choice] if with_choice else []}
            if c.include_usage:
                data["usage"] = usage
            await response.send(f"data: {json_lib.dumps(data, ensure_ascii=False)}\n\n")

        if chat:
            await send({"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                        "finish_reason": None})
        offset = 0
        while True:
            ev = await seq.events.get()
            if ev.kind == "error":
                err = ev.error if isinstance(ev.error, LarqlError) else None
                payload = api.openai_error_body(err.status if err else 500,
                                                err.message if err else "internal server error",
                                                ev.error or Exception())
                await response.send(f"data: {json_lib.dumps(payload)}\n\n")
                break
            if ev.kind == "done":
                if chat:
                    await send({"index": 0, "delta": {}, "logprobs": None, "finish_reason": ev.finish_reason})
                else:
                    await send({"index": 0, "text": "", "logprobs": None, "finish_reason": ev.finish_reason})
                if c.include_usage:
                    await send({}, _usage(len(prompt_ids), len(seq.generated)), with_choice=False)
                break
            lp = None
            if c.logprobs is not None:
                lp = _chat_logprobs(ev.tokens) if chat else _completion_logprobs(ev.tokens, offset)
            offset += len(ev.text)
            if chat:
                await send({"index": 0, "delta": {"content": ev.text}, "logprobs": lp, "finish_reason": None})
            else:
                await send({"index": 0, "text": ev.text, "logprobs": lp, "finish_reason": None})
        await response.send("data: [DONE]\n\n")
        await response.eof()
        return None
    finally:
        sched.cancel(seq)  # a no-op for a finished sequence; frees a departed client's slot at once


@bp.post("/v1/completions", name="completions")
async def completions(request: Request):
    served = request.app.ctx.served
    c, prompt = api.completion_request(_body(request), served.model_id, served.names)
    # Tokenizing a large prompt takes a while: off the event loop, in the app's compute thread.
    ids = await request.app.ctx.compute.run(_prompt_ids, served, prompt, False)
    return await _run(request, c, ids, chat=False)


@bp.post("/v1/chat/completions", name="chat_completions")
async def chat_completions(request: Request):
    served = request.app.ctx.served
    c, messages = api.chat_request(_body(request), served.model_id, served.names)
    if served.chat_template is None:
        raise api.api_error(BadRequest, f"the model {served.model_id!r} has no chat template (its vindex has no "
                            "tokenizer_config.json chat_template): use /v1/completions, or start larql-serve with "
                            "--chat-template FILE", "messages", "no_chat_template")
    template = served.chat_template

    def prompt_ids() -> list[int]:  # rendering and tokenizing: off the event loop
        return _prompt_ids(served, template.render(messages, add_generation_prompt=True), True)

    return await _run(request, c, await request.app.ctx.compute.run(prompt_ids), chat=True)
