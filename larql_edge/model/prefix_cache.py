"""A prefix cache of KV blocks shared across requests (larql-serve's prompt caching).

A multi-turn chat re-sends its whole history every turn; without this, every turn prefills it again
through the grid (a round trip per layer per chunk). Here the keys and values of a finished (or fully
prefilled) sequence are kept in blocks of ``BLOCK`` positions, each named by its tokens and every
token before it (a chained hash, as vLLM's automatic prefix caching), so a later prompt that starts
with the same tokens finds them and copies them into its own `SeqCache` instead of prefilling them.

- Only whole blocks are kept, and a prompt's last token is always prefilled (its row gives the next
  token's logits), so at most ``len(prompt) - 1`` positions come from the cache, rounded down to a block.
- Bounded by ``budget_bytes`` (what the KV memory budget leaves after the active sequences' caches):
  least recently used blocks go first. A block used by a lookup is used again, and so are all the
  blocks before it, so a chain is evicted from its end.
- Copies, not shared pages: `SeqCache` is one preallocated array per layer (the batch engine's layout,
  untouched), and a copy of a few thousand positions is a memcpy, small beside a grid round trip.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from larql_edge.model.batch import SeqCache

BLOCK = 16  # positions per block


class PrefixCache:
    def __init__(self, budget_bytes: int, bytes_per_token: int, block: int = BLOCK):
        self.block = block
        self.budget = max(0, int(budget_bytes))
        self.block_bytes = bytes_per_token * block
        self._blocks: OrderedDict[int, tuple[tuple[int, ...], list[np.ndarray], list[np.ndarray]]] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = self.lookups = self.hit_tokens = self.evictions = 0

    @property
    def enabled(self) -> bool:
        return self.budget >= self.block_bytes

    @property
    def bytes(self) -> int:
        return len(self._blocks) * self.block_bytes

    def _keys(self, ids: Sequence[int], n_blocks: int) -> list[tuple[int, tuple[int, ...]]]:
        out, parent = [], 0
        for b in range(n_blocks):
            toks = tuple(int(t) for t in ids[b * self.block : (b + 1) * self.block])
            parent = hash((parent, toks))
            out.append((parent, toks))
        return out

    def load(self, ids: Sequence[int], cache: SeqCache) -> int:
        """Copy the longest cached prefix of ``ids`` (whole blocks, never the last token) into the empty
        ``cache``; returns how many positions it holds now."""
        if not self.enabled or cache.length:
            return 0
        n_blocks = (len(ids) - 1) // self.block
        with self._lock:
            self.lookups += 1
            found = []
            for key, toks in self._keys(ids, n_blocks):
                got = self._blocks.get(key)
                if got is None or got[0] != toks:  # a hash collision is a miss, never wrong KV
                    break
                self._blocks.move_to_end(key)
                found.append(got)
            for i, (_, ks, vs) in enumerate(found):
                a = i * self.block
                for layer, (k, v) in enumerate(zip(ks, vs, strict=True)):
                    cache.keys[layer][:, a : a + self.block] = k
                    cache.values[layer][:, a : a + self.block] = v
            if found:
                self.hits += 1
                self.hit_tokens += len(found) * self.block
        cache.length = len(found) * self.block
        return cache.length

    def store(self, ids: Sequence[int], cache: SeqCache) -> None:
        """Keep the whole blocks of ``cache``'s positions (``ids`` are their tokens) not kept yet."""
        if not self.enabled:
            return
        n_blocks = min(cache.length, len(ids)) // self.block
        with self._lock:
            for i, (key, toks) in enumerate(self._keys(ids, n_blocks)):
                if key in self._blocks:
                    self._blocks.move_to_end(key)
                    continue
                a = i * self.block
                ks = [cache.keys[layer][:, a : a + self.block].copy() for layer in range(len(cache.keys))]
                vs = [cache.values[layer][:, a : a + self.block].copy() for layer in range(len(cache.values))]
                self._blocks[key] = (toks, ks, vs)
                while self.bytes > self.budget:
                    self._blocks.popitem(last=False)
                    self.evictions += 1

    def stats(self) -> dict:
        return {"enabled": self.enabled, "block_tokens": self.block, "blocks": len(self._blocks), "bytes": self.bytes,
                "budget_bytes": self.budget, "lookups": self.lookups, "hits": self.hits, "hit_tokens": self.hit_tokens,
                "evictions": self.evictions}
