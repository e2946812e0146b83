"""The tokenizer over HTTP: encode text to ids and decode ids to text (GET for one, POST for batches)."""

from __future__ import annotations

import numpy as np
from sanic import Blueprint
from sanic.response import HTTPResponse, json

from larql_edge.errors import BadRequest, PayloadTooLarge
from larql_edge.model import tokens
from larql_edge.roles.embed import requests as rq
from larql_edge.roles.embed.routes._common import both, model_of
from larql_edge.service import JSON_KIND, body_kind, json_object

bp = Blueprint("tokens")


def _check_text(text, limit: int) -> str:
    if not isinstance(text, str):
        raise BadRequest("text must be a string")
    if len(text) > limit:
        raise PayloadTooLarge(f"text has {len(text)} characters; the limit is {limit}")
    return text


def _flag(obj: dict, name: str) -> bool:
    """A JSON body's boolean option: true or false when present (query strings use rq.bool_param)."""
    value = obj.get(name, False)
    if not isinstance(value, bool):
        raise BadRequest(f"{name} must be true or false")
    return value


def _ids(m, ids: np.ndarray, limit: int) -> list[int]:
    if ids.size == 0:
        return []
    return rq.check_ids(ids, m.vocab_size, limit, "ids").tolist()


async def _encoded(request, m, text: str, special: bool) -> HTTPResponse:
    # Tokenizing (GIL released) and the reply's JSON both in the compute thread: 100,000 characters
    # take long enough to stall the loop's health checks and heartbeats.
    def work() -> HTTPResponse:
        return json({"token_ids": tokens.encode(m.tokenizer, text, special), "text": text})

    return await request.app.ctx.compute.run(work)


@both(bp, "/token/encode", ["GET"], "encode")
async def encode(request, model_id: str | None = None):
    m = model_of(request, model_id)
    query = request.get_args(keep_blank_values=True)  # ?text= is the empty text
    text = query.get("text")
    if text is None:
        raise BadRequest("text is required, e.g. ?text=Paris")
    text = _check_text(text, request.app.ctx.cfg.limits.max_text_chars)
    special = rq.bool_param(query.get("add_special_tokens"), "add_special_tokens")
    return await _encoded(request, m, text, special)


@both(bp, "/token/encode", ["POST"], "encode_post")
async def encode_post(request, model_id: str | None = None):
    m = model_of(request, model_id)
    body_kind(request, allowed=(JSON_KIND,))
    obj = json_object(request)
    limit = request.app.ctx.cfg.limits.max_text_chars
    special = _flag(obj, "add_special_tokens")
    if "text" in obj:  # checked even when "texts" (the batch) is what is encoded
        _check_text(obj["text"], limit)
    if "texts" in obj:
        texts = obj["texts"]
        if not isinstance(texts, list):
            raise BadRequest("texts must be a list of strings")
        texts = [_check_text(t, limit) for t in texts]

        def batch() -> HTTPResponse:
            encs = m.tokenizer.encode_batch(texts, add_special_tokens=special) if texts else []
            return json({"token_ids": [e.ids for e in encs]})

        return await request.app.ctx.compute.run(batch)
    if "text" not in obj:
        raise BadRequest('send {"text": "..."} or {"texts": ["...", ...]}')
    return await _encoded(request, m, _check_text(obj["text"], limit), special)


@both(bp, "/token/decode", ["GET"], "decode")
async def decode(request, model_id: str | None = None):
    m = model_of(request, model_id)
    query = request.get_args(keep_blank_values=True)
    ids = _ids(m, rq.query_ids(query.get("ids")), request.app.ctx.cfg.limits.max_tokens)
    skip = rq.bool_param(query.get("skip_special_tokens"), "skip_special_tokens")
    return json({"text": m.tokenizer.decode(ids, skip_special_tokens=skip), "token_ids": ids})


@both(bp, "/token/decode", ["POST"], "decode_post")
async def decode_post(request, model_id: str | None = None):
    m = model_of(request, model_id)
    body_kind(request, allowed=(JSON_KIND,))
    obj = json_object(request)
    limit = request.app.ctx.cfg.limits.max_tokens
    skip = _flag(obj, "skip_special_tokens")
    ids = obj.get("ids")
    if not isinstance(ids, list):
        raise BadRequest('send {"ids": [...]} or {"ids": [[...], ...]}')
    if ids and all(isinstance(x, list) for x in ids):
        batch = [_ids(m, rq.json_ids(x, "ids"), limit) for x in ids]
        return json({"texts": m.tokenizer.decode_batch(batch, skip_special_tokens=skip)})
    return json({"text": m.tokenizer.decode(_ids(m, rq.json_ids(ids, "ids"), limit), skip_special_tokens=skip)})
