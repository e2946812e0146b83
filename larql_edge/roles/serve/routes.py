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

from larql_edge.errors import BadRequest, LarqlError, NotFound
from larql_edge.model import tokens
from larql_edge.service import JSON_KIND, body_kind, json_object

from . import api, tools
from .scheduler import Event, Params, Seq, TokenInfo
from .structured import Constraint, response_format_schema

bp = Blueprint("openai")


def _model(s) -> dict:
    return {"id": s.model_id, "object": "model", "created": s.created, "owned_by": "larql-edge"}


@bp.get("/v1/models", name="models")
async def models(request: Request) -> HTTPResponse:
    return json({"object": "list", "data": [_model(request.app.ctx.served)]})


@bp.get("/v1/models/<model_id:path>", name="model")
async def model(request: Request, model_id: str) -> HTTPResponse:
    """One model: OpenAI's object, with the context length (vLLM's max_model_len) and the grid."""
    s = request.app.ctx.served
    if model_id != s.model_id and model_id not in s.names:
        raise api.api_error(NotFound, f"the model {model_id[:80]!r} does not exist: this server serves {s.model_id!r}",
                            "model", "model_not_found")
    return json(_model(s) | {"max_model_len": s.context, "context_length": s.context, "vocab_size": s.vocab,
                             "aliases": sorted(s.names - {s.model_id}), "grid": s.grid})


@bp.post("/tokenize", name="tokenize", stream=True)
async def tokenize(request: Request) -> HTTPResponse:
    """llama.cpp's and vLLM's /tokenize in one: ``tokens`` (ids, or {id, piece} with with_pieces),
    and vLLM's ``count`` and ``max_model_len``."""
    served = request.app.ctx.served
    req = api.tokenize_request(await _body(request), served.model_id, served.names)

    def run() -> list[int]:
        if req.messages is not None:
            if served.chat_template is None:
                raise api.bad(f"the model {served.model_id!r} has no chat template", "messages", "no_chat_template")
            gen = True if req.add_generation_prompt is None else req.add_generation_prompt
            text = served.chat_template.render([m.for_template() for m in req.messages], add_generation_prompt=gen)
            return tokens.encode(served.tokenizer, text, add_special_tokens=bool(req.add_special_tokens))
        if req.content is not None:  # llama.cpp: no special tokens unless asked
            special = bool(req.add_special or req.add_special_tokens)
            return tokens.encode(served.tokenizer, req.content, add_special_tokens=special)
        special = req.add_special_tokens is not False and req.add_special is not False  # vLLM: on unless off
        assert req.prompt is not None  # exactly one of content, prompt, messages (api.tokenize_request)
        return tokens.encode(served.tokenizer, req.prompt, add_special_tokens=special)

    ids = await request.app.ctx.compute.run(run)
    out: dict[str, Any] = {"count": len(ids), "max_model_len": served.context}
    if req.with_pieces:
        out["tokens"] = [{"id": i, "piece": served.tokenizer.decode([i], skip_special_tokens=False)} for i in ids]
    else:
        out["tokens"] = ids
    if req.return_token_strs:
        out["token_strs"] = [served.tokenizer.id_to_token(i) for i in ids]
    return json(out)


@bp.post("/detokenize", name="detokenize", stream=True)
async def detokenize(request: Request) -> HTTPResponse:
    """llama.cpp's reply key (``content``) and vLLM's (``prompt``), the same text."""
    served = request.app.ctx.served
    req = api.detokenize_request(await _body(request), served.model_id, served.names)
    if req.tokens and max(req.tokens) >= served.vocab:
        raise api.bad(f"token ids must be in [0, {served.vocab})", "tokens")
    text = await request.app.ctx.compute.run(served.tokenizer.decode, req.tokens, False)
    return json({"content": text, "prompt": text})


async def _body(request: Request) -> dict:
    """The JSON body of a POST route. Those routes are ``stream=True`` so that the API key (a request
    middleware, `auth.py`) is checked before any body byte is read; the body limit is Sanic's again."""
    body_kind(request, (JSON_KIND,))
    if request.stream is not None:
        request.stream.request_max_size = request.app.config.REQUEST_MAX_SIZE
        await request.receive_body()
    if len(request.body or b"") > LOOP_PARSE_BYTES:  # a long prompt's JSON: parsed off the loop (#19)
        return await request.app.ctx.compute.run(json_object, request)
    return json_object(request)


# Parsing a 4 MiB body (UTF-8, surrogate scan, json) takes tens of ms, more on a busy host: eight of
# them on the loop held /v1/health past its bound.
LOOP_PARSE_BYTES = 256 << 10


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


