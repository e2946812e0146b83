"""Slicing every preset of the Gemma 3 270M vindex against `cp -r` of the same folder, same run.

    python benchmarks/slice.py [--model gemma3-270m]
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import tempfile
import time

from larql_edge.format.presets import PRESETS  # noqa: E402
from larql_edge.tools.slicer.cache import cached_vindex  # noqa: E402
from larql_edge.tools.slicer.slice import slice_vindex  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    src = cached_vindex(a.model, log=lambda m: None)
    size = sum(f.stat().st_size for f in src.iterdir())
    print(f"# slice  model={a.model}  vindex={size / 1e6:.0f} MB  presets={','.join(PRESETS)}")
    best_cp = best_slice = float("inf")
    with tempfile.TemporaryDirectory(dir=src.parent) as d:  # same filesystem as the cache
        for i in range(a.repeat):
            t0 = time.perf_counter()
            subprocess.run(["cp", "-r", str(src), f"{d}/cp{i}"], check=True)
            subprocess.run(["sync"], check=True)
            best_cp = min(best_cp, time.perf_counter() - t0)
            shutil.rmtree(f"{d}/cp{i}")
            t0 = time.perf_counter()
            for p in PRESETS:
                slice_vindex(src, f"{d}/s{i}/{p}", preset=p, log=lambda m: None)
            subprocess.run(["sync"], check=True)
            best_slice = min(best_slice, time.perf_counter() - t0)
    print(f"cp -r (best of {a.repeat})            : {best_cp * 1000:8.1f} ms")
    print(f"slice all {len(PRESETS)} presets (best of {a.repeat}) : {best_slice * 1000:8.1f} ms")
    print(f"ratio slice/cp                   : {best_slice / best_cp:8.3f}x  (target <= 0.05x)")


if __name__ == "__main__":
    main()
