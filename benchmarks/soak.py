"""Soak: the whole stack under steady load for 10 minutes, with a verdict.

    python benchmarks/soak.py                                  # 10 min, writes benchmarks/results/soak.txt
    python benchmarks/soak.py --duration 2m --out /tmp/soak.txt

Starts on 127.0.0.1 (loadtests/run.py's stack): an embed server, the nginx edge in front of it, a
router and two FFN shards, all on Gemma 3 270M f16 with 1 BLAS thread each; then runs the `soak`
scenario of loadtests/scenarios.toml (embed rows and logits, edge rows, decode steps through the
grid) twice with locust: a warm-up (--warmup, default 60 s: fills the hot cache, the edge cache
and the allocators' pools) and the measured run (--duration). The resident memory (RSS, the
process and its children; and its private part, without mmap'd files) of every server is read
after the warm-up and at the end.

Verdict (exit 1 on a miss): the scenario's thresholds (failures 0, p99 per route, throughput, edge
hit ratio), every server still running, and no server's private RSS growing by more than
RSS_GROWTH_BOUND (10% + 32 MiB) between the two readings. Writes the figures to --out and the locust
reports (CSV, HTML) next to it in a folder.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "loadtests"))

import psutil  # noqa: E402
import run as loadrun  # noqa: E402  (loadtests/run.py)
from _support import process_tree  # noqa: E402  (benchmarks/ is the script's folder)

RSS_GROWTH_RATIO = 0.10
RSS_GROWTH_SLACK = 32 << 20
RSS_GROWTH_BOUND = f"{RSS_GROWTH_RATIO:.0%} + {RSS_GROWTH_SLACK >> 20} MiB"


def tree_memory(pid: int) -> tuple[int, int]:
    """(RSS, private RSS) in bytes of a process and all its descendants (Sanic workers, nginx's).

    RSS counts the pages of mmap'd files too: the vindex weights (the embed server maps its 335 MB
    f16 table and reads rows on demand), which grow as more token ids get touched and stay
    reclaimable page cache. The private part (RSS minus file-backed and shared pages) is what a
    leak grows, so the bound applies to it; both are reported.
    """
    rss = private = 0
    for p in process_tree(pid):
        try:
            m = p.memory_info()
        except psutil.NoSuchProcess:
            continue
        rss += m.rss
        private += m.rss - getattr(m, "shared", 0)
    return rss, private


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-d", "--duration", type=loadrun.parse_duration, default=600.0, help="measured run (default 10m)")
    ap.add_argument("--warmup", type=loadrun.parse_duration, default=60.0, help="unmeasured run first (default 60s)")
    ap.add_argument("--vindex", type=Path, help="default: the cached Gemma 3 270M f16")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "soak.txt")
    args = ap.parse_args(argv)
    sc = loadrun.load_scenarios()["soak"]
    reports = Path(tempfile.mkdtemp(prefix="larql-soak-"))
    t0 = time.time()
    with loadrun.running_stack(sc.needs, vindex=args.vindex, given={}, edge_kind="nginx", logdir=reports / "servers") as stack:
        loadrun.warm_up(stack)
        warm = loadrun.run_locust(sc, stack, args.warmup, reports, prefix="warmup")
        mem_start = {name: tree_memory(pid) for name, pid in stack.pids.items()}
        result = loadrun.run_locust(sc, stack, args.duration, reports)
        mem_end = {name: tree_memory(pid) for name, pid in stack.pids.items()}
        alive = {name: psutil.pid_exists(pid) for name, pid in stack.pids.items()}
    stats = loadrun.read_stats(result["csv"])
    passed, lines = loadrun.judge(sc, stats, result["summary"])
    mib = 1 / 2**20
    for name in stack.pids:
        (rss_a, a), (rss_b, b) = mem_start[name], mem_end[name]
        ok = alive[name] and a > 0 and b <= a * (1 + RSS_GROWTH_RATIO) + RSS_GROWTH_SLACK
        passed &= ok
        lines.append(f"{'PASS' if ok else 'FAIL'}  memory {name}: private {a * mib:.1f} -> {b * mib:.1f} MiB "
                     f"({(b - a) * mib:+.1f}; growth at most {RSS_GROWTH_BOUND}), RSS {rss_a * mib:.1f} -> {rss_b * mib:.1f} MiB"
                     + ("" if alive[name] else "; the process died"))
    loadrun.write_verdict(reports, sc, args.duration, passed, lines, stats,
                          {"memory_start": mem_start, "memory_end": mem_end, "x_cache": result["summary"].get("x_cache")})

    agg = stats["Aggregated"]
    table = [f"{'route':36} {'requests':>9} {'failures':>8} {'p50 ms':>8} {'p99 ms':>8} {'bound':>7}"]
    for name, row in sorted(stats.items()):
        if name == "Aggregated":
            continue
        table.append(f"{name:36} {row['requests']:9d} {row['failures']:8d} {row['p50_ms']:8g} {row['p99_ms']:8g} "
                     f"{sc.p99_ms.get(name, float('nan')):7g}")
    table.append(f"{'all':36} {agg['requests']:9d} {agg['failures']:8d} {agg['p50_ms']:8g} {agg['p99_ms']:8g}")
    cache = result["summary"].get("x_cache") or {}
    seen = cache.get("HIT", 0) + cache.get("MISS", 0)
    text = [
        "# benchmarks/soak.py: the stack under steady load (loadtests/scenarios.toml, scenario soak)",
        f"# started {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(t0))}; 2-core machine shared with other work,",
        "# Gemma 3 270M f16, 1 BLAS thread per server, locust on the same machine; servers on 127.0.0.1",
        f"load: {sc.clients} users ({' '.join(sc.users)}), warm-up {args.warmup:.0f} s, measured {args.duration:.0f} s",
        f"throughput: {agg['rps']:.1f} req/s; errors: {agg['failures']} of {agg['requests']} requests "
        f"(warm-up: {loadrun.read_stats(warm['csv'])['Aggregated']['failures']} failures)",
        f"edge hit ratio: {cache.get('HIT', 0) / seen if seen else 0:.3f} over {seen} rows",
        "",
        *table,
        "",
        f"memory per server after the warm-up -> at the end, MiB (bound: private growth at most {RSS_GROWTH_BOUND};",
        "RSS includes the mmap'd vindex pages read so far, which grow with the token ids touched):",
        f"  {'server':16} {'private':>18} {'RSS':>20}",
        *[f"  {name:16} {mem_start[name][1] * mib:7.1f} -> {mem_end[name][1] * mib:7.1f} "
          f"{mem_start[name][0] * mib:8.1f} -> {mem_end[name][0] * mib:7.1f}" for name in stack.pids],
        "",
        "checks:",
        *[f"  {line}" for line in lines],
        f"verdict: {'PASS' if passed else 'FAIL'}",
        f"(locust reports: {reports})",
    ]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(text) + "\n")
    print("\n".join(text))
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
