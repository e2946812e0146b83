"""`larql-slicer pull` heals (issue #14): against the Hub-protocol test server, with the unmodified
huggingface_hub client.

- a file that fails verification is removed (with huggingface_hub's metadata, or its cache link and
  blob) before the error that names it, and the next pull fetches it;
- a download cut midway resumes from the bytes on disk with a Range request, and no stale partial is
  left (output folder, its ``.cache/huggingface``, the Hub cache);
- Ctrl-C stops the downloads (in-process here; the console script in the multiprocess test), and a
  rerun finishes from what was kept;
- what huggingface_hub raises on the way is one line, never a traceback.
"""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from larql_edge.errors import HubError, LarqlError
from larql_edge.tools.slicer.pull import pull
from tests._cli import slicer

REPO = "test-user/heal-vindex"
STORAGE = "datasets--test-user--heal-vindex"
BIG = 3 * 1024 * 1024 + 12345  # an LFS file that index.json does not list (only the Hub's listing vouches for it)
WHERE = ("output", "cache")


def quiet(_msg: str) -> None:
    pass


@pytest.fixture
def ctrl_c_default():
    """A shell that starts the suite in the background (`scripts/test &`, `nohup`) hands it SIGINT
    ignored, and every process it starts inherits that: Ctrl-C then reaches neither the test nor the
    console script, and these tests failed for it (seen 2026-12-07). Python's own Ctrl-C handler is put
    back for their duration (a child's exec resets a handled signal to its default)."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


@pytest.fixture
def hub_cache(hub, tmp_path, monkeypatch) -> Path:
    """A Hub cache of this test's own (huggingface_hub reads HF_HUB_CACHE at import: patched here)."""
    from huggingface_hub import constants as hf_constants

    cache = tmp_path / "hub-cache"
    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(cache))
    return cache


@pytest.fixture
def files(hub, hub_cache, tiny_models) -> dict[str, bytes]:
    """The tiny Gemma vindex plus big.bin, committed to REPO: .bin files in LFS, the JSON files in git."""
    out = {f.name: f.read_bytes() for f in sorted(tiny_models["gemma3"].iterdir()) if f.is_file()}
    out["big.bin"] = np.random.default_rng(7).bytes(BIG)
    hub.commit_files(REPO, out)
    lfs = {p for p, e in hub.files(REPO).items() if e.lfs}
    assert {"big.bin", "gate_vectors.bin", "embeddings.bin"} <= lfs and "tokenizer.json" not in lfs
    return out


def _pull(hub, where: str, tmp_path: Path, **kw):
    out = tmp_path / "out" if where == "output" else None
    return pull(REPO, output=out, endpoint=hub.url, token=hub.token, log=quiet, hints=False, **kw)


def _folder(where: str, tmp_path: Path, hub, hub_cache: Path) -> Path:
    if where == "output":
        return tmp_path / "out"
    return hub_cache / STORAGE / "snapshots" / hub.commits(REPO)[0].oid


def _partials(*roots: Path) -> list[Path]:
    """Every partial download anywhere under ``roots`` (ours ``.part``, huggingface_hub's ``.incomplete``)."""
    return sorted(p for r in roots if r.exists() for p in r.rglob("*")
                  if p.is_file() and p.name.endswith((".part", ".incomplete")))


def _damaged_blobs(hub_cache: Path) -> list[str]:
    """Blobs of the Hub cache whose bytes are not what their name (sha256, or git blob id) says."""
    blobs = hub_cache / STORAGE / "blobs"
    bad = []
    for b in sorted(blobs.iterdir()) if blobs.is_dir() else []:
        if not b.is_file() or b.name.endswith((".part", ".incomplete")):
            continue
        data = b.read_bytes()
        if b.name not in (hashlib.sha256(data).hexdigest(), hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()):
            bad.append(b.name)
    return bad


def _assert_complete(folder: Path, files: dict[str, bytes]) -> None:
    for name, data in files.items():
        assert (folder / name).read_bytes() == data, name


