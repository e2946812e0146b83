"""What a member says about itself: the vindex it serves, and how much memory it holds."""

from __future__ import annotations

import hashlib
import json

import psutil

from larql_edge.format.vindex import Vindex


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
