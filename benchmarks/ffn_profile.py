"""Where one FFN shard request goes (issue #17): ``POST /v1/walk-ffn`` taken apart, stage by stage.

    python benchmarks/ffn_profile.py [--model gemma3-270m] [--rows 1,16] [--n 400]
                                     [--configs f32,q4k,gguf] [--out benchmarks/results/ffn-profile.txt]

Per configuration (f32 = the f16 vindex on the numpy backend; q4k, gguf on the compact backend) and
rows per request, medians of ``--n`` requests, in microseconds:

- in process, by CPU time of the one thread (``time.thread_time_ns``, so the machine's load does not
  count): the body decode (`wire.decode_request`), the shard's checks, the layer's compute
  (`Shard.compute`: the products and the activation) on one layer again and again (its weights stay
  in the core's cache) and on random layers (as the benchmark's clients ask: the weights come from
  L3/memory), the reply encode, and the whole handler's work (`routes.answer`: all of these, as the
  route calls them, into the reply buffer);
- over loopback HTTP against a real ``larql-ffn`` process (one client, one request at a time): the
  round trip (wall), the server's own time (its ``Server-Timing``), the server's CPU per request
  (its process CPU over the requests, so Sanic's parse and write count) and the client's CPU per
  request. Server CPU minus the handler's work is what Sanic and the event loop cost per request.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

for _v in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_v] = "1"
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
from _support import save_keeping_earlier, tree_cpu  # noqa: E402

from larql_edge.format.presets import ROLE_PRESETS  # noqa: E402
from larql_edge.net.h1_sync import HttpClient  # noqa: E402
from larql_edge.net.hops import server_seconds  # noqa: E402
from larql_edge.tools.grid.supervisor import Supervisor, pick_ports, role_env  # noqa: E402
from larql_edge.tools.slicer.cache import cached_slice, cached_vindex  # noqa: E402
from larql_edge.wire import ffn as fw  # noqa: E402

CONFIGS = {"f32": ("none", "numpy"), "q4k": ("q4k", "compact"), "gguf": ("gguf", "compact")}
HOST = "127.0.0.1"


def cpu_us(fn, n: int) -> float:
    ts = []
    for _ in range(n):
        t0 = time.thread_time_ns()
        fn()
        ts.append(time.thread_time_ns() - t0)
    return float(np.median(ts)) / 1e3


def in_process(path: Path, backend: str, rows: int, n: int) -> dict[str, float]:
    os.environ["LARQL_BACKEND"] = backend
    from larql_edge.model.backend import get_backend
    from larql_edge.roles.ffn import routes
    from larql_edge.roles.ffn.shard import Shard

    shard = Shard(path, None, backend=get_backend(backend))
    rng = np.random.default_rng(0)
    x = rng.standard_normal((rows, shard.hidden)).astype(np.float32)
    layer = shard.range.start + 3
    body = fw.encode_request(layer, x)
    req = fw.decode_request(body, shard.hidden)
    out = shard.compute(layer, req.x)
    for _ in range(20):
        routes.answer(shard, body, False)
    layers = iter(rng.integers(shard.range.start, shard.range.end + 1, 10 * n).tolist())
    return {
        "random": cpu_us(lambda: shard.compute(next(layers), req.x), n),
        "decode": cpu_us(lambda: fw.decode_request(body, shard.hidden), n),
        "check": cpu_us(lambda: shard.check(req), n),
        "compute": cpu_us(lambda: shard.compute(layer, req.x), n),
        "encode": cpu_us(lambda: fw.encode_response(layer, out, 0.1), n),  # the JSON-less encode of a result
        "handler": cpu_us(lambda: routes.answer(shard, body, False), n),
    }


def over_http(sup: Supervisor, name: str, path: Path, backend: str, rows_list, n: int) -> dict[int, dict[str, float]]:
    (port,) = pick_ports(HOST, [19701])
    role = sup.start(name, ["larql-ffn", str(path), "--port", str(port), "--host", HOST, "--blas-threads", "1"],
                     f"http://{HOST}:{port}", env={"LARQL_BACKEND": backend})
    sup.wait_ready([role], time.monotonic() + 600)
    hidden = int(__import__("json").loads(HttpClient().request("GET", role.url + "/v1/stats").content)["hidden_size"])
    res = {}
    c = HttpClient()
    try:
        for rows in rows_list:
            rng = np.random.default_rng(1)
            x = rng.standard_normal((rows, hidden)).astype(np.float32)
            bodies = [fw.encode_request(int(i), x) for i in rng.integers(0, 18, n)]
            hdr = {"content-type": fw.CONTENT_TYPE}
            for b in bodies[:30]:
                c.request("POST", role.url + "/v1/walk-ffn", content=b, headers=hdr)
            wall, server, client = [], [], []
            cpu0 = tree_cpu(role.popen.pid)
            for b in bodies:
                t0, c0 = time.perf_counter_ns(), time.thread_time_ns()
                r = c.request("POST", role.url + "/v1/walk-ffn", content=b, headers=hdr)
                wall.append(time.perf_counter_ns() - t0)
                client.append(time.thread_time_ns() - c0)
                server.append(server_seconds(r) * 1e9)
                if r.status_code != 200:
                    raise RuntimeError(f"walk-ffn {r.status_code}")
            cpu = (tree_cpu(role.popen.pid) - cpu0) / n * 1e6
            res[rows] = {"wall": float(np.median(wall)) / 1e3, "server_timing": float(np.median(server)) / 1e3,
                         "server_cpu": cpu, "client_cpu": float(np.median(client)) / 1e3}
    finally:
        c.close()
        role.stop()
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--rows", default="1,16")
    ap.add_argument("--n", type=int, default=400)
    ap.add_argument("--configs", default="f32,q4k,gguf")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "ffn-profile.txt"))
    args = ap.parse_args()
    rows_list = [int(r) for r in args.rows.split(",")]
    configs = args.configs.split(",")
    lines: list[str] = []

    def say(s: str = "") -> None:
        print(s, flush=True)
        lines.append(s)

    say(f"FFN shard request profile: {args.model}, {time.strftime('%Y-%m-%d %H:%M')}, load average at start "
        f"{os.getloadavg()[0]:.1f}; medians of {args.n} requests, microseconds; 1 BLAS/kernel thread")
    paths = {k: cached_slice(cached_vindex(args.model, dtype="f16", quant=CONFIGS[k][0], log=lambda m: None),
                             ROLE_PRESETS["ffn"]) for k in configs}
    # in-process figures in a child per configuration (each backend is chosen once per process)
    for k in configs:
        for rows in rows_list:
            code = (f"import sys, json; sys.path.insert(0, {str(ROOT / 'benchmarks')!r}); import ffn_profile as p; "
                    f"print(json.dumps(p.in_process(p.Path({str(paths[k])!r}), {CONFIGS[k][1]!r}, {rows}, {args.n})))")
            r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                               env={**os.environ, "LARQL_BACKEND": CONFIGS[k][1], "LARQL_KERNEL_THREADS": "1"})
            if r.returncode:
                raise RuntimeError(r.stderr[-2000:])
            d = __import__("json").loads(r.stdout.strip().splitlines()[-1])
            say(f"  in process  {k:<5} {rows:>2} row(s): decode {d['decode']:6.1f}  check {d['check']:5.1f}  "
                f"compute {d['compute']:7.1f} (random layers {d['random']:7.1f})  encode {d['encode']:5.1f}  | "
                f"handler's work {d['handler']:7.1f}  (CPU us)")
    env = role_env(dict(os.environ), PYTHONUNBUFFERED="1", LARQL_KERNEL_THREADS="1")
    sup = Supervisor(Path(tempfile.mkdtemp(prefix="larql-ffnprof-")), env)
    try:
        for k in configs:
            for rows, d in over_http(sup, f"ffn-{k}", paths[k], CONFIGS[k][1], rows_list, args.n).items():
                say(f"  over HTTP   {k:<5} {rows:>2} row(s): round trip {d['wall']:7.1f}  Server-Timing "
                    f"{d['server_timing']:7.1f}  server CPU/request {d['server_cpu']:7.1f}  client CPU/request "
                    f"{d['client_cpu']:6.1f}")
    finally:
        sup.stop_all()
    say(f"  load average at end {os.getloadavg()[0]:.1f}")
    save_keeping_earlier(args.out, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
