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
from larql_edge.format.layers import gaps
from larql_edge.model.head import Top
from larql_edge.net.direct import DirectPath
from larql_edge.net.failures import is_caller_mistake, is_success
from larql_edge.net.h1 import ConnectFailed, Reply, Superseded, TransportError, describe, error_text
from larql_edge.net.h1_sync import HttpClient
from larql_edge.net.hops import Hedger, Hop, HopLog, HopTimes, StallWaiter, server_seconds
from larql_edge.wire import VINDEX_HEADER
from larql_edge.wire import embed as embed_wire
from larql_edge.wire import ffn as ffn_wire
from larql_edge.wire.grid import Target, parse_targets

T = TypeVar("T")

BACKOFF_FIRST_S = 0.1
BACKOFF_MAX_S = 2.0


class Replicas:
    """POSTs and GETs to one of several equivalent URLs, failing over with backoff.

    The last URL that answered is tried first next time (sticky), so a healthy replica keeps its
    warm keep-alive connection and a dead one costs one failed attempt, not one per request.
    """

    def __init__(self, client: HttpClient, retries: int = 4, backoff: float = BACKOFF_FIRST_S, what: str = "server",
                 hops: HopLog | None = None, on_retry: Callable[[str], None] | None = None,
                 refused_first_is_fatal: bool = False):
        """``on_retry`` gets a line before each wait (a command line shows it: retries can take ~15 s).
        ``refused_first_is_fatal``: when no replica has ever answered and every one refuses the
        connection (nothing listens: the grid is not up), fail at once instead of retrying for
        seconds; once one has answered, a refusal is a restart and is retried as usual."""
        self.client = client
        self.retries = max(0, retries)
        self.backoff = backoff
        self.what = what
        self.hops = hops  # where answered hops are logged (timings), if anywhere
        self.on_success: Callable[[str, float], None] | None = None  # (url, seconds): the direct path learns speeds
        self.on_failure: Callable[[str], None] | None = None
        self.on_retry = on_retry
        self.refused_first_is_fatal = refused_first_is_fatal
        self.answered = False
        self._preferred: dict[tuple[str, ...], str] = {}
        self.failovers = 0

    def request(self, urls: Sequence[str], method: str, path: str, *, content: bytes | None = None,
                headers: dict[str, str] | None = None, about: str = "",
                decode: Callable[[Reply], T] = lambda r: r,  # type: ignore[assignment,return-value]
                hop: tuple[str, int | None] | None = None, waiter: Callable[[str], object] | None = None,
                started: float | None = None) -> T:
        """The first replica's decoded reply. ``decode`` raises `WireError` (or `RemoteError`) for a
        reply it cannot use: like a timeout, that is the replica's failure, and the next one is tried.
        ``waiter(url)``: the `Waiter` of a request to ``url`` (or None), e.g. a stall bound.
        ``started``: when the caller began the hop (``perf_counter``, before encoding its request): the
        logged hop counts from there, so a token's hops and its local compute add up to its wall time;
        the replica's own speed (``on_success``) is its answering attempt alone."""
        started = time.perf_counter() if started is None else started
        key = tuple(urls)
        first = self._preferred.get(key)
        order = list(urls)
        if first in order:
            order.remove(first)
            order.insert(0, first)
        reasons: list[str] = []
        refused: set[str] = set()
        delay = self.backoff
        for attempt in range(self.retries + 1):
            url = order[attempt % len(order)]
            t0 = time.perf_counter()
            try:
                r = self.client.request(method, url + path, content=content, headers=headers,
                                        waiter=None if waiter is None else waiter(url))  # type: ignore[arg-type]
            except TransportError as e:
                reasons.append(f"{url}: {describe(e)}")
                if isinstance(e, ConnectFailed):
                    refused.add(url)
                    if self.refused_first_is_fatal and not self.answered and refused >= set(order):
                        raise RemoteError(f"{self.what}{about}: nothing answers at {', '.join(order)} "
                                          "(connection refused or unreachable): is it running?") from None
            else:
                if is_success(r.status_code):
                    try:
                        value = decode(r)
                    except (WireError, RemoteError) as e:
                        reasons.append(f"{url}: unusable reply ({e})")
                    else:
                        self._preferred[key] = url
                        self.answered = True
                        wall = time.perf_counter() - t0
                        if self.hops is not None and hop is not None:
                            self.hops.add(Hop(hop[0], hop[1], url, time.perf_counter() - started, server_seconds(r)))
                        if self.on_success is not None:
                            self.on_success(url, wall)
                        return value
                elif is_caller_mistake(r.status_code):  # every replica would say the same: never retried
                    raise RemoteError(f"{self.what} {url}{path}{about}: HTTP {r.status_code}: {error_text(r)}")
                else:
                    reasons.append(f"{url}: HTTP {r.status_code} {error_text(r)}".rstrip())
            self.failovers += 1
            if self.on_failure is not None:
                self.on_failure(url)
            if attempt < self.retries:
                if self.on_retry is not None:
                    self.on_retry(f"{self.what}{about}: {reasons[-1]}; retrying in {delay:.1f}s "
                                  f"(attempt {attempt + 2} of {self.retries + 1})")
                time.sleep(delay)
                delay = min(delay * 2, BACKOFF_MAX_S)
        raise RemoteError(f"{self.what}{about}: no replica answered after {self.retries + 1} attempts: "
                          + "; ".join(_dedupe(reasons)))


