"""Prefix caching: KV blocks keyed by a chained hash of their tokens.

Block i of a prompt (full blocks only) is keyed by hash(key of block i-1, its tokens),
so equal keys mean equal whole prefixes, and the key alone says where a prompt's
cached run ends. Cached blocks are reference counted while a request uses them and
kept, least recently used first out, while nobody does; an allocation that finds the
pool empty evicts them. The hash is stable across processes: the router computes the
same keys from a prompt to see which worker already holds its prefix.

Plain Python on block ids, like BlockPool; the KV bytes live in the worker's pool tensor.
One lock guards it: the engine thread changes it while the server thread reads summaries.
"""
from __future__ import annotations

import hashlib
import struct
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence

from services.engine.block_pool import BlockPool, NoFreeBlocks

_SEED = 0x5044_5345_5256_4531        # any fixed value: "PDSERVE1"


def block_hashes(token_ids: Sequence[int], block_size: int) -> list[int]:
    """Chained 64-bit keys of the prompt's full blocks, in order."""
    keys: list[int] = []
    prev = _SEED
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        block = token_ids[start:start + block_size]
        digest = hashlib.blake2b(struct.pack(f"<Q{block_size}I", prev, *block), digest_size=8).digest()
        prev = int.from_bytes(digest, "little")
        keys.append(prev)
    return keys


def cached_prefix_blocks(keys: Sequence[int], held: set[int] | frozenset[int]) -> int:
    """How many leading blocks of a prompt (by its keys) a worker holding `held` has."""
    n = 0
    for k in keys:
        if k not in held:
            break
        n += 1
    return n


@dataclass
class PrefixHit:
    block_ids: list[int]        # every block of the prompt, cached ones first
    keys: list[int]             # the prompt's full-block keys
    cached_tokens: int          # tokens whose KV is already in the first blocks


class PrefixCache:
    def __init__(self, pool: BlockPool, enabled: bool = True) -> None:
        self.pool = pool
        self.enabled = enabled                       # off: plain allocation, nothing kept
        self._by_key: dict[int, int] = {}            # key -> block id
        self._key_of: dict[int, int] = {}            # block id -> key
        self._refs: dict[int, int] = {}              # block id -> requests using it
        self._idle: OrderedDict[int, None] = OrderedDict()   # cached, unused: LRU first
        self.hits = 0
        self.queries = 0
        self._lock = threading.Lock()

    @property
    def num_cached(self) -> int:
        return len(self._by_key)

    @property
    def num_available(self) -> int:
        """Blocks an allocation can get: free ones plus evictable cached ones."""
        return self.pool.num_free + len(self._idle)

    def keys_newest_first(self, limit: int) -> list[int]:
        """A summary for the router: keys in use, then idle ones most recently used first."""
        with self._lock:
            busy = [self._key_of[b] for b in self._refs if b in self._key_of]
            idle = [self._key_of[b] for b in reversed(self._idle)]
        return (busy + idle)[:limit]

    def acquire(self, token_ids: Sequence[int]) -> PrefixHit:
        """Blocks for a whole prompt: its cached leading blocks (referenced) plus new
        ones. At least the last token is always left to compute (its logits are needed)."""
        bs = self.pool.block_size
        keys = block_hashes(token_ids, bs) if self.enabled else []
        with self._lock:
            return self._acquire(token_ids, keys)

    def _acquire(self, token_ids: Sequence[int], keys: list[int]) -> PrefixHit:
        bs = self.pool.block_size
        usable = (len(token_ids) - 1) // bs
        cached: list[int] = []
        for k in keys[:usable]:
            b = self._by_key.get(k)
            if b is None:
                break
            cached.append(b)
        self.queries += 1
        self.hits += bool(cached)
        for b in cached:                              # referenced before evicting for the rest
            self._ref(b)
        try:
            fresh = self._allocate(self.pool.blocks_for(len(token_ids)) - len(cached))
        except NoFreeBlocks:
            self._unref(cached)
            raise
        for b in fresh:
            self._refs[b] = 1
        return PrefixHit(cached + fresh, keys, len(cached) * bs)

    def release(self, hit: PrefixHit, computed: bool) -> None:
        """The request is done with its blocks. When its KV was computed, full blocks
        become cached under their keys (the first holder of a key keeps it)."""
        with self._lock:
            if computed:
                for k, b in zip(hit.keys, hit.block_ids):
                    if k not in self._by_key and b not in self._key_of:
                        self._by_key[k] = b
                        self._key_of[b] = k
            self._unref(hit.block_ids)

    def _ref(self, b: int) -> None:
        self._refs[b] = self._refs.get(b, 0) + 1
        self._idle.pop(b, None)

    def _unref(self, blocks: list[int]) -> None:
        for b in blocks:
            n = self._refs[b] - 1
            if n:
                self._refs[b] = n
                continue
            del self._refs[b]
            if b in self._key_of:
                self._idle[b] = None                   # most recently used end
            else:
                self.pool.free([b])

    def _allocate(self, n: int) -> list[int]:
        short = n - self.pool.num_free
        if short > len(self._idle):
            raise NoFreeBlocks(f"need {n} blocks, {self.num_available} free or evictable")
        for _ in range(max(0, short)):
            b, _ = self._idle.popitem(last=False)
            del self._by_key[self._key_of.pop(b)]
            self.pool.free([b])
        return self.pool.allocate(n)
