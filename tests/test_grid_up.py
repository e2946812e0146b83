"""`larql-grid up` as a user runs it: it comes up, prints a command that works, and Ctrl-C stops
every process it started."""

from __future__ import annotations

import json
import os
import queue
import re
import shlex
import signal
import subprocess
import threading
import time

import pytest

from tests._cli import run_cli
from tests._grid import free_port, larql, server_env


def _lines(proc: subprocess.Popen) -> queue.Queue:
    q: queue.Queue = queue.Queue()

    def pump():
        with proc.stdout:  # closed at EOF: an unclosed pipe is an unraisable warning in a later test
            for line in proc.stdout:
                q.put(line)
        q.put(None)

    threading.Thread(target=pump, daemon=True).start()
    return q


def _read_until(q: queue.Queue, marker: str, timeout: float) -> str:
    out, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            line = q.get(timeout=0.5)
        except queue.Empty:
            continue
        if line is None:
            break
        out.append(line)
        if marker in line:
            return "".join(out)
    raise AssertionError(f"no {marker!r} within {timeout}s:\n{''.join(out)}")


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # A zombie is gone for our purposes (its parent, the supervisor, has exited).
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] == "Z"
    except OSError:
        return True


def _up_generate_stop(argv: list[str], local_vindex, n_pids: int, ranges: list[str], tmp_path, timeout: float,
                      env: dict | None = None) -> None:
    """Start `larql-grid up`, run the command it prints, compare with the local forward on
    ``local_vindex``, then Ctrl-C and check every process it started is gone."""
    ports = [free_port() for _ in range(3)]
    argv = [*argv, "--router-port", str(ports[0]), "--embed-port", str(ports[1]), "--ffn-port", str(ports[2]),
            "--log-dir", str(tmp_path / "logs")]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env or server_env(),
                            start_new_session=True, stdin=subprocess.DEVNULL)
    try:
        q = _lines(proc)
        text = _read_until(q, "Ctrl-C stops the grid.", timeout=timeout)
        pids = [int(p) for p in re.findall(r"pid (\d+)", text)]
        assert len(pids) == n_pids, text
        assert all(f"layers {r}" in text for r in ranges), text
        # A line as each role becomes ready: the wait is never silent, also into a pipe.
        assert "router ready (" in text and "embed ready (" in text, text
        # `larql generate ...`, or the command by path when PATH does not find this installation's
        cmd = next(line.strip() for line in text.splitlines() if re.match(r"(\S*/)?larql generate ", line.strip()))
        args = shlex.split(cmd)[1:]
        args[args.index("--max-tokens") + 1] = "4"
        r = larql(*args, "--json")
        assert r.returncode == 0, r.stderr
        local = larql("generate", "--vindex", str(local_vindex), "--prompt", "The capital of France is",
                      "--max-tokens", "4", "--json")
        assert json.loads(r.stdout)["generated_ids"] == json.loads(local.stdout)["generated_ids"]
        assert all(not _gone(p) for p in pids)
        os.kill(proc.pid, signal.SIGINT)  # what Ctrl-C sends
        assert proc.wait(timeout=60) == 0
        deadline = time.monotonic() + 15
        while not all(_gone(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert all(_gone(p) for p in pids), [p for p in pids if not _gone(p)]
        rest = "".join(iter(lambda: q.get(timeout=5) or "", ""))
        assert "stopped" in rest
    finally:
        if proc.poll() is None:  # the test failed midway: a clean stop first, so no role is left behind
            os.kill(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
        proc.stdout.close()


@pytest.mark.timeout(300)
@pytest.mark.multiprocess
def test_grid_up_serves_and_ctrl_c_stops_everything(tiny_models, tmp_path):
    argv = ["larql-grid", "up", "--vindex", str(tiny_models["llama"]), "--shards", "2", "--replicas", "2"]
    _up_generate_stop(argv, tiny_models["llama"], 1 + 1 + 4, ["0-0", "1-1"], tmp_path, timeout=180)  # 2 ranges x 2


@pytest.mark.timeout(300)
@pytest.mark.multiprocess
def test_grid_up_starts_its_own_installations_roles_without_path(tiny_models, tmp_path):
    """Issue #19: the roles were started by name from PATH: without the venv on PATH the grid failed, and
    on the probe machine it started another installation's larql-router. Here PATH holds none of them."""
    import sys

    env = server_env(PATH="/usr/bin:/bin")
    argv = [sys.executable, "-m", "larql_edge.tools.grid.cli", "up", "--vindex", str(tiny_models["llama"]), "--shards", "2"]
    _up_generate_stop(argv, tiny_models["llama"], 1 + 1 + 2, ["0-0", "1-1"], tmp_path, timeout=180, env=env)


@pytest.mark.timeout(1200)
@pytest.mark.multiprocess
@pytest.mark.real_model
def test_grid_up_quant_q4k_serves_the_q4k_vindex(real_quantized, tmp_path):
    """`larql-grid up --quant q4k`: every role runs from its slice of LARQL's q4k layout and the grid
    generates what the local forward generates on that vindex."""
    argv = ["larql-grid", "up", "--model", "smollm2-135m", "--quant", "q4k", "--shards", "2"]
    _up_generate_stop(argv, real_quantized("smollm2-135m", "q4k"), 1 + 1 + 2, ["0-14", "15-29"], tmp_path, timeout=900)


def test_grid_up_rejects_bad_counts(tiny_models):
    from larql_edge.tools.grid.cli import main

    r = run_cli(main, "up", "--vindex", str(tiny_models["llama"]), "--shards", "5")
    assert r.returncode == 1 and "cannot split 2 layers into 5 shards" in r.stderr


def test_commands_are_named_by_path_when_the_venv_is_not_on_path(tmp_path, monkeypatch):
    """`.venv/bin/larql-grid up` (the venv not activated) started `larql-embed` by name, which PATH
    does not find, and printed a `larql generate` the shell cannot run: both name the venv's bin/."""
    from larql_edge.tools.grid.cli import console_script

    bin_dir = tmp_path / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    for name in ("python", "larql", "larql-embed"):
        (bin_dir / name).write_text("#!/bin/sh\n")
        (bin_dir / name).chmod(0o755)
    monkeypatch.setattr("sys.executable", str(bin_dir / "python"))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    assert console_script("larql") == ".venv/bin/larql"
    assert console_script("larql-embed") == ".venv/bin/larql-embed"
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")  # activated: by name, as the README shows
    assert console_script("larql") == "larql"


def test_up_gives_the_callers_signal_handlers_back(tiny_models, tmp_path, monkeypatch):
    """`up` ignores SIGINT/SIGTERM while it stops its roles, and left them ignored when it returned: a
    caller of main() in the same process (a test session) then never saw Ctrl-C again, nor did any
    process it started after (an ignored signal is inherited). A supervisor that cannot start the
    router stands in for the processes (this tier starts none): `up` fails and gives them back."""
    from larql_edge.tools.grid import cli

    class NoStart:
        def __init__(self, *a, **kw):
            pass

        def start(self, name, *a, **kw):
            raise RuntimeError(f"{name} cannot start here")

        def stop_all(self):
            pass

    monkeypatch.setattr(cli, "Supervisor", NoStart)
    before = (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM))
    r = run_cli(cli.main, "up", "--vindex", str(tiny_models["llama"]), "--shards", "1", "--log-dir", str(tmp_path))
    assert r.returncode == 1 and "router cannot start here" in r.stderr, r.stderr
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before
