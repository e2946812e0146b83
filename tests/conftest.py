"""Shared fixtures and the rules of the test tiers.

Tiers: ``-m "not slow"`` is the fast tier: in-process (servers run in threads, CLIs through their
``main``), no subprocess at all (`_no_subprocess_in_the_fast_tier` fails a test that starts one),
tiny models generated in-test. `scripts/test -m "not slow"` runs it on 3 pytest-xdist workers
(`TEST_WORKERS=1`: one process), a test file per worker at a time (module fixtures are built once;
tests must not share ports, files or environment across files). ``slow`` is added to every test marked ``real_model``, ``multiprocess`` or
``docker``, and to every test that uses a real-model fixture; an in-process test that takes tens of
seconds (schemathesis fuzzing, Hub round trips of whole vindexes) or several seconds of CPU (thousands
of sampled generations) carries ``slow`` itself (`scripts/test` lists the slowest tests of a run: look
there first).

Under ``CI`` no skip is allowed: a skip there would hide a missing piece (a tool not installed, a
model not found), so it is turned into a failure. Only a skip whose reason starts with
``platform:`` (the test cannot apply to this OS or CPU at all) stays a skip.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
from pathlib import Path

import pytest

DATA = Path(__file__).parent / "data"
GOLDEN = {"gemma3-270m": DATA / "golden" / "gemma-3-270m.json", "smollm2-135m": DATA / "golden" / "smollm2-135m-instruct.json"}
TIER_MARKERS = ("real_model", "multiprocess", "docker")
REAL_MODEL_FIXTURES = {"gemma_f32", "gemma_f16", "smol_f32", "smol_f16", "real_grid_f32"}
# What the environment of a test may not carry in from the shell (flag twins, Hub settings, metrics).
ISOLATED_PREFIXES = ("LARQL_", "HF_", "HUGGINGFACE_")
ISOLATED = ("PROMETHEUS_MULTIPROC_DIR",)
_CACHE_DIR = os.environ.get("LARQL_CACHE_DIR")  # the one LARQL_ setting every test keeps
# Tests marked ``under_load`` (faults, Swarm, pull) run beside this many CPU hogs (stress-ng): 2 under
# CI, none elsewhere unless TEST_CPU_HOGS says (read here: LARQL_ variables are isolated away).
_CPU_HOGS = int(os.environ.get("TEST_CPU_HOGS") or (2 if os.environ.get("CI") else 0))


def pytest_configure(config):
    # Tests share 2 cores between servers and clients: pin BLAS threads (DESIGN.md §7).
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("under_load"):  # the hogs are processes
            item.add_marker(pytest.mark.multiprocess)
        if REAL_MODEL_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.real_model)
        if any(item.get_closest_marker(m) for m in TIER_MARKERS):
            item.add_marker(pytest.mark.slow)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """After the last test in a row marked ``shared_swarm`` (its module fixtures finalized first,
    which remove their stacks), the session's swarm comes down: it holds ~5 GiB of tmpfs and three
    dockerds that the tests after it need no part of."""
    yield
    if item.get_closest_marker("shared_swarm") and (nextitem is None or not nextitem.get_closest_marker("shared_swarm")):
        from tests import _swarm

        _swarm.release_shared()


def _under_ci() -> bool:
    return bool(os.environ.get("CI"))


def _allowed_skip(longrepr) -> bool:
    reason = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    return "platform:" in reason


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    if _under_ci() and rep.skipped and not hasattr(rep, "wasxfail") and not _allowed_skip(rep.longrepr):
        reason = rep.longrepr[2] if isinstance(rep.longrepr, tuple) else rep.longrepr
        rep.outcome = "failed"
        rep.longrepr = f"skipped under CI, where nothing may be missing: {reason}"


def pytest_collectreport(report):
    if _under_ci() and report.skipped and not _allowed_skip(report.longrepr):
        report.outcome = "failed"


@pytest.fixture(autouse=True)
def _cpu_hogs_beside(request):
    marker = request.node.get_closest_marker("under_load")
    # ``under_load(hogs=N)``: a test whose claim is about a loaded host runs beside N hogs anywhere
    hogs = max(_CPU_HOGS, marker.kwargs.get("hogs", 0)) if marker is not None else 0
    if not hogs:
        yield
        return
    from larql_edge.testing.load import cpu_hogs

    with cpu_hogs(hogs):
        yield


@pytest.fixture(autouse=True)
def _isolated_env(monkeypatch):
    """No LARQL_*/HF_* variable or metrics folder of the calling shell leaks into a test."""
    for name in list(os.environ):
        if name.startswith(ISOLATED_PREFIXES) or name in ISOLATED:
            monkeypatch.delenv(name)
    if _CACHE_DIR:
        monkeypatch.setenv("LARQL_CACHE_DIR", _CACHE_DIR)


@pytest.fixture(autouse=True)
def _logging_restored():
    """A CLI's `main` run in-process (`setup_logging`, `basicConfig`) adds a handler bound to the
    sys.stderr of that moment, a capture closed when its test ends: a later test's log line would
    then print a "Logging error" traceback into whatever that test reads as stderr."""
    loggers = [logging.getLogger(), logging.getLogger("larql")]
    saved = [(lg, list(lg.handlers), lg.level, lg.propagate) for lg in loggers]
    yield
    for lg, handlers, level, propagate in saved:
        for h in list(lg.handlers):
            if h not in handlers and not type(h).__module__.startswith("_pytest"):  # pytest's own come and go per phase
                lg.removeHandler(h)
        lg.setLevel(level)
        lg.propagate = propagate


@pytest.fixture(autouse=True)
def _no_subprocess_in_the_fast_tier(request, monkeypatch):
    if request.node.get_closest_marker("slow"):
        yield
        return
    real_init = subprocess.Popen.__init__

    def refuse(self, args, *a, **kw):
        raise AssertionError(f"a fast-tier test started a process ({args!r}): run it in-process, or mark it multiprocess")

    monkeypatch.setattr(subprocess.Popen, "__init__", refuse)
    yield
    monkeypatch.setattr(subprocess.Popen, "__init__", real_init)


@pytest.fixture(scope="session")
def golden():
    def load(model: str) -> dict:
        return json.loads(GOLDEN[model].read_text())

    return load


def _real_vindex(alias: str, dtype: str, quant: str = "none") -> Path:
    from larql_edge.errors import SourceError
    from larql_edge.tools.slicer.cache import cached_vindex

    try:
        return cached_vindex(alias, level="all", dtype=dtype, quant=quant, log=lambda m: None)
    except SourceError as e:
        pytest.skip(f"real model unavailable: {e}")  # a failure under CI (see the module docstring)


@pytest.fixture(scope="session")
def gemma_f32() -> Path:
    return _real_vindex("gemma3-270m", "f32")


@pytest.fixture(scope="session")
def gemma_f16() -> Path:
    return _real_vindex("gemma3-270m", "f16")


@pytest.fixture(scope="session")
def smol_f32() -> Path:
    return _real_vindex("smollm2-135m", "f32")


@pytest.fixture(scope="session")
def smol_f16() -> Path:
    return _real_vindex("smollm2-135m", "f16")


@pytest.fixture(scope="session")
def real_grid_f32(tmp_path_factory):
    """``real_grid_f32(alias, vindex)``: the grid of processes of a real model's f32 vindex (router,
    embed server, its layers in 2 even FFN ranges), started on first use and shared by every module
    that only generates through it (test_grid_three_tier, test_serve_api_real, test_serve_real,
    test_serve_structured_real): one start-up per model for the session instead of one per module.
    It lives through the CPU-hog tests, where a heartbeat can be late, so its router evicts a member
    only after 10 s without one (those tests are not about this grid); and it is complete again
    before it is handed out."""
    from contextlib import ExitStack

    from larql_edge.format.layers import split_even
    from larql_edge.format.vindex import Vindex
    from tests._grid import Procs, start_grid, wait_grid

    grids: dict[str, dict] = {}
    with ExitStack() as stack:
        def get(alias: str, vindex: Path) -> dict:
            if alias in grids:
                assert grids[alias]["vindex"] == vindex, (alias, vindex)
                wait_grid(grids[alias]["router"].url, embed=1, timeout=120)
                return grids[alias]
            procs = stack.enter_context(Procs(tmp_path_factory.mktemp(f"grid-{alias}")))
            ranges = [str(r) for r in split_even(Vindex.open(vindex).num_layers, 2)]
            g = start_grid(procs, vindex, ranges, router_args=("--evict-after", "10"), timeout=600)
            grids[alias] = dict(g, vindex=vindex, procs=procs)
            return grids[alias]

        yield get


@pytest.fixture(scope="session")
def real_quantized():
    """``real_quantized(alias, quant)``: a real model's q4k or gguf vindex, extracted once and cached."""
    return lambda alias, quant: _real_vindex(alias, "f16", quant)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    """Tiny random HF folders for each family, and their extracted f32 vindexes."""
    from larql_edge.tools.slicer.extract import extract
    from tests.tinymodel import make_tiny_model

    root = tmp_path_factory.mktemp("tiny")
    out: dict[str, Path] = {}
    for fam in ("gemma3", "llama"):
        src = make_tiny_model(root / f"{fam}-hf", fam, seed=1 if fam == "gemma3" else 2)
        out[f"{fam}-hf"] = src
        out[fam] = root / f"{fam}.vindex"
        extract(str(src), out[fam], dtype="f32", progress=False, log=lambda m: None)
    return out


# -- the Hub-protocol test server (tests/hubserver) ---------------------------------------------

@pytest.fixture
def hf_env(tmp_path, monkeypatch):
    """Client configuration for the local server: no Xet, no telemetry/agent lookup, no offline mode, fresh home.

    `huggingface_hub.constants` reads the environment at import time, so the module attributes are patched too.
    """
    home = tmp_path / "hf_home"
    for name, value in {
        "HF_HUB_DISABLE_XET": "1",
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "HF_HOME": str(home),
        "NO_PROXY": "127.0.0.1,localhost",
    }.items():
        monkeypatch.setenv(name, value)
    for name in ("HF_HUB_OFFLINE", "HF_TOKEN", "HF_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)
    from huggingface_hub import constants as hf_constants

    monkeypatch.setattr(hf_constants, "HF_HUB_DISABLE_XET", True)
    monkeypatch.setattr(hf_constants, "HF_HUB_DISABLE_TELEMETRY", True)
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", False)
    return home


@pytest.fixture
def hub(hf_env):
    from larql_edge.testing.hubserver import HubServer, local_only_client

    with HubServer() as server, local_only_client() as blocked:
        yield server
        assert blocked == [], f"huggingface_hub tried to reach non-local hosts: {blocked}"


