"""The shipped nginx and varnish configs (deploy/) in front of a real embed server, with real nginx and varnishd.

Both proxies come from Debian's packages (`scripts/setup test` installs them) and run on loopback
ports from tests/_edge.py, which templates only the listen port and the upstream address into the
shipped files. Whether a request reached the origin is read from the origin's own
``larql_embed_requests_total`` counter; no test asserts a timing.
"""

from __future__ import annotations

import difflib
import os
import socket
import threading
from contextlib import contextmanager

import httpx
import numpy as np
import pytest

from larql_edge.testing.edge import (
    KINDS,
    NGINX_CONF,
    VARNISH_VCL,
    find_program,
    nginx_check,
    render_nginx,
    render_vcl,
    running_edge,
    varnish_check,
)
from larql_edge.testing.servers import running_server, start_server
from larql_edge.tools.grid.supervisor import free_port

BINARY = "application/x-larql-ffn"
CACHE_CONTROL = "public, max-age=31536000, immutable"
ROW_ROUTE = "/v1/embed/<token:str>"
SHA_ROUTE = "/v1/models/<sha:str>/embed/<token:str>"
MODEL_ROUTE = "/v1/<model_id:str>/embed/<token:str>"


def _need(kind: str) -> None:
    prog = "nginx" if kind == "nginx" else "varnishd"
    if find_program(prog) is None:
        if os.environ.get("CI"):
            pytest.fail(f"{prog} is not installed (scripts/setup test installs it)")
        pytest.skip(f"{prog} is not installed (apt-get install {'nginx' if kind == 'nginx' else 'varnish'})")


def origin_requests(origin_url: str, route: str, method: str = "GET") -> int:
    """How many ``method route`` requests the origin has answered, any status (from its /metrics)."""
    text = httpx.get(origin_url + "/metrics", timeout=10).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith("larql_embed_requests_total{") and f'route="{route}"' in line and f'method="{method}"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return int(total)


def row_requests(origin_url: str) -> int:
    return sum(origin_requests(origin_url, r) for r in (ROW_ROUTE, SHA_ROUTE, MODEL_ROUTE))


def sha_of(origin_url: str) -> str:
    return httpx.get(origin_url + "/v1/models", timeout=10).json()["models"][0]["embeddings_sha256"]


def direct_row(origin_url: str, tid: int, sha: str | None = None) -> bytes:
    path = f"/v1/models/{sha}/embed/{tid}" if sha else f"/v1/embed/{tid}"
    r = httpx.get(origin_url + path, headers={"Accept": BINARY}, timeout=10)
    assert r.status_code == 200, r.text
    return r.content


def assert_json_error(r: httpx.Response, statuses: tuple[int, ...]) -> None:
    assert r.status_code in statuses, (r.status_code, r.text)
    assert r.headers["content-type"].startswith("application/json"), r.headers
    body = r.json()
    assert set(body) == {"error"} and isinstance(body["error"], str) and body["error"], body


# -- the shipped files as they are ---------------------------------------------------------------------


@pytest.mark.multiprocess
def test_nginx_t_accepts_shipped_config_unmodified():
    _need("nginx")
    r = nginx_check(NGINX_CONF)
    assert r.returncode == 0, r.stderr
    assert "test is successful" in r.stderr


@pytest.mark.multiprocess
def test_varnishd_C_accepts_shipped_vcl_unmodified():
    _need("varnish")
    r = varnish_check(VARNISH_VCL)
    assert r.returncode == 0, r.stderr[-3000:]


def _changed_lines(a: str, b: str) -> tuple[list[str], list[str]]:
    diff = list(difflib.unified_diff(a.splitlines(), b.splitlines(), lineterm="", n=0))
    removed = [d[1:].strip() for d in diff if d.startswith("-") and not d.startswith("---")]
    added = [d[1:].strip() for d in diff if d.startswith("+") and not d.startswith("+++")]
    return removed, added


def test_harness_templates_only_ports_and_upstreams():
    shipped = NGINX_CONF.read_text()
    removed, added = _changed_lines(shipped, render_nginx(shipped, 4321, ["127.0.0.1:1111", "http://127.0.0.1:2222"]))
    assert sorted(removed) == ["listen 8080;", "server 127.0.0.1:8082 max_fails=2 fail_timeout=5s;"]
    assert sorted(added) == ["listen 127.0.0.1:4321;", "server 127.0.0.1:1111 max_fails=2 fail_timeout=5s;",
                             "server 127.0.0.1:2222 max_fails=2 fail_timeout=5s;"]

    vcl = VARNISH_VCL.read_text()
    removed, added = _changed_lines(vcl, render_vcl(vcl, ["127.0.0.1:1111"]))
    assert removed == ['.port = "8082";'] and added == ['.port = "1111";']
    two = render_vcl(vcl, ["127.0.0.1:1111", "127.0.0.1:2222"])
    assert "backend embed2 {" in two and "larql.add_backend(embed2);" in two and '.port = "2222";' in two


