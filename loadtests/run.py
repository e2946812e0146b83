"""Run a load-test scenario (loadtests/scenarios.toml) headless and judge it: exit 0 on pass, 1 on a
miss, 2 on a setup error.

    python loadtests/run.py embed                  # 60 s against a fresh embed server (Gemma 3 270M)
    python loadtests/run.py edge --edge varnish    # the Varnish edge instead of nginx
    python loadtests/run.py grid -d 5m --out /tmp/grid-report
    python loadtests/run.py serve --serve http://127.0.0.1:8000      # a larql-serve you started
    python loadtests/run.py embed --embed http://127.0.0.1:8082      # servers you started: none started

The servers a scenario needs and whose URL is not given (--embed, --edge-url, --router, --serve)
are started on 127.0.0.1 and free ports, from one vindex (--vindex, default the cached Gemma 3 270M
f16), each with 1 BLAS thread: larql-embed (hot cache 5000), nginx or varnishd with the shipped
config (deploy/), larql-router and two larql-ffn shards splitting the layers (joined with a
throwaway grid key), larql-serve when installed. Their logs go to the report folder.

The report folder (--out, default a new temp folder) gets locust's CSV files (stats, failures,
history) and HTML report, verdict.txt and verdict.json. Load only servers you run yourself, on
this machine.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import itertools
import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

LOCUSTFILE = ROOT / "loadtests" / "locustfile.py"
SCENARIOS = ROOT / "loadtests" / "scenarios.toml"
KNOWN_NEEDS = ("embed", "edge", "router", "ffn", "serve")


class SetupError(RuntimeError):
    """The run could not start (bad arguments, a server that does not come up): exit code 2."""


# ---- scenarios ------------------------------------------------------------------------------------

@dataclass
class Scenario:
    name: str
    description: str
    needs: list[str]
    users: list[str]
    clients: int
    max_failure_ratio: float
    min_rps: float
    p99_ms: dict[str, float]
    min_hit_ratio: float | None = None


_T0 = time.monotonic()


def say(message: str) -> None:
    """A progress line on stderr, flushed: starting servers and a run take tens of seconds to
    minutes, which silent (as CI shows it, not a terminal) look like a hang."""
    print(f"[loadtests {time.monotonic() - _T0:6.1f}s] {message}", file=sys.stderr, flush=True)


def load_scenarios(path: Path = SCENARIOS) -> dict[str, Scenario]:
    raw = tomllib.loads(path.read_text())["scenario"]
    out = {}
    for name, s in raw.items():
        unknown = set(s["needs"]) - set(KNOWN_NEEDS)
        if unknown:
            raise SetupError(f"{path.name}: scenario {name} needs unknown servers {sorted(unknown)}")
        out[name] = Scenario(name=name, description=s.get("description", ""), needs=list(s["needs"]),
                             users=list(s["users"]), clients=int(s["clients"]),
                             max_failure_ratio=float(s.get("max_failure_ratio", 0.0)), min_rps=float(s.get("min_rps", 0)),
                             p99_ms={k: float(v) for k, v in s["p99_ms"].items()},
                             min_hit_ratio=float(s["min_hit_ratio"]) if "min_hit_ratio" in s else None)
    return out


def parse_duration(text: str) -> float:
    """'60', '60s', '10m', '1h30m' -> seconds."""
    m = re.fullmatch(r"(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s?)?", text.strip())
    if not text.strip() or m is None or not any(m.groups()):
        raise argparse.ArgumentTypeError(f"duration {text!r}: want e.g. 60s, 10m, 1h")
    h, mi, s = (int(g or 0) for g in m.groups())
    seconds = h * 3600 + mi * 60 + s
    if seconds <= 0:
        raise argparse.ArgumentTypeError("duration must be positive")
    return float(seconds)


# ---- the servers ----------------------------------------------------------------------------------

@dataclass
class Stack:
    """URLs of the targets, and the pids of the processes started here (for RSS)."""

    urls: dict[str, str] = field(default_factory=dict)
    pids: dict[str, int] = field(default_factory=dict)
    logdir: Path | None = None

    def env(self) -> dict[str, str]:
        return {f"LARQL_LOAD_{t.upper()}_URL": u for t, u in self.urls.items() if t in ("embed", "edge", "router", "serve")}


def default_vindex() -> Path:
    from larql_edge.tools.slicer.cache import cached_vindex

    return cached_vindex("gemma3-270m", level="all", dtype="f16", log=lambda m: None)


def num_layers(vindex: Path) -> int:
    from larql_edge.format.vindex import Vindex

    return Vindex.open(vindex).index.num_layers


def layer_split(n: int, parts: int = 2) -> list[str]:
    bounds = [round(i * n / parts) for i in range(parts + 1)]
    return [f"{a}-{b - 1}" for a, b in itertools.pairwise(bounds) if b > a]


def serve_cli() -> str | None:
    return shutil.which("larql-serve")


@contextlib.contextmanager
def running_stack(needs: list[str], *, vindex: Path | None, given: dict[str, str], edge_kind: str,
                  logdir: Path, ready_timeout: float = 300.0) -> Iterator[Stack]:
    """Start what ``needs`` asks for and ``given`` does not provide; stop all of it on exit."""
    from larql_edge.testing.edge import running_edge
    from larql_edge.testing.servers import console_script, server_env
    from larql_edge.tools.grid.supervisor import Supervisor, free_port

    stack = Stack(urls={k: v.rstrip("/") for k, v in given.items() if v}, logdir=logdir)
    to_start = [n for n in needs if n not in stack.urls]
    # Shards are reached through the router: start them only with a router of our own.
    if "ffn" in to_start and "router" in stack.urls:
        to_start.remove("ffn")
    if not to_start:
        yield stack
        return
    if "serve" in to_start and serve_cli() is None:
        raise SetupError("the serve scenario needs --serve URL (larql-serve is not installed here)")
    vx = vindex or default_vindex()
    key = os.environ.get("LARQL_GRID_KEY") or secrets.token_hex(16)  # env only: never in argv
    with contextlib.ExitStack() as es:
        logdir.mkdir(parents=True, exist_ok=True)
        sup = Supervisor(logdir, server_env(LARQL_GRID_KEY=key))
        es.callback(sup.stop_all)

        def start(name: str, script: str, *args: str, env: dict[str, str] | None = None):
            port = free_port()
            return sup.start(name, [*console_script(script), *args, "--port", str(port)], f"http://127.0.0.1:{port}", env=env)

        router = None
        if "router" in to_start:
            say("starting larql-router")
            router = start("router", "larql-router", "--heartbeat-interval", "1")
            router.wait_ready(60)
            stack.urls["router"], stack.pids["router"] = router.url, router.pid
        join = ["--join", router.url] if router else []
        if "embed" in to_start:
            say(f"starting larql-embed on {vx}")
            embed = start("embed", "larql-embed", str(vx), "--blas-threads", "1", "--hot-cache", "5000", *join)
            embed.wait_ready(ready_timeout)
            say("larql-embed ready")
            stack.urls["embed"], stack.pids["embed"] = embed.url, embed.pid
        if "ffn" in to_start:
            for layers in layer_split(num_layers(vx)):
                say(f"starting larql-ffn, layers {layers}")
                shard = start(f"ffn-{layers}", "larql-ffn", str(vx), "--layers", layers, "--blas-threads", "1", *join)
                shard.wait_ready(ready_timeout)
                say(f"larql-ffn {layers} ready")
                stack.pids[f"ffn {layers}"] = shard.pid
                stack.urls.setdefault("ffn", shard.url)
        if router is not None:
            wait_for_grid(router.url, complete="ffn" in needs, embed=1 if "embed" in needs else 0, timeout=ready_timeout)
        if "edge" in to_start:
            if "embed" not in stack.urls:
                raise SetupError("the edge needs an embed server (--embed URL)")
            say(f"starting the {edge_kind} edge cache")
            edge = es.enter_context(running_edge(edge_kind, [stack.urls["embed"]]))
            stack.urls["edge"], stack.pids[f"edge ({edge_kind})"] = edge.url, edge.proc.pid
        if "serve" in to_start:
            say("starting larql-serve")
            s = start("serve", "larql-serve", env={"LARQL_VINDEX": str(vx), "LARQL_FFN": stack.urls["router"],
                                                   "LARQL_EMBED": stack.urls.get("embed", "")})
            s.wait_ready(ready_timeout)
            stack.urls["serve"], stack.pids["serve"] = s.url, s.pid
        yield stack


def wait_for_grid(router_url: str, *, complete: bool, embed: int, timeout: float) -> None:
    import time

    import httpx

    deadline = time.monotonic() + timeout
    view: dict = {}
    while time.monotonic() < deadline:
        try:
            view = httpx.get(router_url + "/v1/grid", timeout=2.0).json()
            if (not complete or view["complete"]) and view["embed"] >= embed:
                return
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.2)
    raise SetupError(f"the grid at {router_url} did not come up in {timeout:g}s: {view}")


def warm_up(stack: Stack) -> None:
    """A few requests of each kind before measuring: first-touch page faults and the lm_head's
    first product are not what a p99 bound is about."""
    import httpx
    import numpy as np

    from larql_edge.wire import embed as ew
    from larql_edge.wire import ffn as fw

    with httpx.Client(timeout=120) as h:
        for target in ("embed", "edge", "router"):
            url = stack.urls.get(target)
            if url:
                for i in range(5):
                    h.get(f"{url}/v1/embed/{i}")
        for target in ("embed", "router"):
            url = stack.urls.get(target)
            if not url:
                continue
            hidden = len(h.get(f"{url}/v1/embed/0").content) // 4
            x = np.zeros(hidden, np.float32)
            for _ in range(3):
                h.post(f"{url}/v1/logits", content=ew.encode_logits_request(x), headers={"content-type": "application/x-larql-ffn"})
            if target == "router":
                layers = int(h.get(f"{url}/v1/grid").json().get("num_layers") or 0)
                for layer in range(layers):
                    h.post(f"{url}/v1/walk-ffn", content=fw.encode_request(layer, x[None]), headers={"content-type": fw.CONTENT_TYPE})


# ---- locust ---------------------------------------------------------------------------------------

def run_locust(scenario: Scenario, stack: Stack, seconds: float, out: Path, *, prefix: str = "locust",
               clients: int | None = None) -> dict:
    """Locust headless for ``seconds``; returns {"returncode", "csv", "html", "summary", "log"}."""
    out.mkdir(parents=True, exist_ok=True)
    csv_prefix, html = out / prefix, out / f"{prefix}.html"
    summary = out / f"{prefix}-summary.json"
    n = clients or scenario.clients
    env = {**os.environ, **stack.env(), "LARQL_LOAD_SUMMARY": str(summary), "OPENBLAS_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    host = next(iter(stack.env().values()), None)
    argv = [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless", "-u", str(n), "-r", str(n),
            "-t", f"{int(seconds)}s", "--stop-timeout", "10", "--csv", str(csv_prefix), "--csv-full-history",
            "--html", str(html), "--only-summary", "--loglevel", "WARNING",
            *(["--host", host] if host else []), *scenario.users]
    log = out / f"{prefix}.log"
    say(f"locust: {n} users for {int(seconds)}s (log {log})")
    with open(log, "w") as fh:
        proc = subprocess.Popen(argv, stdout=fh, stderr=subprocess.STDOUT, env=env, cwd=ROOT, stdin=subprocess.DEVNULL)
        try:
            t0, every = time.monotonic(), min(10.0, max(1.0, seconds / 3))
            while True:
                try:
                    proc.wait(timeout=every)
                    break
                except subprocess.TimeoutExpired:
                    if time.monotonic() - t0 > seconds + 180:
                        raise
                    say(f"locust: {time.monotonic() - t0:.0f}s of {int(seconds)}s")
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    say(f"locust: done (exit {proc.returncode})")
    return {"returncode": proc.returncode, "csv": Path(f"{csv_prefix}_stats.csv"), "html": html, "log": log,
            "summary": json.loads(summary.read_text()) if summary.exists() else {}}


def read_stats(path: Path) -> dict[str, dict]:
    """locust's _stats.csv -> {name: {requests, failures, rps, p50_ms, p99_ms, max_ms}} (+ 'Aggregated')."""
    if not path.exists():
        raise SetupError(f"locust wrote no {path.name} (see its log)")
    def num(row: dict, col: str) -> float:
        v = row.get(col, "")
        return float(v) if v not in ("", "N/A") else float("nan")

    rows = {}
    with open(path, newline="") as fh:
        for row in csv.DictReader(fh):
            rows[row["Name"]] = {"type": row["Type"], "requests": int(row["Request Count"]),
                                 "failures": int(row["Failure Count"]), "rps": num(row, "Requests/s"),
                                 "p50_ms": num(row, "50%"), "p99_ms": num(row, "99%"), "max_ms": num(row, "Max Response Time")}
    return rows