def check_answer(values: np.ndarray, r: Reply, pins: dict, key: object, what: str) -> None:
    """One model, sound values: a reply with non-finite values (damaged weights) or from another build
    than the one ``key`` was first answered from (``X-Larql-Vindex``) is that replica's failure, so the
    next one is tried and two builds are never mixed in one generation."""
    if not np.isfinite(values).all():
        raise RemoteError(f"non-finite values in the {what} reply")
    ident = r.headers.get(VINDEX_HEADER)
    if ident:
        first = pins.setdefault(key, ident)
        if ident != first:
            raise RemoteError(f"{what} answered from vindex {ident}, earlier from {first}: "
                              "refusing to mix two builds of the model")


class RemoteEmbed:
    """Token ids -> scaled input rows, from POST /v1/embed (binary)."""

    def __init__(self, replicas: Replicas, urls: Sequence[str], hidden: int, path: DirectPath | None = None):
        self.replicas, self.urls, self.hidden = replicas, list(urls), hidden
        self.path = path  # with the direct data path: the embed servers the routers list come first
        self.identity: dict[object, str] = {}  # the vindex the embed tier first answered from

    def embed(self, ids: Sequence[int]) -> np.ndarray:
        t0 = time.perf_counter()

        def decode(r: Reply) -> np.ndarray:
            rows = embed_wire.decode_embed_response(r.content)
            if rows.shape != (len(ids), self.hidden):
                raise RemoteError(f"{list(rows.shape)} rows, expected [{len(ids)}, {self.hidden}]: another model?")
            check_answer(rows, r, self.identity, "embed", "embeddings")
            return rows

        urls = self.path.embed_urls(self.urls) if self.path is not None else self.urls
        return self.replicas.request(urls, "POST", "/v1/embed", content=embed_wire.encode_embed_request(ids),
                                     headers={"content-type": ffn_wire.CONTENT_TYPE, "accept": ffn_wire.CONTENT_TYPE},
                                     decode=decode, hop=("embed", None), started=t0)


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
                 notice: Callable[[str], None] | None = None, path: DirectPath | None = None):
        self.replicas, self.urls, self.hidden, self.vocab = replicas, list(urls), hidden, vocab
        self.path = path
        self.top_k = max(1, min(top_k, vocab))
        self.mode = "raw"
        self.many_rows = True  # False once the server refused the many-rows raw form
        self.notice = notice

    def _urls(self) -> list[str]:
        return self.path.embed_urls(self.urls) if self.path is not None else self.urls

    def _raw(self, row: np.ndarray) -> np.ndarray | None:
        t0 = time.perf_counter()

        def decode(r: Reply) -> np.ndarray | None:
            if r.headers.get("content-type", "").startswith("application/json"):
                return None  # a server that only answers top-k JSON (LARQL's)
            return embed_wire.decode_logits_response(r.content, self.vocab)

        return self.replicas.request(self._urls(), "POST", "/v1/logits", content=embed_wire.encode_logits_request(row),
                                     headers={"content-type": ffn_wire.CONTENT_TYPE, "accept": ffn_wire.CONTENT_TYPE},
                                     decode=decode, hop=("logits", None), started=t0)

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

        t0 = time.perf_counter()
        body = json_lib.dumps({"residual": row.tolist(), "top_k": self.top_k, "temperature": 1.0}).encode()
        return self.replicas.request(self._urls(), "POST", "/v1/logits", content=body,
                                     headers={"content-type": "application/json"}, decode=decode, hop=("logits", None),
                                     started=t0)

    def top_k_rows(self, h: np.ndarray, k: int, masks: Sequence[np.ndarray | None] | None = None,
                   extra: Sequence[np.ndarray | None] | None = None) -> list[Top]:
        """The top ``k`` (ids, log-probabilities at temperature 1) of every row, in ONE request: the
        embed server's many-rows form (binary ``?rows=N``, answered as top-k JSON per row), which its
        batcher multiplies as one lm_head product. larql-serve's head: one request per decode step.
        ``masks`` (per row None or a token bitmask) go with the rows (``&masked=``), applied before
        top-k; ``extra`` (per row None or token ids, at most `MAX_EXTRA_IDS`) are asked for whatever
        their rank (``&extra=``) and follow the top k (`Top`)."""
        rows = np.ascontiguousarray(np.atleast_2d(np.asarray(h, dtype=np.float32)))
        k = max(1, min(k, self.vocab))
        if rows.shape[0] > self.MAX_ROWS:  # the embed server's max_batch (default): more rows, more requests
            return [t for i in range(0, rows.shape[0], self.MAX_ROWS)
                    for t in self.top_k_rows(rows[i : i + self.MAX_ROWS], k,
                                             None if masks is None else masks[i : i + self.MAX_ROWS],
                                             None if extra is None else extra[i : i + self.MAX_ROWS])]
        t0 = time.perf_counter()
        masked = [i for i, m in enumerate(masks or ()) if m is not None]
        listed = [i for i, e in enumerate(extra or ()) if e is not None and len(e)]

        def entries(top: list) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
            ids = np.array([int(t["token_id"]) for t in top], dtype=np.int64)
            lps = np.array([float(t["logprob"]) for t in top], dtype=np.float64)
            logits = np.array([float(t["logit"]) for t in top], dtype=np.float64)
            if ids.size and (ids.min() < 0 or ids.max() >= self.vocab):
                raise ValueError("a token outside the vocabulary")
            return ids, lps, logits

        def decode(r: Reply) -> list[Top]:
            try:
                body = r.json()
                got = body["rows"]
                more = body["extra"] if listed else [[]] * len(got)
                if len(got) != rows.shape[0] or len(more) != rows.shape[0]:
                    raise ValueError(f"{len(got)} rows for {rows.shape[0]}")
                out = []
                for top, add in zip(got, more, strict=True):
                    ids, lps, logits = entries(top)
                    if ids.size == 0:
                        raise ValueError("a row names no token")
                    floor = float(lps[-1]) if ids.size == k and k < self.vocab else float("-inf")
                    xids, xlps, _ = entries(add)
                    keep = ~np.isin(xids, ids)
                    xids, xlps = xids[keep], xlps[keep]
                    order = np.lexsort((xids, -xlps))
                    # logit = lp + lse at temperature 1, the same for every token of the row
                    out.append(Top(np.concatenate([ids, xids[order]]), np.concatenate([lps, xlps[order]]),
                                   float(np.median(logits - lps)), floor))
            except (ValueError, KeyError, TypeError) as e:
                raise RemoteError(f"malformed many-rows logits ({e})") from None
            return out

        query = f"/v1/logits?rows={rows.shape[0]}&top_k={k}&temperature=1"
        if masked:
            assert masks is not None
            query += f"&masked={','.join(map(str, masked))}"
            bits = np.stack([np.asarray(masks[i]).reshape(-1) for i in masked])
            content = embed_wire.encode_logits_masked_rows_request(rows, bits)
        else:
            content = embed_wire.encode_logits_rows_request(rows)
        if listed:
            assert extra is not None
            query += f"&extra={','.join(map(str, listed))}"
            content += embed_wire.encode_extra_ids([extra[i] for i in listed])  # type: ignore[misc]
        return self.replicas.request(self._urls(), "POST", query, content=content,
                                     headers={"content-type": ffn_wire.CONTENT_TYPE}, decode=decode, hop=("logits", None),
                                     started=t0)

    def _raw_rows(self, rows: np.ndarray) -> np.ndarray | None:
        """Raw logits of several rows in ONE request (the many-rows form with the binary Accept):
        speculative decoding's verification pass when it samples."""
        if rows.shape[0] > self.MAX_ROWS:
            parts = [self._raw_rows(rows[i : i + self.MAX_ROWS]) for i in range(0, rows.shape[0], self.MAX_ROWS)]
            return None if any(p is None for p in parts) else np.concatenate(parts)  # type: ignore[arg-type]
        t0 = time.perf_counter()

        def decode(r: Reply) -> np.ndarray | None:
            if r.headers.get("content-type", "").startswith("application/json"):
                return None
            return embed_wire.decode_logits_response(r.content, self.vocab * rows.shape[0]).reshape(rows.shape[0], -1)

        return self.replicas.request(self._urls(), "POST", f"/v1/logits?rows={rows.shape[0]}",
                                     content=embed_wire.encode_logits_rows_request(rows),
                                     headers={"content-type": ffn_wire.CONTENT_TYPE, "accept": ffn_wire.CONTENT_TYPE},
                                     decode=decode, hop=("logits", None), started=t0)

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
    """One round trip per layer: POST /v1/walk-ffn (binary) to a target serving that layer.

    With ``path`` enabled (`DirectPath`), the request goes straight to a live shard serving the layer,
    learned from the routers, and through a router only when no shard can take it; with a `Hedger`
    and two live shards for the layer, a hop slower than the learned threshold is sent to the second
    one too and the first answer is taken.
    """

    def __init__(self, replicas: Replicas, targets: Sequence[Target], hidden: int, num_layers: int, f16: bool = False,
                 path: DirectPath | None = None, hedger: Hedger | None = None):
        self.replicas, self.hidden, self.f16 = replicas, hidden, f16
        self.path = path if path is not None else DirectPath(replicas.client, targets, num_layers, enabled=False)
        self.hedger = hedger
        self.times = hedger.times if hedger is not None else HopTimes()  # the stall bound, hedged or not
        self._rows = 1  # the rows of the hop in flight (its size: bounds are learned per size)
        replicas.on_success, replicas.on_failure = self._succeeded, self.path.failed
        self._urls = {layer: [t.url for t in targets if t.serves(layer)] for layer in range(num_layers)}
        self.headers = {"content-type": ffn_wire.CONTENT_TYPE,
                        "accept": ffn_wire.CONTENT_TYPE_F16 if f16 else ffn_wire.CONTENT_TYPE}
        self.seconds = 0.0  # time spent in FFN round trips (benchmarks read it)
        self.calls = 0
        self.identity: dict[object, str] = {}  # layer -> the vindex that first answered it (X-Larql-Vindex)

    def missing_layers(self) -> list[int]:
        return [layer for layer, urls in self._urls.items() if not urls]

    def ffn(self, layer: int, x: np.ndarray) -> np.ndarray:
        if not self._urls.get(layer):
            raise RemoteError(f"no --ffn target serves layer {layer}")
        t0 = time.perf_counter()
        x2 = np.atleast_2d(x)

        def decode(r: Reply) -> np.ndarray:
            f16 = r.headers.get("content-type", "").startswith(ffn_wire.CONTENT_TYPE_F16)
            got, out, _ = ffn_wire.decode_response(r.content, self.hidden, f16=f16)
            if got != layer or out.shape != x2.shape:
                raise RemoteError(f"the reply is for layer {got} with shape {list(out.shape)}")
            check_answer(out, r, self.identity, layer, f"layer {layer}")
            return out

        body = ffn_wire.encode_request(layer, x)
        self.path.hops = self.replicas.hops
        rows = x2.shape[0]
        direct, fallback = self.path.urls(layer)
        out = None
        if self.hedger is not None and len(direct) >= 2:
            out = self._hedged(layer, rows, body, direct, decode)
            if out is None:  # failed or stalled: those are cooling down now, the rest is tried
                direct, fallback = self.path.urls(layer)
        if out is None:
            self._rows = rows
            out = self.replicas.request(direct + [u for u in fallback if u not in direct], "POST", "/v1/walk-ffn",
                                        content=body, headers=self.headers, about=f" (layer {layer})", decode=decode,
                                        hop=("ffn", layer), waiter=self._stall_waiter, started=t0)
        self.seconds += time.perf_counter() - t0
        self.calls += 1
        return out

    def _stall_waiter(self, url: str) -> StallWaiter | None:
        """A request straight to a shard gives up at the stall bound (a frozen replica), and the next
        replica or a router takes it; a router has its own failover, and waits as long as it must."""
        bound = self.times.stall_bound(self._rows) if self.path.is_direct(url) else None
        return None if bound is None else StallWaiter(bound, lambda s: self.path.late(url, s))

    def _succeeded(self, url: str, seconds: float) -> None:
        self.path.succeeded(url, seconds)
        if self.path.is_direct(url):  # what a shard takes (routers add their hop): the learned bounds
            self.times.observe(self._rows, seconds)

    def _hedged(self, layer: int, rows: int, body: bytes, urls: list[str],
                decode: Callable[[Reply], np.ndarray]) -> np.ndarray | None:
        hedger = self.hedger
        assert hedger is not None

        def send(url: str, waiter) -> tuple[np.ndarray, float, float | None]:
            t0 = time.perf_counter()
            try:
                r = hedger.client().request("POST", url + "/v1/walk-ffn", content=body, headers=self.headers,
                                            waiter=waiter)
                if not is_success(r.status_code):
                    raise RemoteError(f"HTTP {r.status_code}")
                value = decode(r)
            except Superseded:
                raise  # the other request answered: no failure of this replica
            except (TransportError, WireError, RemoteError):
                self.path.failed(url)
                raise
            wall = time.perf_counter() - t0
            self.path.succeeded(url, wall)
            return value, wall, server_seconds(r)

        t0 = time.perf_counter()
        got = hedger.run(rows, urls[0], urls[1], send, on_late=self.path.late)
        if got is None:
            return None  # every request sent failed, or the primary stalled: the usual failover takes over
        url, (value, _, server), hedged = got
        if self.replicas.hops is not None:  # the hop as this thread waited for it
            self.replicas.hops.add(Hop("ffn", layer, url, time.perf_counter() - t0, server, hedged))
        return value