def _params(served, req: api.CompletionRequest | api.ChatCompletionRequest, n_prompt: int, chat: bool,
            logprobs: int | None) -> Params:
    room = served.context - n_prompt
    if room < 1:
        raise api.bad(f"the prompt is {n_prompt} tokens; this model's context is {served.context} tokens "
                      "(prompt and completion together)", "messages" if chat else "prompt",
                      "context_length_exceeded")
    for tid in req.logit_bias:
        if tid >= served.vocab:
            raise api.bad(f"logit_bias: token id {tid} is beyond the vocabulary ({served.vocab} tokens)", "logit_bias")
    if isinstance(req, api.ChatCompletionRequest):  # max_completion_tokens wins; max_tokens is still checked
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    else:
        max_tokens = 16 if req.max_tokens is None else req.max_tokens  # OpenAI's default for /v1/completions
    return Params(max_tokens=room if max_tokens is None else min(max_tokens, room),
                  temperature=1.0 if req.temperature is None else req.temperature,
                  top_p=(1.0 if req.top_p is None else req.top_p) or 1e-9,
                  seed=api.rng_seed(req.seed), stop=req.stop, logprobs=logprobs,
                  presence_penalty=req.presence_penalty or 0.0, frequency_penalty=req.frequency_penalty or 0.0,
                  repetition_penalty=req.repetition_penalty or 1.0, logit_bias=req.logit_bias,
                  top_k=max(0, req.top_k or 0), min_p=req.min_p or 0.0)


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
    cached: int = 0  # prompt tokens that came from the prefix cache
    echo: list[str] = field(default_factory=list)  # completions' echo, by choice: the prompt's text first
    rid: str = ""
    tool_plan: tools.ToolPlan | None = None  # a chat with tools: its text may become tool_calls
    tool_syntax: str | None = None  # the chat template's tool-call syntax (`tools.syntax_of`)
    replies: dict[int, tools.ToolReply] = field(default_factory=dict)  # by choice
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        self.rid = self.rid or ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex[:24]

    def body(self, obj: str, choices: list[dict], **extra: Any) -> dict:
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.model, "choices": choices,
                **extra}

    def usage(self, seqs: list[Seq]) -> dict:
        generated = sum(len(s.generated) for s in seqs)
        return {"prompt_tokens": self.n_prompt, "completion_tokens": generated,
                "total_tokens": self.n_prompt + generated,
                "prompt_tokens_details": {"cached_tokens": sum(s.cached for s in seqs if s.leader is None)}}

    def echoed(self, index: int) -> str:
        return self.echo[index] if self.echo else ""

    def _logprobs(self, infos: list[TokenInfo], offset: int) -> dict | None:
        if self.logprobs is None:
            return None
        return _chat_logprobs(infos) if self.chat else _completion_logprobs(infos, offset)

    def choice(self, index: int, text: str, infos: list[TokenInfo], finish: str | None) -> dict:
        """A whole choice of a JSON reply."""
        out: dict[str, Any] = {"index": index, "finish_reason": finish, "logprobs": self._logprobs(infos, 0)}
        if self.chat:
            out["message"] = {"role": "assistant", "content": text}
            if self.tool_plan is not None:
                out["message"], out["finish_reason"] = self.reply(index).message(text, finish)
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


    def reply(self, index: int) -> tools.ToolReply:
        assert self.tool_plan is not None
        if index not in self.replies:
            self.replies[index] = tools.ToolReply(self.tool_plan, self.tool_syntax)
        return self.replies[index]

    def deltas(self, index: int, text: str, infos: list[TokenInfo], offset: int) -> list[dict]:
        """The streamed pieces one released text becomes (a tool call's: none while held, or several)."""
        if self.tool_plan is None:
            return [self.delta(index, text, infos, offset)]
        return [{"index": index, "delta": d, "logprobs": None, "finish_reason": None} for d in self.reply(index).delta(text)]

    def closing(self, index: int, finish: str | None) -> list[dict]:
        """What ends a streamed choice: the tool calls still owed, then the chunk with its finish_reason."""
        owed: list[dict] = []
        if self.tool_plan is not None:
            pieces, finish = self.reply(index).close(finish)
            owed = [{"index": index, "delta": d, "logprobs": None, "finish_reason": None} for d in pieces]
        return [*owed, self.delta(index, None, [], finish=finish)]


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
    choices = [shape.choice(i, shape.echoed(i) + "".join(texts[i]), infos[i], finish[i]) for i in range(len(seqs))]
    obj = "chat.completion" if shape.chat else "text_completion"
    return json(shape.body(obj, choices, usage=shape.usage(seqs)))


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
        elif shape.echoed(s.index):
            await send([shape.delta(s.index, shape.echoed(s.index), [])])
    offsets = [len(shape.echoed(s.index)) for s in seqs]
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
            for piece in shape.closing(ev.index, ev.finish_reason):
                await send([piece])
            if not left and shape.include_usage:
                await send([], shape.usage(seqs))
            continue
        for piece in shape.deltas(ev.index, ev.text, ev.tokens, offsets[ev.index]):
            await send([piece])
        offsets[ev.index] += len(ev.text)
    await response.send("data: [DONE]\n\n")
    await response.eof()