# -- one origin, both proxies in front of it -------------------------------------------------------------


@pytest.fixture(scope="module")
def origin(tiny_models):
    with running_server("larql-embed", [str(tiny_models["gemma3"]), "--blas-threads", "1"]) as srv:
        yield srv


@pytest.fixture(scope="module", params=KINDS)
def edge(request, origin):
    _need(request.param)
    with running_edge(request.param, [origin.url]) as e:
        yield e


def _get(edge, path: str, **headers) -> httpx.Response:
    return httpx.get(edge.url + path, headers=headers, timeout=30)


@pytest.mark.slow
def test_first_get_misses_then_hits_with_the_same_bytes(edge, origin):
    sha = sha_of(origin.url)
    mid = httpx.get(origin.url + "/v1/models").json()["models"][0]["id"]
    for path, want in (("/v1/embed/1", direct_row(origin.url, 1)),
                       (f"/v1/models/{sha}/embed/1", direct_row(origin.url, 1, sha)),
                       (f"/v1/{mid}/embed/1", direct_row(origin.url, 1))):  # fmt: skip
        before = row_requests(origin.url)
        first, second = _get(edge, path), _get(edge, path)
        assert (first.status_code, second.status_code) == (200, 200), (path, first.text, second.text)
        assert first.headers["x-cache"] == "MISS", path
        assert second.headers["x-cache"] == "HIT", path
        assert first.content == second.content == want
        assert len(want) == 32 * 4  # f32[hidden]
        assert second.headers["content-type"] == BINARY
        assert second.headers["etag"] == first.headers["etag"]
        assert second.headers["cache-control"] == CACHE_CONTROL
        assert row_requests(origin.url) - before == 1, f"{path}: the origin saw more than the miss"


@pytest.mark.slow
def test_binary_and_json_each_get_their_own_representation(edge, origin):
    tid = 2
    want = np.frombuffer(direct_row(origin.url, tid), dtype="<f4")
    b1 = _get(edge, f"/v1/embed/{tid}")
    j1 = _get(edge, f"/v1/embed/{tid}", Accept="application/json")
    assert (b1.headers["x-cache"], j1.headers["x-cache"]) == ("MISS", "MISS")  # two entries, not one
    b2 = _get(edge, f"/v1/embed/{tid}")
    j2 = _get(edge, f"/v1/embed/{tid}", Accept="application/json")
    assert (b2.headers["x-cache"], j2.headers["x-cache"]) == ("HIT", "HIT")
    for b in (b1, b2):
        assert b.headers["content-type"] == BINARY and b.headers["etag"].endswith('-bin"')
        assert np.array_equal(np.frombuffer(b.content, dtype="<f4"), want)
    for j in (j1, j2):
        assert j.headers["content-type"].startswith("application/json") and j.headers["etag"].endswith('-json"')
        body = j.json()
        assert body["token_id"] == tid and np.allclose(body["embedding"], want, rtol=0, atol=0)
    assert b2.headers["vary"] == j2.headers["vary"] == "Accept"

    # Every spelling of Accept lands in one of the two classes, each served from its entry.
    for accept, rep in (("*/*", "bin"), (BINARY, "bin"), ("application/octet-stream", "bin"),
                        ("application/json, */*;q=0.1", "json"), ("text/html,application/json", "json"),
                        ("APPLICATION/JSON", "json"), ("application/json;q=0, */*", "bin"),
                        (f"{BINARY}, application/json", "bin")):  # fmt: skip
        r = _get(edge, f"/v1/embed/{tid}", Accept=accept)
        assert r.status_code == 200 and r.headers["x-cache"] == "HIT", (accept, r.headers)
        got = "json" if r.headers["content-type"].startswith("application/json") else "bin"
        assert got == rep, accept
        assert r.content == (j1.content if rep == "json" else b1.content), accept

    # The .json spelling is JSON whatever the Accept, and a different cache entry of its own.
    s1 = _get(edge, f"/v1/embed/{tid}.json", Accept=BINARY)
    s2 = _get(edge, f"/v1/embed/{tid}.json")
    assert (s1.headers["x-cache"], s2.headers["x-cache"]) == ("MISS", "HIT")
    assert s1.content == s2.content == j1.content