def _flip_in_place(path: Path) -> None:
    """A bit flipped on disk (bit rot, a bad copy): same size and mtime, so nothing but the bytes tells."""
    real = Path(os.path.realpath(path))
    st = real.stat()
    data = bytearray(real.read_bytes())
    data[len(data) // 2] ^= 0x01
    real.chmod(0o644)
    real.write_bytes(bytes(data))
    os.utime(real, ns=(st.st_atime_ns, st.st_mtime_ns))


def _gets(hub, name: str):
    return hub.requests_matching("GET", rf"/resolve/[^/]+/{name.replace('.', '[.]')}$")


# -- 1. verification that heals -------------------------------------------------------------------


@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize("name", ["big.bin", "gate_vectors.bin", "tokenizer.json", "index.json"])
def test_a_file_damaged_in_transit_is_removed_and_a_rerun_completes(hub, files, hub_cache, tmp_path, where, name):
    """One flipped byte, right size and headers: huggingface_hub checks only the size. big.bin is
    vouched for only by the listing's lfs.sha256, tokenizer.json (git) by its blob id and index.json."""
    folder = _folder(where, tmp_path, hub, hub_cache)
    hub.corrupt_next_download(name)
    with pytest.raises(LarqlError, match=name) as err:
        _pull(hub, where, tmp_path)
    assert not (folder / name).exists(), "the damaged file is still there: every later pull would skip it"
    assert isinstance(err.value, HubError) and "pull again" in str(err.value) and "\n" not in str(err.value)
    assert not (folder / ".cache/huggingface/download" / f"{name}.metadata").exists()
    assert _damaged_blobs(hub_cache) == []
    assert _partials(tmp_path / "out", hub_cache) == []
    _pull(hub, where, tmp_path)
    _assert_complete(folder, files)


@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize("name", ["gate_vectors.bin", "tokenizer.json"])
def test_a_file_damaged_on_disk_is_removed_and_fetched_again(hub, files, hub_cache, tmp_path, where, name):
    folder = _folder(where, tmp_path, hub, hub_cache)
    _pull(hub, where, tmp_path)
    _flip_in_place(folder / name)
    with pytest.raises(LarqlError, match=name):
        _pull(hub, where, tmp_path)
    assert not (folder / name).exists(), "the damaged file is still there: every later pull would skip it"
    assert _damaged_blobs(hub_cache) == []
    _pull(hub, where, tmp_path)
    _assert_complete(folder, files)


def test_a_damaged_hub_cache_is_not_copied_into_an_output_folder(hub, files, hub_cache, tmp_path):
    """huggingface_hub copies a file it finds in its cache instead of downloading it: a damaged cached
    copy must not reach the output folder, and must not stay in the cache for the next pull."""
    _pull(hub, "cache", tmp_path)
    cached = _folder("cache", tmp_path, hub, hub_cache)
    _flip_in_place(cached / "tokenizer.json")
    _flip_in_place(cached / "gate_vectors.bin")
    with pytest.raises(HubError, match="tokenizer.json"):
        _pull(hub, "output", tmp_path)
    assert _damaged_blobs(hub_cache) == []
    _pull(hub, "output", tmp_path)
    _assert_complete(tmp_path / "out", files)
    _pull(hub, "cache", tmp_path)
    _assert_complete(cached, files)


# -- 2. resume ----------------------------------------------------------------------------------


@pytest.mark.parametrize("where", WHERE)
def test_a_cut_download_continues_from_the_bytes_on_disk(hub, files, hub_cache, tmp_path, where):
    cut = 1_234_567  # not a multiple of any chunk size
    hub.fail_next_download_after("big.bin", cut)
    _pull(hub, where, tmp_path)
    gets = _gets(hub, "big.bin")
    assert [g.fault for g in gets] == ["cut", None]
    assert gets[0].response_size == cut
    assert gets[1].status == 206 and gets[1].header("range") == f"bytes={cut}-"
    assert hub.bytes_downloaded("big.bin") == BIG, "bytes already on disk were downloaded again"
    _assert_complete(_folder(where, tmp_path, hub, hub_cache), files)
    assert _partials(tmp_path / "out", hub_cache) == []


@pytest.mark.slow  # tens of seconds in-process (tests/conftest.py: the tiers)
@pytest.mark.parametrize("where", WHERE)
def test_a_pull_that_gives_up_keeps_only_what_the_next_pull_continues(hub, files, hub_cache, tmp_path, where):
    hub.fail_next_download_after("big.bin", 1_000_000)
    hub.fail_next_download_after("big.bin", 0, times=20)  # and then the link stays down
    with pytest.raises(HubError, match="big.bin.*pull again") as err:
        _pull(hub, where, tmp_path)
    assert "\n" not in str(err.value)
    folder = _folder(where, tmp_path, hub, hub_cache)
    assert not (folder / "big.bin").exists()
    kept = _partials(tmp_path / "out", hub_cache)
    assert len(kept) == 1 and kept[0].stat().st_size == 1_000_000, kept  # one partial, no huggingface_hub leftover

    hub.clear_faults()
    hub.clear_requests()
    _pull(hub, where, tmp_path)
    gets = _gets(hub, "big.bin")
    assert len(gets) == 1 and gets[0].header("range") == "bytes=1000000-" and gets[0].status == 206
    _assert_complete(folder, files)
    assert _partials(tmp_path / "out", hub_cache) == []


def test_partials_a_killed_pull_left_are_removed_unless_their_download_is_alive(hub, files, hub_cache, tmp_path):
    """A process killed midway leaves huggingface_hub's ``<...>.<uuid>.incomplete`` (52 MB in the
    report): removed by the next pull, unless someone holds the download's lock right now."""
    from huggingface_hub._local_folder import get_local_download_paths
    from huggingface_hub.utils import WeakFileLock

    out = tmp_path / "out"
    sha = hashlib.sha256(files["big.bin"]).hexdigest()
    inc = get_local_download_paths(out, "big.bin").incomplete_path(sha)
    leftovers = [inc.with_name(f"{inc.name[:-len('.incomplete')]}.1a2b3c4d.incomplete"),
                 out / ".cache/huggingface/download/big.bin.0123456789abcdef.part",  # ours, of another content
                 hub_cache / STORAGE / "blobs" / f"{sha}.5e6f7a8b.incomplete"]
    for p in leftovers:
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(b"x" * 52)
    busy = hub_cache / STORAGE / "blobs" / f"{'e' * 64}.9c0d1e2f.incomplete"  # another revision, downloading now
    busy.write_bytes(b"y" * 52)
    lock = hub_cache / ".locks" / STORAGE / f"{'e' * 64}.lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with WeakFileLock(lock):
            held.set()
            release.wait(60)

    holder = threading.Thread(target=hold, daemon=True)
    holder.start()
    try:
        assert held.wait(10)
        _pull(hub, "output", tmp_path)
        _pull(hub, "cache", tmp_path)
        assert _partials(out, hub_cache) == [busy]
    finally:
        release.set()
        holder.join(10)
    _assert_complete(out, files)


# -- 3. Ctrl-C --------------------------------------------------------------------------------------


def _when_sent(throttle, nbytes: int, then, timeout: float = 600.0, done: threading.Event | None = None) -> threading.Thread:
    """Call ``then()`` once the throttled downloads have sent ``nbytes``; give up when ``done`` is set (the
    pull ended) or after ``timeout``. The wait has no tighter bound: on a loaded host the pull may take
    long to reach the throttled file (a 30 s bound here once let the pull finish unsignalled)."""

    def watch() -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not (done is not None and done.is_set()):
            if throttle.bytes_sent >= nbytes:
                then()
                return
            time.sleep(0.02)

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    return t


@pytest.mark.under_load
def test_ctrl_c_stops_the_downloads_and_a_rerun_resumes(hub, files, hub_cache, tmp_path, ctrl_c_default):
    """In-process: SIGINT while big.bin trickles in (it needs ~8 s). The download stops instead of
    running to its end, and the rerun continues from what is on disk."""
    out = tmp_path / "out"
    slow = hub.throttle_downloads("big.bin", 400_000)
    done = threading.Event()
    watcher = _when_sent(slow, 200_000, lambda: os.kill(os.getpid(), signal.SIGINT), done=done)
    try:
        with pytest.raises(KeyboardInterrupt):
            _pull(hub, "output", tmp_path)
    finally:
        done.set()
        watcher.join(5)
    gets = _gets(hub, "big.bin")
    assert len(gets) == 1 and gets[0].response_size < BIG, "the download ran on after Ctrl-C"
    assert not (out / "big.bin").exists()

    hub.remove_fault(slow)
    hub.clear_requests()
    _pull(hub, "output", tmp_path)
    again = _gets(hub, "big.bin")
    assert len(again) == 1 and again[0].status == 206
    start = int(again[0].header("range").removeprefix("bytes=").rstrip("-"))
    assert start > 0 and again[0].response_size == BIG - start
    _assert_complete(out, files)
    assert _partials(out, hub_cache) == []


@pytest.mark.timeout(900)
@pytest.mark.multiprocess
@pytest.mark.under_load
def test_ctrl_c_stops_larql_slicer_pull_at_once_and_a_rerun_finishes(hub, files, hub_cache, tmp_path,
                                                                     ctrl_c_default):
    """The console script as an operator runs it. After SIGINT the throttled big.bin would need more
    than 30 s to finish: a process that is gone within the bound below did not keep downloading."""
    from larql_edge.testing.servers import console_script, server_env

    out = tmp_path / "out"
    # The bound after Ctrl-C: a fixed 15 s once failed on a loaded host. It is derived from what an
    # interpreter start and exit of the same console script costs here, now (measured under the same load).
    t0 = time.monotonic()
    subprocess.run(console_script("larql-slicer") + ["pull", "--help"], capture_output=True, timeout=300, check=True)
    bound = 5.0 + 3 * (time.monotonic() - t0)
    slow = hub.throttle_downloads("big.bin", 100_000)
    env = server_env(HF_HOME=str(tmp_path / "child-hf-home"), HF_HUB_DISABLE_XET="1", HF_HUB_DISABLE_TELEMETRY="1",
                     HF_TOKEN=hub.token, NO_PROXY="127.0.0.1,localhost")
    argv = console_script("larql-slicer") + ["pull", REPO, "-o", str(out), "--endpoint", hub.url]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        seen = threading.Event()
        watcher = _when_sent(slow, 150_000, seen.set)
        while watcher.is_alive() and proc.poll() is None:
            watcher.join(0.1)
        assert seen.is_set(), "big.bin never started downloading"
        os.kill(proc.pid, signal.SIGINT)
        try:
            stdout, stderr = proc.communicate(timeout=bound)
        except subprocess.TimeoutExpired:
            pytest.fail(f"larql-slicer pull was still running {bound:.0f} s after Ctrl-C: the downloads went on")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate(timeout=10)
    assert proc.returncode == 130
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and "interrupted" in lines[0] and "run the same command again" in lines[0], stderr
    assert _gets(hub, "big.bin")[0].response_size < BIG
    kept = _partials(out)
    assert [p.name.endswith(".part") for p in kept] == [True], kept  # ours, resumable; no .incomplete

    hub.remove_fault(slow)
    hub.clear_requests()
    r = slicer("pull", REPO, "-o", str(out), "--endpoint", hub.url, "--hf-token", hub.token)
    assert r.returncode == 0, r.stderr
    again = _gets(hub, "big.bin")
    assert len(again) == 1 and again[0].status == 206 and again[0].header("range") != "bytes=0-"
    _assert_complete(out, files)
    assert _partials(out) == []


# -- 4. one line, never a traceback ------------------------------------------------------------------


def _cli(hub, *args: str):
    r = slicer("pull", REPO, *args, "--endpoint", hub.url, "--hf-token", hub.token)
    assert r.returncode == 1, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    return lines[0]


def test_a_revision_that_names_another_resource_is_refused_in_one_line(hub, files, tmp_path):
    # '..' was normalised out of the request URL: the Hub answered the repo's info, huggingface_hub
    # raised a TypeError on it.
    for rev in ("..", "a/../b", "main/", ".hidden", "x:y"):
        assert "invalid revision" in _cli(hub, "--revision", rev, "-o", str(tmp_path / "o"))
    assert not (tmp_path / "o").exists()


def test_an_answer_huggingface_hub_cannot_parse_is_one_line(hub, files, tmp_path):
    hub.respond_with("GET", r"/tree/", 200, message="not a listing")  # a JSON object where a list belongs
    assert "huggingface_hub failed" in _cli(hub, "-o", str(tmp_path / "o"))


@pytest.mark.parametrize("evil", ["a/C:x", "a/\x01b", ".cache/huggingface/download/index.json.metadata", "a/./b"])
def test_a_name_huggingface_hubs_path_guard_refuses_is_refused_before_anything_is_written(hub, files, tmp_path, evil):
    hub.inject_tree_entry(REPO, evil, content=b"pwned")
    assert "unsafe path" in _cli(hub, "-o", str(tmp_path / "o"))
    assert not (tmp_path / "o").exists()


def test_an_error_raised_inside_huggingface_hub_is_translated_but_ours_is_not():
    from huggingface_hub.utils import build_hf_headers

    from larql_edge.tools.slicer import hub as H

    try:
        build_hf_headers(headers=5)  # a TypeError inside huggingface_hub
    except TypeError as e:
        got = H.translate(e, "pull o/n")
    assert isinstance(got, HubError) and got.message.startswith("pull o/n: huggingface_hub failed (TypeError")
    with pytest.raises(TypeError):
        H.translate(TypeError("a bug of ours"), "pull o/n")


# -- the test server's new faults -------------------------------------------------------------------


def test_corrupt_and_throttle_faults(hub, files):
    import httpx

    url = f"{hub.url}/datasets/{REPO}/resolve/main/gate_vectors.bin"
    want = files["gate_vectors.bin"]
    hub.corrupt_next_download("gate_vectors.bin")
    with httpx.Client() as client:
        bad = client.get(url).content
        good = client.get(url).content
        slow = hub.throttle_downloads("gate_vectors.bin", 64_000)
        slowed = client.get(url, headers={"Range": "bytes=100-"})
        hub.remove_fault(slow)
    assert len(bad) == len(want) and sum(a != b for a, b in zip(bad, want, strict=True)) == 1
    assert good == want
    assert slowed.status_code == 206 and slowed.content == want[100:]
    assert [r.fault for r in _gets(hub, "gate_vectors.bin")] == ["corrupt", None, None]


# -- the Range-resuming fetch itself ------------------------------------------------------------------


class _NoRangeHandler:
    """A server that ignores Range and always sends the whole file (as some proxies and CDNs do)."""

    @staticmethod
    def serve(data: bytes):
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            disable_nagle_algorithm = True  # head and body are two writes (tests/_grid.py StubEmbed)

            def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args) -> None:
                pass

        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        return server


