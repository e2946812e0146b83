"""larql-grid up: the whole three-tier grid on this machine, as local processes (no Docker).
larql-grid certs: the grid's CA and a certificate per service, for TLS (`larql_edge.tools.grid.pki`).

    larql-grid up [--model gemma3-270m] [--quant none|q4k|gguf] [--shards 2] [--replicas 1]
    larql-grid certs DIR [NAME[=HOST,...] ...]

Builds the vindex on first use (cached), starts the embed server, the FFN shards and the router,
waits until every layer is served, prints the URLs and a ready-to-paste ``larql generate``
command, and stops everything cleanly on Ctrl-C.
"""

from __future__ import annotations

import argparse
import os
import secrets
import shlex
import shutil
import signal
import sys
import time
from pathlib import Path

from larql_edge.config import Flags
from larql_edge.console import run_command
from larql_edge.errors import LarqlError
from larql_edge.format.index import QUANTS
from larql_edge.format.layers import split_even
from larql_edge.format.presets import ROLE_PRESETS
from larql_edge.tools.grid.pki import add_certs_parser
from larql_edge.tools.grid.supervisor import Supervisor, pick_ports, role_env

ROLES = ("embed", "ffn", "client")


def _say(*parts: object) -> None:
    # Flushed: a pipe or a log file (not a terminal) sees every stage as it happens.
    print(*parts, flush=True)


def console_script(name: str) -> str:
    """How to run one of the project's commands: by name when PATH finds this installation's, else
    by path beside this interpreter (``.venv/bin/larql-grid`` run without activating the venv)."""
    here = Path(sys.executable).parent / name
    if not here.is_file() or shutil.which(name) == str(here):
        return name
    rel = os.path.relpath(here)
    return rel if not rel.startswith("..") else str(here)


def role_vindexes(model: str, vindex: str | None, log=_say, quant: str = "none") -> dict[str, Path]:
    """The vindex folder each role runs from: its preset slice of the cached extraction (``quant``:
    a float f16 vindex, LARQL's q4k layout, or larql-edge's gguf one).

    A ``--vindex`` given by the user is used as it is for every role (each loads only what it needs).
    """
    if vindex:
        path = Path(vindex)
        return {role: path for role in ROLES}
    from larql_edge.tools.slicer.cache import cached_slice, cached_vindex

    what = "" if quant == "none" else f" {quant}"
    log(f"larql-grid: preparing the {model}{what} vindex and its role slices (built once, then cached)...")
    full = cached_vindex(model, level="all", dtype="f16", quant=quant, progress=True, log=log)
    return {role: cached_slice(full, ROLE_PRESETS[role]) for role in ROLES}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="larql-grid", description="Run a whole larql grid on this machine.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    up = sub.add_parser("up", help="start embed server, FFN shards and router as local processes")
    f = Flags(up)
    # Env twins are LARQL_GRID_*: LARQL_SHARDS, LARQL_PORT... belong to the roles' own flags.
    g = lambda flag: "LARQL_GRID_" + flag.lstrip("-").replace("-", "_").upper()  # noqa: E731
    f.add("--model", default="gemma3-270m", env=g("--model"), help="packaged model alias or GGUF path to build the vindex from")
    f.add("--vindex", default=None, env=g("--vindex"), help="use this vindex folder for every role instead of building one")
    f.choice("--quant", choices=QUANTS, default="none", env=g("--quant"),
             help="the vindex built from --model: none (f16), q4k (LARQL's Q4_K/Q6_K layout) or gguf "
                  "(every tensor in its GGUF block type); roles compute on it as stored")
    f.add("--shards", type=int, default=2, env=g("--shards"), help="FFN shards (contiguous layer ranges)")
    f.add("--replicas", type=int, default=1, env=g("--replicas"), help="processes per layer range")
    f.add("--host", default="127.0.0.1", env=g("--host"), help="address every role listens on")
    f.add("--router-port", type=int, default=9090, env=g("--router-port"), help="router port (the next free one if taken)")
    f.add("--embed-port", type=int, default=8082, env=g("--embed-port"), help="embed server port (the next free one if taken)")
    f.add("--ffn-port", type=int, default=8080, env=g("--ffn-port"), help="first FFN shard port (shards take the next free ones)")
    f.add("--grid-key", default=None, secret=True, help="the grid key (default: a fresh random key per run)")
    f.add("--blas-threads", type=int, default=1, env=g("--blas-threads"), help="BLAS threads per role process")
    f.add("--ready-timeout", type=float, default=600.0, env=g("--ready-timeout"), help="seconds to wait for the grid to come up")
    f.add("--log-dir", default=None, env=g("--log-dir"), help="role logs (default: a new folder under the cache)")
    up.set_defaults(func=up_command)
    add_certs_parser(sub)
    return parser