@pytest.mark.slow
def test_if_none_match_gets_304_from_the_cache(edge, origin):
    tid = 3
    for accept in (BINARY, "application/json"):
        warm = _get(edge, f"/v1/embed/{tid}", Accept=accept)
        assert warm.status_code == 200
        etag = warm.headers["etag"]
        before = origin_requests(origin.url, ROW_ROUTE)
        r = _get(edge, f"/v1/embed/{tid}", Accept=accept, **{"If-None-Match": etag})
        assert r.status_code == 304, (accept, r.status_code, r.text)
        assert r.content == b""
        assert r.headers["x-cache"] == "HIT"
        assert r.headers["etag"] == etag
        assert r.headers["cache-control"] == CACHE_CONTROL
        assert r.headers["vary"] == "Accept"
        # A tag that doesn't match: the full row, still from the cache.
        r = _get(edge, f"/v1/embed/{tid}", Accept=accept, **{"If-None-Match": '"not-this-one"'})
        assert r.status_code == 200 and r.headers["x-cache"] == "HIT" and r.content == warm.content
        assert origin_requests(origin.url, ROW_ROUTE) == before, "a conditional request reached the origin"


@pytest.mark.slow
def test_post_embed_and_logits_reach_the_origin_every_time(edge, origin):
    ids = np.array([1, 2, 3], dtype="<u4")
    binary_req = np.uint32(ids.size).tobytes() + ids.tobytes()
    residual = np.linspace(-1, 1, 32, dtype="<f4").tobytes()
    before_e = origin_requests(origin.url, "/v1/embed", "POST")
    before_l = origin_requests(origin.url, "/v1/logits", "POST")
    seen = set()
    for _ in range(3):
        r = httpx.post(edge.url + "/v1/embed", content=binary_req, headers={"Content-Type": BINARY}, timeout=30)
        assert r.status_code == 200 and r.headers.get("x-cache") != "HIT"
        seen.add(r.content)
        r = httpx.post(edge.url + "/v1/embed", json={"token_ids": [1, 2, 3]}, timeout=30)
        assert r.status_code == 200 and r.headers.get("x-cache") != "HIT" and len(r.json()["residual"]) == 3
        r = httpx.post(edge.url + "/v1/logits", content=residual,
                       headers={"Content-Type": BINARY, "Accept": "application/json"}, timeout=30)
        assert r.status_code == 200 and r.headers.get("x-cache") != "HIT", r.text
        assert r.json()["top_k"]
        r = httpx.post(edge.url + "/v1/logits", content=residual, headers={"Content-Type": BINARY, "Accept": BINARY},
                       timeout=30)
        assert r.status_code == 200 and r.headers["content-type"] == BINARY and len(r.content) == 45 * 4  # f32[vocab]
    assert len(seen) == 1
    assert origin_requests(origin.url, "/v1/embed", "POST") - before_e == 6
    assert origin_requests(origin.url, "/v1/logits", "POST") - before_l == 6


@pytest.mark.slow
def test_post_bodies_up_to_the_published_limit_pass(edge, origin):
    limit = _get(edge, "/v1/stats").json()["limits"]["max_body_bytes"]
    head = b'{"token_ids": [4, 5]}'
    body = head + b" " * (limit - len(head))
    assert len(body) == limit
    r = httpx.post(edge.url + "/v1/embed", content=body, headers={"Content-Type": "application/json"}, timeout=60)
    assert r.status_code == 200, r.text[:300]
    assert len(r.json()["residual"]) == 2
    # One byte more: refused with 413 in the server's envelope (by the origin or by the proxy).
    r = httpx.post(edge.url + "/v1/embed", content=body + b" ", headers={"Content-Type": "application/json"}, timeout=60)
    assert_json_error(r, (413,))


@pytest.mark.slow
def test_metrics_health_and_stats_are_never_cached(edge, origin):
    for path, route in (("/metrics", "/metrics"), ("/v1/health", "/v1/health"), ("/v1/ready", "/v1/ready"),
                        ("/v1/stats", "/v1/stats"), ("/v1/token/decode?ids=1,2", "/v1/token/decode")):
        before = origin_requests(origin.url, route)
        for _ in range(2):
            r = _get(edge, path)
            assert r.status_code == 200, (path, r.text)
            assert "x-cache" not in r.headers, path
        # /metrics: the counter read above is itself a /metrics request at the origin. /v1/ready:
        # Varnish's health probe adds its own polls.
        extra = 1 if route == "/metrics" else 0
        seen = origin_requests(origin.url, route) - before
        assert seen >= 2 + extra if route == "/v1/ready" else seen == 2 + extra, path


