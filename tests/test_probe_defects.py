"""The adversarial probe's defects (issue #19), fast tier: each test reproduces one, in-process on
loopback (tiny models, real HTTP), and failed on the code before its fix. Timing bounds are ratios to
a baseline measured in the same test (the machine is shared and loaded), never wall-clock numbers."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from larql_edge.format.vindex import Vindex
from larql_edge.net.remote import RemoteSettings
from larql_edge.roles.serve.app import Limits, create_app, remote_engine, served_model
from larql_edge.testing.servers import ServerThread
from tests import _inproc


@pytest.fixture(scope="module")
def grid(tiny_models):
    with _inproc.grid(tiny_models["gemma3"], ["0-0", "1-1"]) as g:
        yield g


@pytest.fixture(scope="module")
def tokenizer(tiny_models):
    return Vindex.open(tiny_models["gemma3"]).load_tokenizer()


def _serve(vx_path, router_url: str, limits: Limits) -> ServerThread:
    vx = Vindex.open(vx_path)
    # generous: on a loaded host a step that times out ends every sequence of the batch (freeing slots)
    engine = remote_engine(vx, RemoteSettings(ffn=router_url, timeout=300, retries=3))
    served = served_model(vx, vx.load_tokenizer(), limits.context, None)
    served.eos_ids = ()  # sequences run to max_tokens: they hold their slots as long as a test needs
    return ServerThread(create_app(engine, served, limits))


class HealthPoller:
    """Polls ``/v1/health`` on its own connection while a block runs; ``worst`` is the slowest answer."""

    def __init__(self, url: str):
        self.url, self.times, self._stop = url, [], threading.Event()
        self._t = threading.Thread(target=self._run)

    def _run(self) -> None:
        with httpx.Client(timeout=120) as c:
            while not self._stop.is_set():
                t0 = time.perf_counter()
                assert c.get(self.url + "/v1/health").status_code == 200
                self.times.append(time.perf_counter() - t0)
                time.sleep(0.005)

    def __enter__(self) -> HealthPoller:
        self._t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._t.join()

    @property
    def worst(self) -> float:
        return max(self.times)

    @property
    def p90(self) -> float:
        t = sorted(self.times)
        return t[int(0.9 * (len(t) - 1))]


def _encode_seconds(tokenizer, text: str) -> float:
    t0 = time.perf_counter()
    tokenizer.encode(text)
    return time.perf_counter() - t0


# -- High: a huge prompt blocked larql-serve's health for seconds --------------------------------------


def test_tokenizing_releases_the_gil(tokenizer):
    """``Tokenizer.encode`` held the GIL for the whole call: another thread (the event loop) stalled for
    as long as the text took. `tokens.encode` gives the same ids and lets the other thread run."""
    from larql_edge.model import tokens

    text = "the capital of france is paris. " * 20_000
    assert tokens.encode(tokenizer, text) == tokenizer.encode(text).ids
    gaps: list[float] = []
    stop = threading.Event()

    def tick() -> None:
        last = time.perf_counter()
        while not stop.is_set():
            time.sleep(0.002)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    t = threading.Thread(target=tick)
    t.start()
    t0 = time.perf_counter()
    tokens.encode(tokenizer, text)
    took = time.perf_counter() - t0
    stop.set()
    t.join()
    assert max(gaps) < took / 3, (max(gaps), took)


def test_a_prompt_longer_than_the_context_can_hold_is_refused_untokenized(tiny_models, grid, tokenizer):
    """A 3.9 MB prompt blocked /v1/health for 8-10 s; eight of them, about a minute. A prompt with more
    characters than the context's tokens can stand for is now a 400 before any tokenizing, and
    health stays as fast as without it. Baseline: tokenizing that prompt here, in this run."""
    with _serve(tiny_models["gemma3"], grid["router"].url, Limits(context=64)) as s:
        # 1.3 MB, far past what a 64-token context can stand for (the report's 3.8 MB showed the same;
        # tokenizing it for the baseline cost this tier ~3 s more)
        prompt = "the capital of france is paris. " * 40_000
        baseline = _encode_seconds(tokenizer, prompt)
        with HealthPoller(s.url) as health, ThreadPoolExecutor(4) as ex:
            t0 = time.perf_counter()
            replies = list(ex.map(lambda _: httpx.post(s.url + "/v1/completions", timeout=300,
                                                       json={"prompt": prompt, "max_tokens": 1}), range(4)))
            took = time.perf_counter() - t0
        for r in replies:
            assert r.status_code == 400, r.text
            assert r.json()["error"]["code"] == "context_length_exceeded"
            assert r.json()["error"]["param"] == "prompt"
        assert took < baseline, (took, baseline)  # four refused in less time than one was tokenized
        assert health.worst < baseline / 4, (health.worst, baseline)


def test_the_embed_server_tokenizes_off_its_event_loop(tiny_models, tokenizer):
    """Eight clients encoding 100,000 characters each held the embed server's loop (health p99 1.5 s):
    the tokenizer ran in the handler, on the loop. The real tokenizer is wrapped to record the thread
    each call runs on: never the event loop's now (timing on a loaded host is benchmarks' business:
    benchmarks/largest_request.py, embed health p99 2,123 ms -> 160 ms with 8 clients)."""
    text = "the capital of france is paris. " * 3_125  # 100,000 characters: the published limit

    class Recording:
        def __init__(self, inner):
            self.inner, self.threads = inner, set()

        def __getattr__(self, name):
            attr = getattr(self.inner, name)
            if name.startswith("encode"):
                def call(*a, **kw):
                    self.threads.add(threading.current_thread().name)
                    return attr(*a, **kw)
                return call
            return attr

    with _inproc.embed({"gemma": tiny_models["gemma3"]}) as srv:
        _inproc.wait_ready(srv)
        model = srv.app.ctx.registry.models["gemma"]
        model._tokenizer = rec = Recording(model.tokenizer)
        loop_thread = httpx.post(srv.url + "/v1/token/encode", json={"text": "x"}, timeout=60) and srv._thread.name
        with ThreadPoolExecutor(8) as ex:
            replies = list(ex.map(lambda _: httpx.post(srv.url + "/v1/token/encode", json={"text": text}, timeout=120),
                                  range(8)))
        replies.append(httpx.get(srv.url + "/v1/token/encode", params={"text": "paris"}, timeout=60))
        assert all(r.status_code == 200 for r in replies)
        assert replies[0].json()["token_ids"] == tokenizer.encode(text, add_special_tokens=False).ids
        assert rec.threads and loop_thread not in rec.threads, (rec.threads, loop_thread)


# -- Medium: a lone surrogate was a 500 (and, through the router, an embed-server failure) ------------

LONE = b'"\\ud800"'  # JSON's escape for a lone surrogate: valid JSON, not Unicode text


def _raw_request(url: str, head: bytes, body: bytes = b"") -> tuple[int, bytes]:
    """One request written byte for byte (headers no client library would send); the status and body."""
    import socket
    from urllib.parse import urlsplit

    u = urlsplit(url)
    with socket.create_connection((u.hostname, u.port), timeout=30) as s:
        s.sendall(head + b"content-length: " + str(len(body)).encode() + b"\r\nconnection: close\r\n\r\n" + body)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    status = int(data.split(b" ", 2)[1])
    return status, data.split(b"\r\n\r\n", 1)[1]


@pytest.mark.parametrize("where", ["serve", "embed", "router"])
def test_a_lone_surrogate_is_a_400_and_never_a_members_failure(tiny_models, grid, where):
    if where == "serve":
        server = _serve(tiny_models["gemma3"], grid["router"].url, Limits(context=64))
        path, body = "/v1/completions", b'{"max_tokens": 1, "prompt": ' + LONE + b"}"
    else:
        server = None
        path, body = "/v1/token/encode", b'{"text": ' + LONE + b"}"
    with server or _NoServer(grid["router"].url if where == "router" else grid["embed"].url) as s:
        for _ in range(20):
            status, reply = _raw_request(s.url, b"POST " + path.encode() + b" HTTP/1.1\r\nhost: x\r\n"
                                         b"content-type: application/json\r\n", body)
            assert status == 400, reply
            assert b"surrogate" in reply
        # The server (and through the router, the embed member) still serves
        ok = httpx.post(s.url + "/v1/token/encode", json={"text": "paris"}, timeout=30) if where != "serve" else \
            httpx.post(s.url + "/v1/completions", json={"prompt": "paris", "max_tokens": 1}, timeout=30)
        assert ok.status_code == 200, ok.text
    grid_state = httpx.get(grid["router"].url + "/v1/grid").json()["members"]
    assert all(m["failures"] == 0 for m in grid_state), grid_state


class _NoServer:
    def __init__(self, url: str):
        self.url = url

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass


@pytest.mark.parametrize("header", [b"x-model-id", b"accept"])
def test_a_non_utf8_forwarded_header_is_a_400_at_the_router(grid, header):
    status, reply = _raw_request(grid["router"].url, b"POST /v1/token/encode HTTP/1.1\r\nhost: x\r\n"
                                 b"content-type: application/json\r\n" + header + b": \xff\xfe\r\n", b'{"text": "paris"}')
    assert status == 400, reply


@pytest.mark.parametrize("encoding", ["utf-16", "utf-32"])
def test_json_bodies_must_be_utf8(grid, encoding):
    """RFC 8259 §8.1: JSON exchanged between systems is UTF-8; json.loads guessed UTF-16 and UTF-32."""
    for url in (grid["embed"].url, grid["router"].url):
        r = httpx.post(url + "/v1/token/encode", content='{"text": "paris"}'.encode(encoding),
                       headers={"content-type": "application/json"}, timeout=30)
        assert r.status_code == 400 and "UTF-8" in r.text, r.text


# -- Medium: --max-queue was ignored while any active slot was free -----------------------------------


def test_max_queue_holds_while_a_slot_is_free(tiny_models, grid):
    """--max-active 2 --max-queue 2 with one slot busy admitted a burst of 30 (29 queued, no 429): the
    queue was only checked once every slot was taken. Now one more takes the free slot, two queue, and
    the rest are 429."""
    with _serve(tiny_models["gemma3"], grid["router"].url, Limits(context=1 << 16, max_active=2, max_queue=2)) as s:
        started, release = threading.Event(), threading.Event()

        def hold():
            with httpx.stream("POST", s.url + "/v1/completions", timeout=120,
                              json={"prompt": "a", "max_tokens": 60_000, "stream": True}) as r:
                for _ in r.iter_bytes():
                    started.set()
                    if release.wait(0.01):
                        return

        holder = threading.Thread(target=hold)
        holder.start()
        try:
            assert started.wait(30)
            burst = [{"prompt": "b", "max_tokens": 60_000, "stream": True} for _ in range(30)]
            # one client for the burst: a client each spent ~1 s of CPU on 30 TLS contexts never used
            with ThreadPoolExecutor(30) as ex, httpx.Client(limits=httpx.Limits(max_connections=40)) as c:
                def one(body):
                    with c.stream("POST", s.url + "/v1/completions", json=body, timeout=120) as r:
                        if r.status_code == 200:
                            release.wait(60)  # keep the stream (and the sequence) until the end
                        return r.status_code

                futures = [ex.submit(one, b) for b in burst]
                deadline = time.monotonic() + 60
                while sum(f.done() for f in futures) < 27 and time.monotonic() < deadline:
                    time.sleep(0.05)
                stats = httpx.get(s.url + "/v1/stats").json()
                release.set()
                codes = sorted(f.result() for f in futures)
        finally:
            release.set()
            holder.join(60)
        assert codes == [200] * 3 + [429] * 27, codes
        assert stats["active"] + stats["queued"] <= 4, stats


# -- Medium: every distinct HTTP method name added metrics series ---------------------------------------


@pytest.mark.parametrize("role", ["embed", "router", "shard"])
def test_unknown_method_names_add_no_metrics_series(grid, role):
    """20,000 requests with distinct method names grew /metrics to 41,000 lines (3.1 s a scrape)."""
    url = grid["shards"]["0-0"][0].url if role == "shard" else grid[role].url

    def lines() -> int:
        return len(httpx.get(url + "/metrics", timeout=30).text.splitlines())

    for i in range(3):  # every series this traffic makes, once
        _raw_request(url, f"M{i} /v1/health HTTP/1.1\r\nhost: x\r\n".encode())
    lines()  # the scrape's own series
    before = lines()
    for i in range(3, 60):
        status, _ = _raw_request(url, f"M{i} /v1/health HTTP/1.1\r\nhost: x\r\n".encode())
        assert 400 <= status < 500
    assert lines() == before


# -- Low ---------------------------------------------------------------------------------------------


def test_seeds_x_and_minus_x_sample_differently(tiny_models, grid):
    with _serve(tiny_models["gemma3"], grid["router"].url, Limits(context=64)) as s:
        def text(seed: int) -> str:
            r = httpx.post(s.url + "/v1/completions", timeout=60,
                           json={"prompt": "the", "max_tokens": 12, "temperature": 2.0, "seed": seed})
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["text"]

        assert text(7) == text(7)
        assert text(-7) == text(-7)
        assert [text(x) for x in (7, 11, 12345)] != [text(-x) for x in (7, 11, 12345)]


# -- Medium: pull wrote .git/config from a malicious listing; verify hashed files outside the vindex -----


@pytest.mark.parametrize("evil", [".git/config", "sub/.GIT/hooks/pre-commit", ".git./config", ".hg/hgrc"])
def test_pull_refuses_version_control_paths(hub, tiny_models, tmp_path, evil):
    """A malicious Hub endpoint listed .git/config; `git status` in the pulled folder then ran its
    core.fsmonitor command."""
    import shutil

    from larql_edge.errors import HubError
    from larql_edge.tools.slicer.publish import publish
    from larql_edge.tools.slicer.pull import pull

    src = tmp_path / "src.vindex"
    shutil.copytree(tiny_models["gemma3"], src)
    publish(src, "test-user/tiny-vindex", endpoint=hub.url, token=hub.token, log=lambda m: None, slices=[],
            collections=[])
    hub.inject_tree_entry("test-user/tiny-vindex", evil, content=b"[core]\n\tfsmonitor = touch /tmp/pwned\n")
    out = tmp_path / "out"
    with pytest.raises(HubError, match="version-control"):
        pull("test-user/tiny-vindex", output=out, endpoint=hub.url, token=hub.token, log=lambda m: None)
    assert not out.exists()


def _index_variant(tiny_models, tmp_path, **changes):
    import json
    import shutil

    dst = tmp_path / "v.vindex"
    shutil.copytree(tiny_models["gemma3"], dst)
    index = json.loads((dst / "index.json").read_text())
    index.update(changes)
    (dst / "index.json").write_text(json.dumps(index))
    return dst


def test_verify_never_reads_outside_the_vindex(tiny_models, tmp_path):
    from tests._cli import slicer

    (tmp_path / "secret").write_bytes(b"outside")
    import json

    sums = json.loads((tiny_models["gemma3"] / "index.json").read_text())["checksums"]
    v = _index_variant(tiny_models, tmp_path, checksums=sums | {"../secret": "0" * 64})
    r = slicer("verify", str(v))
    assert r.returncode != 0
    assert "not a file of the vindex folder" in r.stderr + r.stdout
    assert "secret: corrupt" not in r.stdout  # it was never hashed


@pytest.mark.parametrize("field,value", [("num_layers", 10**9), ("hidden_size", 10**12), ("vocab_size", 2**40),
                                         ("intermediate_size", 10**9)])
def test_an_index_claiming_impossible_shapes_is_refused(tiny_models, tmp_path, field, value):
    """verify and pull accepted 10**9 layers, hidden 10**12, vocab 2**40; larql-ffn then never became
    ready and grew without bound."""
    from larql_edge.errors import VindexError
    from tests._cli import slicer

    v = _index_variant(tiny_models, tmp_path, **{field: value})
    with pytest.raises(VindexError, match="beyond this format's limit"):
        Vindex.open(v)
    r = slicer("verify", str(v))
    assert r.returncode != 0 and "beyond this format's limit" in r.stderr + r.stdout
    with pytest.raises(VindexError):
        _inproc.shard(v, None)


def test_verify_reports_shapes_that_contradict_the_files(tiny_models, tmp_path):
    import json

    vocab = json.loads((tiny_models["gemma3"] / "index.json").read_text())["vocab_size"]
    v = _index_variant(tiny_models, tmp_path, vocab_size=vocab + 1)
    problems = Vindex.open(v).verify()
    assert any("embeddings.bin: contradicts index.json" in p for p in problems), problems


def test_a_deeply_nested_index_is_a_clear_error(tiny_models, tmp_path):
    from larql_edge.errors import VindexError
    from tests._cli import slicer

    v = _index_variant(tiny_models, tmp_path)
    (v / "index.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(VindexError, match="unreadable index.json"):
        Vindex.open(v)
    r = slicer("verify", str(v))
    assert r.returncode != 0 and "Traceback" not in r.stderr


def test_an_embed_server_whose_model_cannot_load_is_not_alive(tiny_models, tmp_path):
    """On a permanent load failure the embed server stayed 'not ready' forever while /v1/health said
    ok, so nothing restarted it. /v1/health now answers 503 with the reason."""
    import shutil

    v = tmp_path / "broken.vindex"
    shutil.copytree(tiny_models["gemma3"], v)
    with open(v / "embeddings.bin", "r+b") as f:  # truncated: fits no shape index.json states
        f.truncate(1000)
    with _inproc.embed({"gemma": v}) as srv:
        deadline = time.monotonic() + 60
        while httpx.get(srv.url + "/v1/health").status_code == 200 and time.monotonic() < deadline:
            time.sleep(0.05)
        r = httpx.get(srv.url + "/v1/health")
        assert r.status_code == 503 and "embeddings.bin" in r.text, r.text
        ready = httpx.get(srv.url + "/v1/ready")
        assert ready.status_code == 503 and "embeddings.bin" in ready.text


def test_a_member_three_quarters_of_a_second_away_joins(tiny_models):
    """A member with ~0.75 s one-way latency could never join (its 3 s wait ended before the router had
    probed it back), and its log said the router was unreachable."""
    from larql_edge.format.layers import LayerRange
    from larql_edge.roles.ffn.app import create_app
    from larql_edge.roles.ffn.shard import Shard
    from larql_edge.service.membership import GridSettings, install_membership
    from larql_edge.tools.delay_proxy import DelayProxy
    from larql_edge.tools.grid.supervisor import free_port
    from tests._grid import GRID_KEY, wait_grid

    port = free_port()
    # heartbeats every 1 s (eviction after 3 s): a 1.5 s round trip must not evict the member
    with _inproc.router(heartbeat=1.0) as router, \
            DelayProxy(("127.0.0.1", 0), ("127.0.0.1", router.port), delay_ms=750).running() as to_router, \
            DelayProxy(("127.0.0.1", 0), ("127.0.0.1", port), delay_ms=750).running() as to_member:
        s = Shard(tiny_models["gemma3"], LayerRange.parse("0-1"))
        app = create_app(s)
        member = install_membership(app, GridSettings(routers=(to_router.url,), grid_key=GRID_KEY,
                                                      public_url=to_member.url),
                                    "ffn", lambda: s.describe(app.ctx.compute.inflight))
        assert member is not None
        with ServerThread(app, port=port):
            view = wait_grid(router.url, members=1, timeout=90)
            assert [m["url"] for m in view["members"]] == [to_member.url]
            # the member itself knows it joined (the router may register a join whose reply came too late)
            deadline = time.monotonic() + 60
            while not all(member.member_ids.values()) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert member.member_ids and all(member.member_ids.values()), member.member_ids
            joins = [link.joins for link, _ in member.links.values()]
            assert joins == [1], joins



# -- Low: GET /v1/token/encode?text= was capped at 8 KB of URL, with a misleading error ------------------


@pytest.mark.parametrize("where", ["embed", "router"])
def test_a_long_get_text_is_read_to_16k_and_beyond_is_a_414_pointing_to_post(grid, where):
    """The documented text limit is 100,000 characters, but a GET's query string lives in the request
    head, which Sanic caps (8 KB by default, 16 KB at most): 9,000 characters were a 413 saying
    "Request header exceeds the size limit". The head now takes Sanic's most (16 KB); past it the
    request line is a 414 in the envelope that names the route's POST form, and an oversize header
    block a 431. The server still answers on a new connection."""
    from sanic.http import Http

    from larql_edge.service._envelope import MAX_HEAD_BYTES

    # In one process the apps share Sanic's bound (a class attribute, set by the last app configured, from
    # its head and body limits): give it what each production server, one app a process, has.
    Http.set_header_max_size(MAX_HEAD_BYTES)
    url = grid[where].url
    r = httpx.get(url + "/v1/token/encode", params={"text": "a" * 12_000}, timeout=30)
    assert r.status_code == 200 and r.json()["text"] == "a" * 12_000, r.text[:200]
    r = httpx.get(url + "/v1/token/encode", params={"text": "a" * 20_000}, timeout=30)
    assert r.status_code == 414, r.text[:300]
    assert "POST /v1/token/encode" in r.json()["error"], r.text
    r = httpx.get(url + "/v1/token/encode", params={"text": "paris"}, headers={"x-pad": "p" * 20_000}, timeout=30)
    assert r.status_code == 431 and "request head" in r.json()["error"], r.text[:300]
    long_text = "a" * 20_000  # the POST form takes it
    r = httpx.post(url + "/v1/token/encode", json={"text": long_text}, timeout=30)
    assert r.status_code == 200 and r.json()["text"] == long_text


def test_a_long_get_at_serve_is_a_414_in_openais_envelope(tiny_models, grid):
    with _serve(tiny_models["gemma3"], grid["router"].url, Limits(context=64)) as s:
        r = httpx.get(s.url + "/v1/models", params={"q": "a" * 20_000}, timeout=30)
        assert r.status_code == 414, r.text[:300]
        assert "request line" in r.json()["error"]["message"], r.text[:300]
        assert httpx.get(s.url + "/v1/models", timeout=30).status_code == 200