def up_command(args: argparse.Namespace) -> int:
    if args.shards < 1 or args.replicas < 1:
        raise LarqlError("--shards and --replicas must be at least 1")
    t0 = time.monotonic()
    paths = role_vindexes(args.model, args.vindex, quant=args.quant)
    from larql_edge.format.vindex import Vindex

    n_layers = Vindex.open(paths["ffn"]).num_layers
    try:
        ranges = split_even(n_layers, args.shards)
    except ValueError as e:
        raise LarqlError(str(e)) from None

    host = args.host
    router_port, embed_port = pick_ports(host, [args.router_port, args.embed_port])
    ffn_ports = pick_ports(host, [args.ffn_port] * (len(ranges) * args.replicas), {router_port, embed_port})
    url = lambda port: f"http://{host}:{port}"  # noqa: E731
    router_url = url(router_port)

    from larql_edge.config import cache_dir

    log_dir = Path(args.log_dir) if args.log_dir else cache_dir() / "grid-logs" / time.strftime("%Y%m%d-%H%M%S")
    blas = str(args.blas_threads)
    env = role_env(dict(os.environ), OPENBLAS_NUM_THREADS=blas, OMP_NUM_THREADS=blas, MKL_NUM_THREADS=blas,
                   PYTHONUNBUFFERED="1",
                   LARQL_GRID_KEY=args.grid_key or secrets.token_urlsafe(24))  # to children by env, never argv
    sup = Supervisor(log_dir, env)
    common = ["--host", host, "--blas-threads", blas]

    stopping = False

    def on_signal(signum, frame):
        nonlocal stopping
        if stopping:
            return
        stopping = True
        raise KeyboardInterrupt

    # Explicitly, for both: a shell starting us in the background hands us SIGINT ignored. What was
    # there comes back when we return: a caller of main() (the tests) must not be left with them ignored.
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        embed_argv = [*_role("embed"), str(paths["embed"]), "--port", str(embed_port), *common,
                      "--join", router_url, "--public-url", url(embed_port)]
        router_argv = [*_role("router"), "--port", str(router_port), *common]
        router = sup.start("router", router_argv, router_url)
        embed = sup.start("embed", embed_argv, url(embed_port))
        shards = []
        ports = iter(ffn_ports)
        for rng in ranges:
            for i in range(args.replicas):
                port = next(ports)
                name = f"ffn-{rng}" + (f"-{i}" if args.replicas > 1 else "")
                shards.append(sup.start(name, [*_role("ffn"), str(paths["ffn"]), "--layers", str(rng), "--port", str(port),
                                               *common, "--join", router_url, "--public-url", url(port)],
                                        url(port), layers=str(rng)))
        _say(f"larql-grid: starting router, embed server and {len(shards)} FFN shard(s); logs in {log_dir}")
        deadline = time.monotonic() + args.ready_timeout
        sup.wait_ready(sup.roles, deadline, log=_say)
        _wait_complete(router_url, deadline)
        _print_ready(paths["client"], router, embed, shards, time.monotonic() - t0)
        while True:
            time.sleep(0.5)
            for r in sup.exited():
                if not r.info.get("reported"):
                    r.info["reported"] = True
                    code = r.popen.returncode if r.popen else None
                    print(f"larql-grid: {r.name} exited (code {code}); last log lines:\n{r.log_tail(10)}",
                          file=sys.stderr, flush=True)
                    if r is router:
                        raise LarqlError("the router stopped; stopping the grid")
    except KeyboardInterrupt:
        print("\nlarql-grid: stopping...", file=sys.stderr, flush=True)
        return 0
    except (RuntimeError, TimeoutError) as e:
        raise LarqlError(str(e)) from None
    finally:
        # A second Ctrl-C (or a signal relayed by a wrapper) must not cut the clean-up short.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        sup.stop_all()
        for sig, handler in before.items():
            if handler is not None:  # None: set outside Python, which cannot be put back from here
                signal.signal(sig, handler)
        print("larql-grid: stopped.", file=sys.stderr, flush=True)


def _wait_complete(router_url: str, deadline: float) -> None:
    import httpx

    view: dict = {}
    while time.monotonic() < deadline:
        try:
            view = httpx.get(router_url + "/v1/grid", timeout=2.0).json()
            if view.get("complete") and view.get("embed", 0) >= 1:
                return
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.2)
    raise TimeoutError(f"the grid did not cover every layer in time (gaps: {view.get('gaps')}, embed: {view.get('embed')})")


def _print_ready(client_vindex: Path, router, embed, shards, seconds: float) -> None:
    lines = [f"larql-grid: ready in {seconds:.1f}s", f"  router  {router.url}  (pid {router.pid}; members: {router.url}/v1/grid)",
             f"  embed   {embed.url}  (pid {embed.pid})"]
    lines += [f"  ffn     {s.url}  layers {s.info['layers']}  (pid {s.pid})" for s in shards]
    cmd = shlex.join([console_script("larql"), "generate", "--vindex", str(client_vindex), "--ffn", router.url,
                      "--prompt", "The capital of France is", "--max-tokens", "32"])
    lines += ["", "Generate through the grid:", f"  {cmd}", "", "Ctrl-C stops the grid."]
    print("\n".join(lines), flush=True)


def _role(name: str) -> list[str]:
    """The role of THIS installation, run by this interpreter: by name from PATH a grid started without
    the venv on PATH failed, or started another installation's larql-router."""
    return [sys.executable, "-P", "-m", f"larql_edge.roles.{name}.cli"]  # -P: not a larql_edge of the cwd


def main(argv: list[str] | None = None) -> int:
    return run_command("larql-grid", build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
