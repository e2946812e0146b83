"""What a member says about itself: the vindex it serves, and how much memory it holds."""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass

import psutil

from larql_edge.config import Flags
from larql_edge.errors import ChecksumMismatch
from larql_edge.format.vindex import Vindex

# `--verify-weights auto` checks the checksums at start when the files add up to at most this: sha256
# runs at ~0.5-1 GB/s a core, so auto costs at most a few seconds (Gemma 3 270M f32: 1.5 GB in all).
VERIFY_AUTO_BYTES = 2 << 30


def vindex_hash(vx: Vindex) -> str:
    """A short id of the vindex a role serves: sha256 over index.json's per-file checksums.

    Cheap (no weight file is read) and the same on every machine that holds the same files, so
    the router can tell replicas that serve the same artefact from ones that do not.
    """
    sums = vx.checksums
    basis = json.dumps(sums, sort_keys=True) if sums else json.dumps(vx.index.to_json(), sort_keys=True, default=str)
    return hashlib.sha256(basis.encode()).hexdigest()[:16]


def rss_bytes() -> int:
    return int(psutil.Process().memory_info().rss)


def release_freed_memory() -> None:
    """Hand memory freed by loading back to the OS (glibc keeps it otherwise).

    Parsing Gemma's 13 MB tokenizer.json peaks at ~300 MB of heap that the tokenizer then frees;
    glibc keeps those pages mapped, so a server's RSS stays ~190 MB above what it uses. Called once
    after loading; a no-op where there is no glibc.
    """
    import ctypes

    # The process's own symbol table (libc is in it): find_library("c") would run ldconfig.
    try:
        trim = getattr(ctypes.CDLL(None), "malloc_trim", None)
    except OSError:
        return
    if trim is not None:
        trim(0)


@dataclass(frozen=True)
class WeightsCheck:
    """What ``--verify-weights`` did at start: published in ``/v1/stats`` as ``weights_verified``."""

    verified: bool
    seconds: float | None = None
    bytes: int = 0

    def as_json(self) -> dict:
        return {"verified": self.verified, "seconds": None if self.seconds is None else round(self.seconds, 3),
                "bytes": self.bytes}


def add_verify_flag(flags: Flags) -> None:
    flags.choice("--verify-weights", choices=("auto", "on", "off"), default="auto",
                 help="check the vindex's checksums before serving (auto: when its files are at most "
                      f"{VERIFY_AUTO_BYTES >> 30} GiB, a few seconds); a mismatch stops the server")


def verify_weights(vx: Vindex, mode: str) -> WeightsCheck:
    """Recompute the checksums index.json records (`Vindex.verify`) when ``mode`` asks for it.

    Raises ChecksumMismatch naming each missing or corrupt file: a damaged file is refused at start
    instead of being served (and blamed on callers) later."""
    total = sum((vx.path / name).stat().st_size for name in vx.checksums if (vx.path / name).is_file())
    if mode == "off" or (mode == "auto" and total > VERIFY_AUTO_BYTES):
        return WeightsCheck(False, None, total)
    t0 = time.perf_counter()
    problems = vx.verify()
    if problems:
        raise ChecksumMismatch(problems)
    return WeightsCheck(True, time.perf_counter() - t0, total)