# ---- the verdict ----------------------------------------------------------------------------------

def judge(scenario: Scenario, stats: dict[str, dict], summary: dict) -> tuple[bool, list[str]]:
    """(passed, lines): every check with its figure and bound."""
    lines: list[str] = []
    ok = True

    def check(passed: bool, text: str) -> None:
        nonlocal ok
        ok &= passed
        lines.append(f"{'PASS' if passed else 'FAIL'}  {text}")

    agg = stats.get("Aggregated", {"requests": 0, "failures": 0, "rps": 0.0})
    ratio = agg["failures"] / agg["requests"] if agg["requests"] else 1.0
    check(agg["requests"] > 0 and ratio <= scenario.max_failure_ratio,
          f"failures {agg['failures']} of {agg['requests']} ({ratio:.4f}; at most {scenario.max_failure_ratio})")
    check(agg["rps"] >= scenario.min_rps, f"throughput {agg['rps']:.1f} req/s (at least {scenario.min_rps:g})")
    names = {n for n in stats if n != "Aggregated"}
    for name, bound in scenario.p99_ms.items():
        row = stats.get(name)
        if row is None or row["requests"] == 0:
            check(False, f"{name}: no requests (bound {bound:g} ms)")
            continue
        check(row["p99_ms"] <= bound, f"{name}: p99 {row['p99_ms']:g} ms (at most {bound:g}), p50 {row['p50_ms']:g} ms, "
                                      f"{row['requests']} requests")
    for name in sorted(names - set(scenario.p99_ms)):
        check(False, f"{name}: {stats[name]['requests']} requests but no p99 bound in scenarios.toml")
    if scenario.min_hit_ratio is not None:
        counts = summary.get("x_cache", {})
        seen = counts.get("HIT", 0) + counts.get("MISS", 0)
        hit = counts.get("HIT", 0) / seen if seen else 0.0
        check(seen > 0 and hit >= scenario.min_hit_ratio and counts.get("other", 0) == 0,
              f"edge hit ratio {hit:.3f} over {seen} rows (at least {scenario.min_hit_ratio:g}; "
              f"{counts.get('other', 0)} without X-Cache)")
    return ok, lines


