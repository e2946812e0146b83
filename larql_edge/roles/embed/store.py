"""The embedding table, f16 at rest: a read-only memory map decoded row by row, plus an L1 hot cache.

The table is never copied whole: a lookup decodes only the rows asked for (f16 -> f32, times
``embed_scale``), so resident memory grows with the rows actually used, not with the vocabulary.
An f32 table (a vindex extracted as f32) is read the same way, without the decode.

Hot-cache policy (the L1 of the most used ids, ``--hot-cache N``, default 5000; 0 disables it):

- every lookup counts its id;
- while the cache has room, a missed id is admitted: the first N distinct ids fill it;
- every N lookups (at least 1024) the N most counted ids are recomputed (ties at the N-th count
  all count as wanted); cached ids that fell out of that set are evicted and from then on only ids
  in the set are admitted (on their next use);
- counts halve at every recompute, so the set follows the traffic instead of its distant past.

Entries are the finished little-endian f32 row bytes, exactly what ``GET /v1/embed/{id}`` sends,
so a hit costs a dictionary lookup. One cache per worker process (``/v1/stats`` shows the
worker's own figures; ``/metrics`` adds the workers up).
"""

from __future__ import annotations

from array import array

import numpy as np

from larql_edge.format.vindex import RowFile

F32 = np.dtype("<f4")


class HotCache:
    """Frequency-admitted cache of encoded rows: see the module docstring for the policy."""

    def __init__(self, vocab: int, capacity: int, min_period: int = 1024):
        self.capacity = max(0, int(capacity))
        self.period = max(self.capacity, min_period)
        self.entries: dict[int, bytes] = {}
        # array, not numpy: incrementing one element is ~20x cheaper, and numpy still reads it in place.
        # Empty when the cache is off (capacity 0): nothing is ever counted then.
        self.counts = array("I", bytes(4 * vocab) if self.capacity else b"")
        self.wanted: np.ndarray | None = None  # bool[vocab] once the first recompute ran
        self.hits = 0
        self.misses = 0
        self.evictions = 0
        self._since = 0

    def __len__(self) -> int:
        return len(self.entries)

    @property
    def nbytes(self) -> int:
        return sum(len(b) for b in self.entries.values())

    def get(self, i: int) -> bytes | None:
        if not self.capacity:
            self.misses += 1
            return None
        self.counts[i] += 1
        self._since += 1
        if self._since >= self.period:
            self._tick(0)
        b = self.entries.get(i)
        if b is None:
            self.misses += 1
        else:
            self.hits += 1
        return b

    def count_many(self, ids: np.ndarray) -> None:
        """Count a batch of lookups served without the per-id path (long prefills)."""
        if not self.capacity:
            self.misses += int(ids.size)
            return
        np.add.at(np.frombuffer(self.counts, dtype=np.uint32), ids, 1)
        hit = sum(1 for i in ids.tolist() if i in self.entries)
        self.hits += hit
        self.misses += int(ids.size) - hit
        self._tick(int(ids.size))

    def admit(self, i: int, row: bytes) -> None:
        if not self.capacity or len(self.entries) >= self.capacity:
            return
        if self.wanted is not None and not self.wanted[i]:
            return
        self.entries[i] = row

    def _tick(self, n: int) -> None:
        self._since += n
        if self._since >= self.period:
            self._since = 0
            self.recompute()

    def recompute(self) -> None:
        """Recompute the most used ids, evict the cached ids that fell out, age the counts."""
        counts = np.frombuffer(self.counts, dtype=np.uint32)  # a view: halving below ages in place
        # The k-th largest count from a histogram of counts: selection (argpartition) degrades to
        # ~100 ms on the many ties of a token stream, a histogram costs well under a millisecond.
        above = np.cumsum(np.bincount(counts)[::-1])[::-1]  # above[v]: ids counted at least v times
        reach = np.flatnonzero(above[1:] >= self.capacity)
        threshold = int(reach[-1]) + 1 if reach.size else 1
        wanted = counts >= threshold  # ties at the threshold may make it a little larger than capacity
        for i in [i for i in self.entries if not wanted[i]]:
            del self.entries[i]
            self.evictions += 1
        self.wanted = wanted
        counts >>= 1

    def stats(self) -> dict:
        total = self.hits + self.misses
        return {
            "capacity": self.capacity,
            "size": len(self.entries),
            "bytes": self.nbytes,
            "hits": self.hits,
            "misses": self.misses,
            "evictions": self.evictions,
            "hit_rate": round(self.hits / total, 6) if total else None,
            "policy": "most-used ids; recomputed every %d lookups, counts halve each time" % self.period,
        }


class EmbeddingStore:
    """Scaled f32 rows out of an f16 (or f32) ``[vocab, hidden]`` table: a memory map, or a
    `format.vindex.RowFile` read with pread (what the server uses: nothing of the table stays resident)."""

    # Above this many ids per request, decode in one vectorised gather instead of id by id.
    VECTOR_THRESHOLD = 16

    def __init__(self, table: np.ndarray | RowFile, scale: float, hot_capacity: int = 5000):
        if table.ndim != 2:
            raise ValueError("embedding table must be [vocab, hidden]")
        # A plain ndarray view of the memory map (no copy): numpy's memmap subclass costs
        # microseconds per row access in bookkeeping. The table itself is never materialised.
        self.table: np.ndarray | RowFile = table.view(np.ndarray) if isinstance(table, np.memmap) else table
        self.vocab, self.hidden = table.shape
        self.scale = np.float32(scale)
        self.cache = HotCache(self.vocab, hot_capacity)

    @property
    def storage_dtype(self) -> str:
        return "f16" if self.table.dtype.itemsize == 2 else "f32"

    @property
    def nbytes(self) -> int:
        return int(self.table.nbytes)

    def _decode(self, i: int) -> np.ndarray:
        return self.table[i].astype(np.float32) * self.scale

    def row_bytes(self, i: int) -> bytes:
        """Row ``i`` as little-endian f32 bytes (the caller has checked 0 <= i < vocab)."""
        c = self.cache
        b = c.get(i)
        if b is None:
            b = self._decode(i).astype(F32, copy=False).tobytes()
            c.admit(i, b)
        return b

    def row(self, i: int) -> np.ndarray:
        return np.frombuffer(self.row_bytes(i), dtype=F32)

    def rows_bytes(self, ids: np.ndarray) -> list[bytes] | bytes:
        """Rows for ``ids`` as encoded bytes: a list of per-row bytes, or one block for long inputs."""
        if ids.size <= self.VECTOR_THRESHOLD:
            return [self.row_bytes(int(i)) for i in ids.tolist()]
        self.cache.count_many(ids)
        return self.gather(ids)

    def gather(self, ids: np.ndarray) -> bytes:
        """The rows of ``ids`` as one f32 block, read and scaled without the hot cache (which is the
        event loop's): what may run in the compute thread for a long request."""
        block = self.table[ids].astype(np.float32)
        block *= self.scale
        return block.tobytes()

    def rows(self, ids: np.ndarray) -> np.ndarray:
        parts = self.rows_bytes(ids)
        raw = parts if isinstance(parts, bytes) else b"".join(parts)
        return np.frombuffer(raw, dtype=F32).reshape(len(ids), self.hidden)
