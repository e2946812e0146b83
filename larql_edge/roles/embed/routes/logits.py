"""``POST /v1/logits``: final norm, lm_head, softcap and temperature on one pre-final-norm residual.

The answer is the top k as JSON (token id, text, probability, log-probability, logit), or with
``Accept: application/x-larql-ffn`` the raw ``f32[vocab]`` logits (divided by the temperature).
Temperature 0 means greedy: the list is ordered as always (argmax first) and the probabilities are
those of temperature 1, so they stay informative; raw logits are then returned unscaled.
Requests are queued to the model's micro-batcher, which multiplies concurrent residuals together.

The many-rows form (larql-serve's one logits request per decode step for every sequence): a JSON
body ``{"residuals": [[...], ...], "top_k": k, "temperature": t}``, or a binary body of
``rows x f32[hidden]`` with ``?rows=N``, is answered ``{"rows": [[top-k of row 0], ...], ...}`` (or,
with the binary Accept, ``f32[rows * vocab]``): all rows in ONE lm_head product. At most
``max_batch`` rows (413 above). Without ``residuals``/``rows`` the single-residual forms are
unchanged, byte for byte.

Structured output: ``?rows=N&masked=i,j,..`` (binary body) appends a token bitmask for each listed row
(`larql_edge.wire.embed`); a masked row's disallowed tokens get -inf before the top k, so its top k,
probabilities and log-probabilities are those of the allowed tokens (a mask allowing fewer than k
tokens answers fewer). The mask costs the serve side nothing per vocabulary entry: 32 KB per
constrained row on the wire, one unpack and one select here.

Candidates beyond the top k: ``?rows=N&extra=i,j,..`` (binary body) ends the body with a list of token
ids for each listed row (`larql_edge.wire.embed`); the top-k JSON answer then carries ``"extra"``, one
list per row of ``{"token_id", "logprob", "logit"}`` for those ids (a masked row leaves out the ids its
mask disallows). larql-serve asks it for the tokens a ``logit_bias`` or a penalty may raise above the
top k: a few numbers per id, instead of the row's 262,144 logits (1 MB).
"""

from __future__ import annotations

import math
import time
from functools import partial

import numpy as np
from sanic import Blueprint
from sanic.response import HTTPResponse, json

from larql_edge.errors import BadRequest, PayloadTooLarge
from larql_edge.model.kernels import map_rows
from larql_edge.roles.embed import requests as rq
from larql_edge.roles.embed.head import log_normaliser, top_k_ids
from larql_edge.roles.embed.routes._common import both, model_of
from larql_edge.service import BINARY_KIND, body_kind, json_object
from larql_edge.wire import BINARY
from larql_edge.wire import embed as wire
from larql_edge.wire.numbers import json_int

bp = Blueprint("logits")


def _scaled(row: np.ndarray, temperature: float) -> np.ndarray:
    if temperature in (0.0, 1.0):
        return row
    # In float64: a temperature beyond float32 range (1e300) must not overflow to Inf first.
    return np.divide(row, temperature, dtype=np.float64).astype(np.float32)


def _top_k(model, k: int, temperature: float, row: np.ndarray) -> list[dict]:
    # Runs in the compute thread, right after the batch's matrix product.
    scaled = _scaled(row, temperature)
    lse = log_normaliser(scaled)
    out = []
    for i in top_k_ids(row, k).tolist():
        if row[i] == -np.inf:  # masked out (structured output): the allowed tokens all came first
            break
        lp = float(scaled[i]) - lse
        out.append(
            {"token_id": i, "token": model.token_text(i), "prob": math.exp(lp), "logprob": lp, "logit": float(row[i])}
        )
    return out


def _json_number(params: dict, name: str, integer: bool):
    """A JSON body's option: a JSON number (an integer for top_k); never a string or null."""
    value = params[name]
    number = json_int(value) if integer else value if type(value) in (int, float) else None
    if number is None:
        raise BadRequest(f"{name} must be {'an integer' if integer else 'a number'}")
    return number


def _raw(temperature: float, row: np.ndarray) -> bytes:
    return wire.encode_logits_response(_scaled(row, temperature))


def _apply_masks(block: np.ndarray, masked: tuple[int, ...], allowed: np.ndarray | None) -> np.ndarray:
    if not masked or allowed is None:
        return block
    # In place: the block is this request's own rows of the batch's fresh product.
    out = block if block.flags.writeable else np.array(block, dtype=np.float32)
    for r, ok in zip(masked, allowed, strict=True):
        np.copyto(out[r], np.float32(-np.inf), where=~ok)
    return out


def _extra(temperature: float, row: np.ndarray, ids: np.ndarray) -> list[dict]:
    scaled = _scaled(row, temperature)
    lse = log_normaliser(scaled)
    return [{"token_id": i, "logprob": float(scaled[i]) - lse, "logit": float(row[i])}
            for i in ids.tolist() if row[i] != -np.inf]  # masked out: it cannot be chosen


def _top_k_rows(model, k: int, temperature: float, masked: tuple[int, ...], allowed: np.ndarray | None,
                extra: dict[int, np.ndarray], block: np.ndarray) -> tuple[list[list[dict]], list[list[dict]] | None]:
    block = _apply_masks(block, masked, allowed)

    def post(r: int, row: np.ndarray) -> tuple[list[dict], list[dict]]:
        return _top_k(model, k, temperature, row), _extra(temperature, row, extra[r]) if r in extra else []

    tops, extras = zip(*map_rows(post, block), strict=True)
    return list(tops), list(extras) if extra else None


