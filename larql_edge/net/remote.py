"""Remote providers of the forward pass: embeddings and logits from an embed server (or a router
that proxies one), the FFN of each layer from shards (or a router).

They plug into `larql_edge.model.forward.Transformer` in place of the local providers, so the client runs
the very same attention, norm and residual code as the single-process forward: exactness follows.

Failures (`larql_edge.net.failures`, the same rules as the router's): a request that cannot
reach a replica, times out, gets a malformed reply or any status but a success or the caller's
mistake (400, 413) is retried on the next replica serving the same thing, with exponential backoff
capped at 2 s, a bounded number of times (the default, 10, spans ~15 s: long enough for a router to
restart and its members to rejoin); then it is a `RemoteError` naming the layer and what was tried.
The caller's mistake is never retried. A layer that no target serves is an error at once: never zeros.
"""

from __future__ import annotations

import json as json_lib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

from larql_edge.errors import RemoteError, WireError
from larql_edge.format.layers import LayerRange
from larql_edge.net.failures import is_caller_mistake, is_success
from larql_edge.net.h1 import Reply, TransportError, describe, error_text
from larql_edge.net.h1_sync import HttpClient
from larql_edge.wire import embed as embed_wire
from larql_edge.wire import ffn as ffn_wire

T = TypeVar("T")

BACKOFF_FIRST_S = 0.1
BACKOFF_MAX_S = 2.0


@dataclass(frozen=True)
class Target:
    url: str
    layers: LayerRange | None = None  # None: every layer (a router, or a shard serving all)

    def serves(self, layer: int) -> bool:
        return self.layers is None or layer in self.layers


def parse_targets(text: str) -> list[Target]:
    """``"URL"``, ``"URL1,URL2"`` (replicas) or ``"0-8=URL,9-17=URL"`` (shards by layer range)."""
    out = []
    for part in filter(None, (p.strip() for p in (text or "").split(","))):
        rng, sep, url = part.partition("=")
        if not sep:
            rng, url = "", part
        url = url.strip().rstrip("/")
        if not url.startswith(("http://", "https://")):
            raise RemoteError(f"{part!r}: expected an http(s) URL (optionally prefixed with a layer range A-B=)")
        try:
            out.append(Target(url, LayerRange.parse(rng) if rng else None))
        except ValueError as e:
            raise RemoteError(str(e)) from None
    return out


class Replicas:
    """POSTs and GETs to one of several equivalent URLs, failing over with backoff.

    The last URL that answered is tried first next time (sticky), so a healthy replica keeps its
    warm keep-alive connection and a dead one costs one failed attempt, not one per request.
    """

    def __init__(self, client: HttpClient, retries: int = 4, backoff: float = BACKOFF_FIRST_S, what: str = "server"):
        self.client = client
        self.retries = max(0, retries)
        self.backoff = backoff
        self.what = what
        self._preferred: dict[tuple[str, ...], str] = {}
        self.failovers = 0

    def request(self, urls: Sequence[str], method: str, path: str, *, content: bytes | None = None,
                headers: dict[str, str] | None = None, about: str = "",
                decode: Callable[[Reply], T] = lambda r: r) -> T:  # type: ignore[assignment,return-value]
        """The first replica's decoded reply. ``decode`` raises `WireError` (or `RemoteError`) for a
        reply it cannot use: like a timeout, that is the replica's failure, and the next one is tried."""
        key = tuple(urls)
        first = self._preferred.get(key)
        order = list(urls)
        if first in order:
            order.remove(first)
            order.insert(0, first)
        reasons: list[str] = []
        delay = self.backoff
        for attempt in range(self.retries + 1):
            url = order[attempt % len(order)]
            try:
                r = self.client.request(method, url + path, content=content, headers=headers)
            except TransportError as e:
                reasons.append(f"{url}: {describe(e)}")
            else:
                if is_success(r.status_code):
                    try:
                        value = decode(r)
                    except (WireError, RemoteError) as e:
                        reasons.append(f"{url}: unusable reply ({e})")
                    else:
                        self._preferred[key] = url
                        return value
                elif is_caller_mistake(r.status_code):  # every replica would say the same: never retried
                    raise RemoteError(f"{self.what} {url}{path}{about}: HTTP {r.status_code}: {error_text(r)}")
                else:
                    reasons.append(f"{url}: HTTP {r.status_code} {error_text(r)}".rstrip())
            self.failovers += 1
            if attempt < self.retries:
                time.sleep(delay)
                delay = min(delay * 2, BACKOFF_MAX_S)
        raise RemoteError(f"{self.what}{about}: no replica answered after {self.retries + 1} attempts: "
                          + "; ".join(_dedupe(reasons)))