def test_fetch_rewrites_a_partial_when_the_server_ignores_range_and_restarts_one_too_long(hf_env, tmp_path):
    from larql_edge.tools.slicer.hub import Hub

    data = np.random.default_rng(3).bytes(200_000)
    server = _NoRangeHandler.serve(data)
    try:
        hub = Hub(endpoint=f"http://127.0.0.1:{server.server_address[1]}", token="t")
        part = tmp_path / "x.part"
        part.write_bytes(data[:1000])  # the server answers 200 to our Range: the partial must not be appended to
        assert hub.fetch("o/n", "x.bin", revision="a" * 40, part=part, size=len(data), stop=threading.Event()) == len(data)
        assert part.read_bytes() == data
        part.write_bytes(b"z" * (len(data) + 5))  # longer than the file: not a prefix of it
        hub.fetch("o/n", "x.bin", revision="a" * 40, part=part, size=len(data), stop=threading.Event())
        assert part.read_bytes() == data
    finally:
        server.shutdown()
        server.server_close()


def test_fetch_stops_at_its_next_read_and_keeps_what_it_wrote(hub, files, tmp_path):
    from larql_edge.tools.slicer import hub as H

    slow = hub.throttle_downloads("big.bin", 200_000)
    commit = hub.commits(REPO)[0].oid
    part, stop, raised = tmp_path / "big.part", threading.Event(), []

    def run() -> None:
        try:
            H.Hub(endpoint=hub.url, token=hub.token).fetch(REPO, "big.bin", revision=commit, part=part, size=BIG, stop=stop)
        except BaseException as e:  # noqa: BLE001 - what the fetch raised is the assertion
            raised.append(e)

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    _when_sent(slow, 100_000, stop.set).join(30)
    worker.join(10)
    assert not worker.is_alive() and [type(e) for e in raised] == [H._Cancelled]
    kept = part.stat().st_size
    assert 0 < kept < BIG
    hub.remove_fault(slow)
    H.Hub(endpoint=hub.url, token=hub.token).fetch(REPO, "big.bin", revision=commit, part=part, size=BIG,
                                                  stop=threading.Event())
    assert part.read_bytes() == files["big.bin"]
    assert sorted(str(g.header("range")) for g in _gets(hub, "big.bin")) == ["None", f"bytes={kept}-"]