def write_verdict(out: Path, scenario: Scenario, seconds: float, passed: bool, lines: list[str], stats: dict,
                  extra: dict | None = None) -> None:
    text = [f"scenario {scenario.name}: {scenario.description}", f"duration {seconds:.0f} s, {scenario.clients} users: "
            + " ".join(scenario.users), *lines, f"verdict: {'PASS' if passed else 'FAIL'}"]
    (out / "verdict.txt").write_text("\n".join(text) + "\n")
    (out / "verdict.json").write_text(json.dumps({"scenario": scenario.name, "seconds": seconds, "passed": passed,
                                                  "checks": lines, "stats": stats, **(extra or {})}, indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    scenarios = load_scenarios()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="scenarios:\n" + "\n".join(f"  {s.name:8} {s.description}" for s in scenarios.values()))
    ap.add_argument("scenario", help="one of: " + ", ".join(sorted(scenarios)))
    ap.add_argument("-d", "--duration", type=parse_duration, default=60.0, help="how long locust runs (60s, 10m; default 60s)")
    ap.add_argument("--clients", type=int, help="concurrent users (default: the scenario's)")
    ap.add_argument("--vindex", type=Path, help="vindex the started servers load (default: the cached Gemma 3 270M f16)")
    ap.add_argument("--edge", dest="edge_kind", choices=("nginx", "varnish"), default="nginx", help="edge cache to start")
    ap.add_argument("--embed", help="URL of an embed server to use instead of starting one")
    ap.add_argument("--edge-url", help="URL of an edge cache to use instead of starting one")
    ap.add_argument("--router", help="URL of a router (with its shards) to use instead of starting one")
    ap.add_argument("--serve", help="URL of a larql-serve to use instead of starting one (port 8000)")
    ap.add_argument("--out", type=Path, help="report folder (default: a new temp folder)")
    ap.add_argument("--scenarios", type=Path, default=SCENARIOS, help="scenario file (default: loadtests/scenarios.toml)")
    args = ap.parse_args(argv)
    if args.scenarios != SCENARIOS:
        scenarios = load_scenarios(args.scenarios)
        if args.scenario not in scenarios:
            ap.error(f"{args.scenarios} has no scenario {args.scenario!r}")
    if args.scenario not in scenarios:
        ap.error(f"unknown scenario {args.scenario!r} (one of: {', '.join(sorted(scenarios))})")
    sc = scenarios[args.scenario]
    if args.clients:
        sc.clients = args.clients
    out = args.out or Path(tempfile.mkdtemp(prefix=f"larql-load-{sc.name}-"))
    out.mkdir(parents=True, exist_ok=True)
    given = {"embed": args.embed, "edge": args.edge_url, "router": args.router, "serve": args.serve}
    try:
        with running_stack(sc.needs, vindex=args.vindex, given={k: v for k, v in given.items() if v},
                           edge_kind=args.edge_kind, logdir=out / "servers") as stack:
            say("warming up")
            warm_up(stack)
            result = run_locust(sc, stack, args.duration, out)
        stats = read_stats(result["csv"])
    except (SetupError, TimeoutError, RuntimeError, FileNotFoundError) as e:
        print(f"loadtests/run.py: {e}", file=sys.stderr)
        return 2
    passed, lines = judge(sc, stats, result["summary"])
    write_verdict(out, sc, args.duration, passed, lines, stats, {"x_cache": result["summary"].get("x_cache")})
    print((out / "verdict.txt").read_text(), end="")
    print(f"reports: {out} (locust.html, locust_stats.csv, verdict.txt)")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