class RemoteEmbed:
    """Token ids -> scaled input rows, from POST /v1/embed (binary)."""

    def __init__(self, replicas: Replicas, urls: Sequence[str], hidden: int):
        self.replicas, self.urls, self.hidden = replicas, list(urls), hidden

    def embed(self, ids: Sequence[int]) -> np.ndarray:
        def decode(r: Reply) -> np.ndarray:
            rows = embed_wire.decode_embed_response(r.content)
            if rows.shape != (len(ids), self.hidden):
                raise RemoteError(f"{list(rows.shape)} rows, expected [{len(ids)}, {self.hidden}]: another model?")
            return rows

        return self.replicas.request(self.urls, "POST", "/v1/embed", content=embed_wire.encode_embed_request(ids),
                                     headers={"content-type": ffn_wire.CONTENT_TYPE, "accept": ffn_wire.CONTENT_TYPE},
                                     decode=decode)


class RemoteHead:
    """Pre-final-norm residual rows -> logits, from POST /v1/logits.

    larql-edge's embed server answers raw ``f32[vocab]`` logits to ``Accept: application/x-larql-ffn``.
    LARQL's own answers top-k JSON only; when a reply comes back as JSON the head switches, once, to
    asking for the top ``top_k`` as JSON and builds logits from them: each returned id gets its
    log-probability, every other id -inf. Greedy decoding is then exact; sampling draws among those k
    (the mass outside them is not offered). ``mode`` says which is in use ("raw" or "top-k JSON").
    """

    MAX_ROWS = 64  # rows per many-rows logits request: the embed server's default --max-batch

    def __init__(self, replicas: Replicas, urls: Sequence[str], hidden: int, vocab: int, top_k: int = 64,
                 notice: Callable[[str], None] | None = None):
        self.replicas, self.urls, self.hidden, self.vocab = replicas, list(urls), hidden, vocab
        self.top_k = max(1, min(top_k, vocab))
        self.mode = "raw"
        self.many_rows = True  # False once the server refused the many-rows raw form
        self.notice = notice

    def _raw(self, row: np.ndarray) -> np.ndarray | None:
        def decode(r: Reply) -> np.ndarray | None:
            if r.headers.get("content-type", "").startswith("application/json"):
                return None  # a server that only answers top-k JSON (LARQL's)
            return embed_wire.decode_logits_response(r.content, self.vocab)

        return self.replicas.request(self.urls, "POST", "/v1/logits", content=embed_wire.encode_logits_request(row),
                                     headers={"content-type": ffn_wire.CONTENT_TYPE, "accept": ffn_wire.CONTENT_TYPE},
                                     decode=decode)

    def _top_k(self, row: np.ndarray) -> np.ndarray:
        def decode(r: Reply) -> np.ndarray:
            try:
                top = r.json()["top_k"]
                out = np.full(self.vocab, -np.inf, dtype=np.float32)
                for t in top:
                    i, p = int(t["token_id"]), float(t["prob"])
                    if not (0 <= i < self.vocab and 0.0 <= p <= 1.0):
                        raise ValueError(f"token {i} with probability {p}")
                    out[i] = np.log(p) if p > 0 else -np.inf
            except (ValueError, KeyError, TypeError) as e:
                raise RemoteError(f"malformed top-k logits ({e})") from None
            if not np.isfinite(out).any():
                raise RemoteError("top-k logits name no token")
            return out

        body = json_lib.dumps({"residual": row.tolist(), "top_k": self.top_k, "temperature": 1.0}).encode()
        return self.replicas.request(self.urls, "POST", "/v1/logits", content=body,
                                     headers={"content-type": "application/json"}, decode=decode)

    def top_k_rows(self, h: np.ndarray, k: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """The top ``k`` (ids, log-probabilities at temperature 1) of every row, in ONE request: the
        embed server's many-rows form (binary ``?rows=N``, answered as top-k JSON per row), which its
        batcher multiplies as one lm_head product. larql-serve's head: one request per decode step."""
        rows = np.ascontiguousarray(np.atleast_2d(np.asarray(h, dtype=np.float32)))
        k = max(1, min(k, self.vocab))
        if rows.shape[0] > self.MAX_ROWS:  # the embed server's max_batch (default): more rows, more requests
            return [t for i in range(0, rows.shape[0], self.MAX_ROWS) for t in self.top_k_rows(rows[i : i + self.MAX_ROWS], k)]

        def decode(r: Reply) -> list[tuple[np.ndarray, np.ndarray]]:
            try:
                got = r.json()["rows"]
                if len(got) != rows.shape[0]:
                    raise ValueError(f"{len(got)} rows for {rows.shape[0]}")
                out = []
                for top in got:
                    ids = np.array([int(t["token_id"]) for t in top], dtype=np.int64)
                    lps = np.array([float(t["logprob"]) for t in top], dtype=np.float64)
                    if ids.size == 0 or ids.min() < 0 or ids.max() >= self.vocab:
                        raise ValueError("a row names no token, or one outside the vocabulary")
                    out.append((ids, lps))
            except (ValueError, KeyError, TypeError) as e:
                raise RemoteError(f"malformed many-rows logits ({e})") from None
            return out

        return self.replicas.request(self.urls, "POST", f"/v1/logits?rows={rows.shape[0]}&top_k={k}&temperature=1",
                                     content=embed_wire.encode_logits_rows_request(rows),
                                     headers={"content-type": ffn_wire.CONTENT_TYPE}, decode=decode)

    def _raw_rows(self, rows: np.ndarray) -> np.ndarray | None:
        """Raw logits of several rows in ONE request (the many-rows form with the binary Accept):
        speculative decoding's verification pass when it samples."""
        if rows.shape[0] > self.MAX_ROWS:
            parts = [self._raw_rows(rows[i : i + self.MAX_ROWS]) for i in range(0, rows.shape[0], self.MAX_ROWS)]
            return None if any(p is None for p in parts) else np.concatenate(parts)  # type: ignore[arg-type]

        def decode(r: Reply) -> np.ndarray | None:
            if r.headers.get("content-type", "").startswith("application/json"):
                return None
            return embed_wire.decode_logits_response(r.content, self.vocab * rows.shape[0]).reshape(rows.shape[0], -1)

        return self.replicas.request(self.urls, "POST", f"/v1/logits?rows={rows.shape[0]}",
                                     content=embed_wire.encode_logits_rows_request(rows),
                                     headers={"content-type": ffn_wire.CONTENT_TYPE, "accept": ffn_wire.CONTENT_TYPE},
                                     decode=decode)

    def logits(self, h: np.ndarray) -> np.ndarray:
        rows = np.atleast_2d(np.asarray(h, dtype=np.float32))
        if rows.shape[0] > 1 and self.mode == "raw" and self.many_rows:
            try:
                many = self._raw_rows(np.ascontiguousarray(rows))
            except RemoteError:  # a server without the many-rows form: one request per row from now on
                many = None
            if many is not None:
                return many
            self.many_rows = False
        out = np.empty((rows.shape[0], self.vocab), dtype=np.float32)
        for i, row in enumerate(rows):  # the endpoint takes one position; decode asks for one
            got = self._raw(row) if self.mode == "raw" else None
            if got is None:
                if self.mode == "raw":
                    self.mode = "top-k JSON"
                    if self.notice is not None:
                        self.notice(f"the embed server answers top-k JSON logits only (LARQL): using its top {self.top_k}")
                got = self._top_k(row)
            out[i] = got
        return out


class RemoteFfn:
    """One round trip per layer: POST /v1/walk-ffn (binary) to a target serving that layer."""

    def __init__(self, replicas: Replicas, targets: Sequence[Target], hidden: int, num_layers: int, f16: bool = False):
        self.replicas, self.hidden, self.f16 = replicas, hidden, f16
        self._urls = {layer: [t.url for t in targets if t.serves(layer)] for layer in range(num_layers)}
        self.headers = {"content-type": ffn_wire.CONTENT_TYPE,
                        "accept": ffn_wire.CONTENT_TYPE_F16 if f16 else ffn_wire.CONTENT_TYPE}
        self.seconds = 0.0  # time spent in FFN round trips (benchmarks read it)
        self.calls = 0

    def missing_layers(self) -> list[int]:
        return [layer for layer, urls in self._urls.items() if not urls]

    def ffn(self, layer: int, x: np.ndarray) -> np.ndarray:
        urls = self._urls.get(layer)
        if not urls:
            raise RemoteError(f"no --ffn target serves layer {layer}")
        t0 = time.perf_counter()

        def decode(r: Reply) -> np.ndarray:
            f16 = r.headers.get("content-type", "").startswith(ffn_wire.CONTENT_TYPE_F16)
            got, out, _ = ffn_wire.decode_response(r.content, self.hidden, f16=f16)
            if got != layer or out.shape != np.shape(np.atleast_2d(x)):
                raise RemoteError(f"the reply is for layer {got} with shape {list(out.shape)}")
            return out

        out = self.replicas.request(urls, "POST", "/v1/walk-ffn", content=ffn_wire.encode_request(layer, x),
                                    headers=self.headers, about=f" (layer {layer})", decode=decode)
        self.seconds += time.perf_counter() - t0
        self.calls += 1
        return out


def make_client(timeout: float) -> HttpClient:
    # One keep-alive connection per server for all three tiers; decode makes ~20 requests a token.
    return HttpClient(timeout=timeout, connect_timeout=3.0)


def _dedupe(items: list[str]) -> list[str]:
    seen, out = set(), []
    for i in items:
        if i not in seen:
            seen.add(i)
            out.append(i)
    return out