async def _constraint(request: Request, schema: dict | None, param: str) -> Constraint | None:
    """The grammar of a structured reply, compiled in the compute thread (the first one indexes the
    vocabulary); each sequence takes its own copy."""
    if schema is None:
        return None
    return await request.app.ctx.compute.run(request.app.ctx.grammars.json_schema, schema, param)


async def _run(request: Request, req: api.CompletionRequest | api.ChatCompletionRequest, prompts: list[list[int]],
               chat: bool, echo: list[str] | None = None, constraint: Constraint | None = None,
               plan: tools.ToolPlan | None = None, tool_syntax: str | None = None) -> HTTPResponse | None:
    """``prompts``: one, or a completions batch; each gives n choices (index: prompt x n + i)."""
    app = request.app
    served, sched = app.ctx.served, app.ctx.scheduler
    if isinstance(req, api.ChatCompletionRequest):
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
    else:
        logprobs = req.logprobs
    n = req.n or 1
    if n > sched.max_active:
        raise api.bad(f"n={n}: this server steps at most {sched.max_active} sequences together", "n")
    params = [_params(served, req, len(ids), chat, logprobs) for ids in prompts]
    stream = bool(req.stream)
    shape = Shape(chat, served.model_id, sum(len(ids) for ids in prompts), logprobs,
                  include_usage=stream and bool(req.stream_options and req.stream_options.include_usage),
                  echo=[e for e in echo or () for _ in range(n)], tool_plan=plan, tool_syntax=tool_syntax)
    loop, events = asyncio.get_running_loop(), asyncio.Queue[Event]()
    ends = plan.repeats if plan is not None and plan.choice == "required" else None
    groups = [[Seq(ids, p, loop, events, index=j * n + i, constraint=constraint and constraint.copy(), ends=ends)
               for i in range(n)] for j, (ids, p) in
              enumerate(zip(prompts, params, strict=True))]
    seqs = [s for g in groups for s in g]
    try:
        for g in groups:
            sched.admit(g[0], g[1:])  # 429 before any byte of a stream is sent
        if not stream:
            return await _collect(seqs, shape)
        await _stream(request, seqs, shape)
        return None
    finally:
        for s in seqs:
            sched.cancel(s)  # a no-op for a finished sequence; frees a departed client's slot at once


@bp.post("/v1/completions", name="completions", stream=True)
async def completions(request: Request):
    served = request.app.ctx.served
    req = api.completion_request(await _body(request), served.model_id, served.names)
    if req.echo and req.logprobs is not None:
        raise api.bad("echo with logprobs is not supported (the prompt's own log-probabilities are not computed)",
                      "echo", "unsupported_value")
    if req.best_of is not None and req.best_of != (req.n or 1):
        raise api.bad("best_of must equal n: completions are not ranked here", "best_of", "unsupported_value")

    def tokenized() -> list[list[int]]:  # a large prompt takes a while: off the event loop
        return [_prompt_ids(served, p, False) for p in req.prompt]

    prompts = await request.app.ctx.compute.run(tokenized)
    constraint = await _constraint(request, response_format_schema(req.response_format),
                                   "response_format.json_schema.schema")
    echo = None
    if req.echo:
        echo = [p if isinstance(p, str) else served.tokenizer.decode(ids, skip_special_tokens=False)
                for p, ids in zip(req.prompt, prompts, strict=True)]
    return await _run(request, req, prompts, chat=False, echo=echo, constraint=constraint)


@bp.post("/v1/chat/completions", name="chat_completions", stream=True)
async def chat_completions(request: Request):
    served = request.app.ctx.served
    req = api.chat_request(await _body(request), served.model_id, served.names)
    messages = [m.for_template() for m in req.messages]
    if served.chat_template is None:
        raise api.api_error(BadRequest, f"the model {served.model_id!r} has no chat template (its vindex has no "
                            "tokenizer_config.json chat_template): use /v1/completions, or start larql-serve with "
                            "--chat-template FILE", "messages", "no_chat_template")
    template = served.chat_template
    plan = tools.plan(req.tools, req.tool_choice, req.parallel_tool_calls)
    schema, param = response_format_schema(req.response_format), "response_format.json_schema.schema"
    if plan is not None and plan.forced:  # the call's grammar wins over a response_format
        schema, param = plan.schema(), "tools"
    constraint = await _constraint(request, schema, param)

    def prompt_ids() -> list[int]:  # rendering and tokenizing: off the event loop
        text = template.render(messages, add_generation_prompt=True, tools=None if plan is None else plan.tools)
        return _prompt_ids(served, text, True)

    return await _run(request, req, [await request.app.ctx.compute.run(prompt_ids)], chat=True, constraint=constraint,
                      plan=plan, tool_syntax=None if plan is None else tools.syntax_of(template.source))
