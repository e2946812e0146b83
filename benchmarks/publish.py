"""Publish the Gemma 3 270M vindex with its default slices, then publish it again unchanged, against
the Hub-protocol test server: bytes uploaded the second time divided by the first (target <= 0.01).

    python benchmarks/publish.py
"""

from __future__ import annotations

import os
import tempfile
import time

os.environ.update(HF_HUB_DISABLE_XET="1", HF_HUB_DISABLE_TELEMETRY="1")

from larql_edge.testing.hubserver import HubServer  # noqa: E402
from larql_edge.tools.slicer.cache import cached_vindex  # noqa: E402
from larql_edge.tools.slicer.publish import publish  # noqa: E402


def main() -> None:
    src = cached_vindex("gemma3-270m", log=lambda m: None)
    with tempfile.TemporaryDirectory() as home:
        os.environ["HF_HOME"] = home
        with HubServer() as hub:
            runs = []
            for label in ("first publish", "republish unchanged"):
                hub.clear_requests()
                t0 = time.perf_counter()
                publish(src, "bench/gemma-3-270m-vindex", endpoint=hub.url, token=hub.token, log=lambda m: None)
                dt = time.perf_counter() - t0
                sent = sum(r.body_size for r in hub.requests if r.method in ("POST", "PUT"))
                runs.append((label, hub.lfs_bytes_uploaded(), sent, dt))
    print("# publish  model=gemma3-270m  slices=client,attn,embed,server,browse  server=tests/hubserver")
    for label, lfs, sent, dt in runs:
        print(f"{label:<20}: LFS {lfs / 1e6:9.1f} MB, all request bodies {sent / 1e6:9.1f} MB, {dt:6.1f} s")
    print(f"ratio second/first (all bytes sent): {runs[1][2] / runs[0][2]:.5f}  (target <= 0.01)")


if __name__ == "__main__":
    main()