@dataclass(frozen=True)
class RemoteSettings:
    """Where the remote tiers are and how to talk to them: what `build_tiers` needs, parsed once
    from the command line of `larql` or larql-serve (their flags carry the same names)."""

    ffn: str | None = None  # a router or shard URL, replicas "URL1,URL2", or "0-8=URL,9-17=URL"
    embed: str | None = None  # default: the --ffn router(s), which proxy the embed server
    ffn_f16: bool = False
    timeout: float = 30.0
    retries: int = 10
    logits_top_k: int = 64
    direct: bool = True  # learn the shards from the routers and send each layer straight to one
    hedge: bool = True  # a hop slower than the learned threshold goes to a second live replica too
    hedge_budget: float = 20.0  # hedges per second, at most


@dataclass
class RemoteTiers:
    embedder: "RemoteEmbed"
    ffn: "RemoteFfn | None"  # None: no --ffn (the client then runs the FFN itself)
    head: "RemoteHead"


def build_tiers(s: RemoteSettings, hidden: int, num_layers: int, vocab: int,
                notice: Callable[[str], None] | None = None, hops: HopLog | None = None,
                on_retry: Callable[[str], None] | None = None, refused_first_is_fatal: bool = False) -> RemoteTiers:
    """The remote providers of the forward pass, with one keep-alive client for all three tiers;
    every way the targets fail to cover the model is a `RemoteError` saying which flag to fix.
    ``on_retry``, ``refused_first_is_fatal``: as `Replicas` (a command line sets both)."""
    check_settings(s)
    client = make_client(s.timeout)
    ffn_targets = parse_targets(s.ffn, "--ffn") if s.ffn else []
    embed_urls = [t.url for t in parse_targets(s.embed, "--embed")] if s.embed else [t.url for t in ffn_targets if t.layers is None]
    if not embed_urls:
        raise RemoteError("--embed URL is needed when --ffn names shards by layer range (a router URL serves both)")
    ffn = None
    path = DirectPath(client, ffn_targets, num_layers, enabled=s.direct)
    path.hops = hops
    if ffn_targets:
        hedger = Hedger(lambda: make_client(s.timeout), s.hedge_budget) if s.hedge and s.direct else None
        ffn = RemoteFfn(Replicas(client, s.retries, what="FFN", hops=hops, on_retry=on_retry,
                                 refused_first_is_fatal=refused_first_is_fatal), ffn_targets, hidden, num_layers,
                        f16=s.ffn_f16, path=path, hedger=hedger)
        missing = ffn.missing_layers()
        if missing:
            holes = ", ".join(str(g) for g in gaps(set(range(num_layers)) - set(missing), num_layers))
            raise RemoteError(f"no --ffn target serves layers {holes} (the model has {num_layers} layers)")
    replicas = Replicas(client, s.retries, what="embed server", hops=hops, on_retry=on_retry,
                        refused_first_is_fatal=refused_first_is_fatal)
    # --embed given: those servers, as given. Else the routers' embed servers first (direct path).
    epath = path if path.enabled and not s.embed else None
    if epath is not None:
        replicas.on_success, replicas.on_failure = epath.succeeded, epath.failed
    return RemoteTiers(RemoteEmbed(replicas, embed_urls, hidden, path=epath), ffn,
                       RemoteHead(replicas, embed_urls, hidden, vocab, top_k=s.logits_top_k, notice=notice, path=epath))


def add_path_flags(f) -> None:
    """The data path's flags, the same for `larql` and larql-serve (``f``: a `larql_edge.config.Flags`)."""
    f.toggle("--direct", default=True, help="learn the shards from the --ffn router(s) and send each layer's "
             "FFN request straight to one (the router stays the fallback); --no-direct sends everything via the router")
    f.toggle("--hedge", default=True, help="with --direct: a hop slower than 1.5x the p95 of recent hops goes to a "
             "second live replica too, and the first answer is taken (hedged or not, a request stalled past 8x the "
             "slowest recent hop, >= 0.5 s, is given up and failed over)")
    f.add("--hedge-budget", type=float, default=RemoteSettings.hedge_budget, help="at most this many hedges a second")


def check_settings(s: RemoteSettings) -> None:
    import math

    if not (math.isfinite(s.hedge_budget) and s.hedge_budget >= 0):
        raise RemoteError("--hedge-budget must be a number >= 0 (hedges per second)")
    if not (math.isfinite(s.timeout) and s.timeout > 0) or s.retries < 0:
        raise RemoteError("--timeout must be a positive number of seconds and --retries >= 0")


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