def _raw_rows(temperature: float, masked: tuple[int, ...], allowed: np.ndarray | None, block: np.ndarray) -> bytes:
    return wire.encode_logits_response(_scaled(_apply_masks(block, masked, allowed), temperature))


def _listed_rows(value: str | None, n_rows: int | None, name: str) -> tuple[int, ...]:
    """``?masked=0,3`` / ``?extra=0,3``: the rows (ascending, each once, below ``rows``) whose token
    bitmasks / token-id lists follow the residuals."""
    if value is None:
        return ()
    if n_rows is None:
        raise BadRequest(f"{name}= needs the binary many-rows form (?rows=N)")
    parts = value.split(",")
    if len(parts) > n_rows:
        raise BadRequest(f"{name}: {len(parts)} rows named, the request has {n_rows}")
    out = [rq.int_param(p, name, 0, 0, n_rows - 1) for p in parts]
    if any(b <= a for a, b in zip(out, out[1:], strict=False)):
        raise BadRequest(f"{name}: row indices must be ascending, each once")
    return tuple(out)


def _check_rows(n: int, limit: int) -> None:
    if n < 1:
        raise BadRequest("residuals: give at least one row")
    if n > limit:
        raise PayloadTooLarge(f"{n} residual rows; the limit is {limit} per request (max_batch)")


@both(bp, "/logits", ["POST"], "logits")
async def logits(request, model_id: str | None = None):
    t0 = time.perf_counter()
    m = model_of(request, model_id)
    max_k = min(m.vocab_size, request.app.ctx.cfg.limits.max_top_k)
    # The query's options (what binary requests use) are checked on every request; a JSON body's win.
    query = request.get_args(keep_blank_values=True)  # ?top_k= is a wrong top_k, not a missing one
    k = rq.int_param(query.get("top_k"), "top_k", 5, 1, max_k)
    temperature = rq.temperature_param(query.get("temperature"))
    max_rows = request.app.ctx.cfg.limits.max_batch
    many: np.ndarray | None = None
    # Checked on every request, as top_k: a wrong ?rows= is a 400 whatever the body.
    n_rows = rq.int_param(query.get("rows"), "rows", 0, 1, max_rows) if query.get("rows") is not None else None
    masked = _listed_rows(query.get("masked"), n_rows, "masked")
    extra_rows = _listed_rows(query.get("extra"), n_rows, "extra")
    allowed: np.ndarray | None = None
    extra: dict[int, np.ndarray] = {}
    if body_kind(request) == BINARY_KIND:
        if masked or extra_rows:
            assert n_rows is not None
            many, bits, lists = wire.decode_logits_rows_sections(request.body, n_rows, m.hidden_size, len(masked),
                                                                 len(extra_rows), m.vocab_size)
            many = rq.finite(many)
            extra = dict(zip(extra_rows, lists, strict=True))
            if masked:
                allowed = wire.allowed_tokens(bits, m.vocab_size)
                empty = np.nonzero(~allowed.any(axis=1))[0]
                if empty.size:
                    raise BadRequest(f"masked: the token mask of row {masked[int(empty[0])]} allows no token")
        elif n_rows is not None:
            many = rq.finite(wire.decode_logits_rows_request(request.body, n_rows, m.hidden_size))
        else:
            x = wire.decode_logits_request(request.body, m.hidden_size)
            x = rq.finite(x)
    else:
        params = json_object(request)
        if masked or extra_rows:
            raise BadRequest(f"{'masked' if masked else 'extra'}= takes a binary body (rows x f32[hidden], then the "
                             f"token {'bitmasks' if masked else 'id lists'})")
        if "residuals" in params:
            rows = params["residuals"]
            if not isinstance(rows, list):
                raise BadRequest(f"residuals must be a list of rows of {m.hidden_size} numbers")
            _check_rows(len(rows), max_rows)
            many = np.stack([rq.residual(r, m.hidden_size) for r in rows])
        elif "residual" not in params:
            raise BadRequest(f'missing "residual" (a list of {m.hidden_size} numbers)')
        else:
            x = rq.residual(params["residual"], m.hidden_size)
        if "top_k" in params:
            k = rq.int_param(_json_number(params, "top_k", integer=True), "top_k", 5, 1, max_k)
        if "temperature" in params:
            temperature = rq.temperature_param(_json_number(params, "temperature", integer=False))
    if many is not None:
        if rq.wants_binary(request, default_binary=False):
            if extra_rows:  # raw logits already hold every id: asking for some is a mistake, not a no-op
                raise BadRequest("extra= is for the top-k JSON answer; raw logits already hold every token")
            body = await m.batcher.submit_rows(many, partial(_raw_rows, temperature, masked, allowed))
            return HTTPResponse(body, content_type=BINARY)
        rows_top, extras = await m.batcher.submit_rows(many, partial(_top_k_rows, m, k, temperature, masked, allowed,
                                                                     extra))
        out = {"rows": rows_top}
        if extras is not None:
            out["extra"] = extras
        return json({**out, "model": m.id, "temperature": temperature, "greedy": temperature == 0.0,
                     "latency_ms": round((time.perf_counter() - t0) * 1e3, 3)})
    if rq.wants_binary(request, default_binary=False):
        body = await m.batcher.submit(x, partial(_raw, temperature))
        return HTTPResponse(body, content_type=BINARY)
    top = await m.batcher.submit(x, partial(_top_k, m, k, temperature))
    return json(
        {
            "top_k": top,
            "model": m.id,
            "temperature": temperature,
            "greedy": temperature == 0.0,
            "latency_ms": round((time.perf_counter() - t0) * 1e3, 3),
        }
    )