@pytest.mark.slow
def test_concurrent_misses_for_one_key_are_collapsed(edge, origin):
    tid, n = 6, 8
    before = origin_requests(origin.url, ROW_ROUTE)
    barrier = threading.Barrier(n)
    results: list[httpx.Response] = []
    lock = threading.Lock()

    def one():
        with httpx.Client(timeout=30) as c:
            barrier.wait()
            r = c.get(edge.url + f"/v1/embed/{tid}")
        with lock:
            results.append(r)

    threads = [threading.Thread(target=one) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(results) == n and all(r.status_code == 200 for r in results)
    assert len({r.content for r in results}) == 1
    assert origin_requests(origin.url, ROW_ROUTE) - before == 1, "concurrent misses were not collapsed"
    assert sum(r.headers["x-cache"] == "MISS" for r in results) == 1


class CountingRelay:
    """A TCP relay in front of the origin that records the first request line of every connection."""

    def __init__(self, target_port: int):
        self.target = ("127.0.0.1", target_port)
        self.lsock = socket.create_server(("127.0.0.1", 0))
        self.port = self.lsock.getsockname()[1]
        self.first_lines: list[str] = []
        self._socks: list[socket.socket] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                c, _ = self.lsock.accept()
            except OSError:
                return
            u = socket.create_connection(self.target)
            slot = []
            with self._lock:
                self._socks += [c, u]
                self.first_lines.append(slot)
            threading.Thread(target=self._pump, args=(c, u, slot), daemon=True).start()
            threading.Thread(target=self._pump, args=(u, c, None), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket, slot: list | None) -> None:
        try:
            while data := src.recv(65536):
                if slot is not None and not slot:
                    slot.append(data.split(b"\r\n", 1)[0].decode("latin-1"))
                dst.sendall(data)
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    def opened(self) -> list[str]:
        with self._lock:
            return [s[0] if s else "" for s in self.first_lines]

    def close(self) -> None:
        self.lsock.close()
        with self._lock:
            for s in self._socks:
                s.close()


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_upstream_connections_are_kept_alive(kind, origin):
    # Sequential misses, then passes (POST), through a fresh proxy whose upstream is a relay that
    # counts connections. With keep-alive the proxy reuses its pooled connections; without it every
    # request would open one. Varnish's health probe opens its own (first line GET /v1/ready): not counted.
    _need(kind)
    relay = CountingRelay(origin.port)
    try:
        with running_edge(kind, [f"127.0.0.1:{relay.port}"]) as edge:
            for phase in ("miss", "pass"):
                before = len(relay.opened())
                for tid in range(20, 30):
                    if phase == "miss":
                        r = _get(edge, f"/v1/embed/{tid}.json")
                        assert r.headers["x-cache"] == "MISS"
                    else:
                        r = httpx.post(edge.url + "/v1/embed", json={"token_ids": [tid]}, timeout=30)
                    assert r.status_code == 200
                new = [line for line in relay.opened()[before:] if not line.startswith("GET /v1/ready")]
                assert len(new) <= 2, f"{phase}: 10 sequential requests opened {len(new)} upstream connections: {new}"
    finally:
        relay.close()


@pytest.mark.slow
def test_errors_on_row_urls_are_not_cached(edge, origin):
    before = origin_requests(origin.url, ROW_ROUTE)
    for _ in range(2):
        assert_json_error(_get(edge, "/v1/embed/4500"), (404,))  # out of the vocabulary
    assert origin_requests(origin.url, ROW_ROUTE) - before == 2
    before = origin_requests(origin.url, SHA_ROUTE)
    for _ in range(2):
        assert_json_error(_get(edge, f"/v1/models/{'0' * 64}/embed/1"), (404,))  # a sha not served
    assert origin_requests(origin.url, SHA_ROUTE) - before == 2


# -- origin down, then back with another model on the same address -------------------------------------


@contextmanager
def _origin_on(vindex, port: int):
    srv = start_server("larql-embed", [str(vindex), "--blas-threads", "1"], port=port)
    try:
        srv.wait_ready(120)
        yield srv
    finally:
        srv.stop()
        print(f"--- larql-embed ({vindex.name}) log tail ---\n{srv.log()[-3000:]}")


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_origin_down_then_swapped_for_another_model(kind, tiny_models):
    _need(kind)
    port = free_port()
    with running_edge(kind, [f"127.0.0.1:{port}"], wait_origin=False) as edge:
        with _origin_on(tiny_models["gemma3"], port) as a:
            edge.wait_origin()
            sha_a = sha_of(a.url)
            rows_a = {t: direct_row(a.url, t) for t in (1, 2, 3)}
            json_a = httpx.get(a.url + "/v1/embed/1", headers={"Accept": "application/json"}).content
            for t in (1, 2):
                assert _get(edge, f"/v1/embed/{t}").content == rows_a[t]
                assert _get(edge, f"/v1/models/{sha_a}/embed/{t}").content == rows_a[t]
            assert _get(edge, "/v1/embed/1", Accept="application/json").content == json_a

        # Origin down: cached rows are still served, in both representations and every spelling.
        for t in (1, 2):
            for path in (f"/v1/embed/{t}", f"/v1/models/{sha_a}/embed/{t}"):
                r = _get(edge, path)
                assert r.status_code == 200 and r.content == rows_a[t], (path, r.status_code, r.text)
                assert r.headers["x-cache"] == "HIT"
        r = _get(edge, "/v1/embed/1", Accept="application/json")
        assert r.status_code == 200 and r.content == json_a
        etag = r.headers["etag"]
        r = _get(edge, "/v1/embed/1", Accept="application/json", **{"If-None-Match": etag})
        assert r.status_code == 304 and r.headers["etag"] == etag
        # Not cached: a JSON error, never a hang or an HTML page.
        assert_json_error(_get(edge, "/v1/embed/3"), (502, 503))
        assert_json_error(_get(edge, f"/v1/models/{sha_a}/embed/3"), (502, 503))
        assert_json_error(httpx.post(edge.url + "/v1/embed", json={"token_ids": [1]}, timeout=30), (502, 503))

        # Back on the same address, serving another model (other embeddings, other sha).
        with _origin_on(tiny_models["llama"], port) as b:
            edge.wait_origin()
            sha_b = sha_of(b.url)
            assert sha_b != sha_a
            rows_b = {t: direct_row(b.url, t) for t in (1, 2, 3)}
            assert all(rows_b[t] != rows_a[t] and len(rows_b[t]) == len(rows_a[t]) for t in rows_b)
            for t in (1, 2, 3):
                first, again = _get(edge, f"/v1/models/{sha_b}/embed/{t}"), _get(edge, f"/v1/models/{sha_b}/embed/{t}")
                assert first.status_code == again.status_code == 200
                assert first.content == again.content == rows_b[t], "the new sha's URL served other rows"
                assert (first.headers["x-cache"], again.headers["x-cache"]) == ("MISS", "HIT")
                # The old sha's URL: its own (old, correct for that sha) rows from the cache, or the
                # origin's 404 ("no served model has that sha") -- never the new model's rows.
                old = _get(edge, f"/v1/models/{sha_a}/embed/{t}")
                if old.status_code == 200:
                    assert old.content == rows_a[t] and old.headers["x-cache"] == "HIT"
                else:
                    assert_json_error(old, (404,))
                assert old.content != rows_b[t]
            assert _get(edge, f"/v1/models/{sha_a}/embed/3").status_code == 404  # never cached: the origin says no


# -- two models behind one server: the model header is part of the unprefixed URL's key -----------------


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_model_header_keeps_models_apart(kind, tiny_models):
    _need(kind)
    args = [f"g={tiny_models['gemma3']}", f"l={tiny_models['llama']}", "--blas-threads", "1"]
    with running_server("larql-embed", args) as origin, running_edge(kind, [origin.url]) as edge:
        rows = {m: httpx.get(f"{origin.url}/v1/{m}/embed/5", headers={"Accept": BINARY}).content for m in ("g", "l")}
        assert rows["g"] != rows["l"]
        for header, want in (({}, "g"), ({"X-Model-Id": "l"}, "l"), ({"X-Model-Id": "g"}, "g")):
            first, again = _get(edge, "/v1/embed/5", **header), _get(edge, "/v1/embed/5", **header)
            assert first.content == again.content == rows[want], header
            assert again.headers["x-cache"] == "HIT" and again.headers["vary"] == "Accept, X-Model-Id"
        # The path spellings name the model themselves: the header is ignored (and not in their key).
        r = _get(edge, "/v1/l/embed/5", **{"X-Model-Id": "g"})
        assert r.content == rows["l"]
        r = _get(edge, "/v1/l/embed/5")
        assert r.content == rows["l"] and r.headers["x-cache"] == "HIT"
        # HEAD is answered from the same entry as GET.
        r = httpx.head(edge.url + "/v1/l/embed/5", timeout=30)
        assert r.status_code == 200 and r.headers["x-cache"] == "HIT" and r.content == b""
        assert int(r.headers["content-length"]) == len(rows["l"])
