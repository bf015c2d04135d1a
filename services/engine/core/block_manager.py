"""Which KV blocks are in use, by whom, and which hold a cached prompt prefix.

Every block a worker hands out goes through one `BlockManager`: the scheduler's blocks
for prompts and generated tokens, and a decode worker's reservations for handoffs. A
block is reference counted while in use. With prefix caching on, a full prompt block
is findable under its chained key (`prefix_cache.block_hashes`) from the step that
computes it, and kept once nobody uses it, least recently used first out; an allocation
that finds the pool empty evicts such idle blocks. A finished sequence's generated
tokens' full blocks are kept the same way (`keys_of`): a conversation's next turn
carries them in its prompt. With it off, a released block is simply free again.

Plain Python on block ids, like BlockPool; the KV bytes live in the worker's pool
tensor. The scheduler changes it, on the engine thread (a decode worker's reservations
too); one lock guards it while RPC threads read summaries.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence

from services.engine.core.block_pool import BlockPool, NoFreeBlocks
from services.engine.core.prefix_cache import block_hashes


# Keys of cached blocks a worker advertises to the router (8 bytes each).
SUMMARY_BLOCKS = 4096


@dataclass
class PrefixHit:
    block_ids: list[int]        # every block of the prompt, cached ones first
    keys: list[int]             # the prompt's full-block keys
    cached_tokens: int          # tokens whose KV is already in the first blocks


class BlockManager:
    def __init__(self, pool: BlockPool, prefix_caching: bool = False) -> None:
        self.pool = pool
        self.prefix_caching = prefix_caching
        self._by_key: dict[int, int] = {}            # key -> block id
        self._key_of: dict[int, int] = {}            # block id -> key
        self._refs: dict[int, int] = {}              # block id -> users
        self._idle: OrderedDict[int, None] = OrderedDict()   # cached, unused: LRU first
        self.hits = 0
        self.queries = 0
        self._lock = threading.Lock()

    @property
    def block_size(self) -> int:
        return self.pool.block_size

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_cached(self) -> int:
        return len(self._by_key)

    @property
    def num_available(self) -> int:
        """Blocks an allocation can get: free ones plus evictable cached ones."""
        return self.pool.num_free + len(self._idle)

    def blocks_for(self, num_tokens: int) -> int:
        return self.pool.blocks_for(num_tokens)

    def keys_newest_first(self, limit: int = SUMMARY_BLOCKS) -> list[int]:
        """A summary for the router: keys in use, then idle ones most recently used first."""
        with self._lock:
            busy = [self._key_of[b] for b in self._refs if b in self._key_of]
            idle = [self._key_of[b] for b in reversed(self._idle)]
        return (busy + idle)[:limit]

    def keys_of(self, token_ids: Sequence[int], salt: str = "", known: Sequence[int] = ()) -> list[int]:
        """The keys of `token_ids`' full blocks (none with prefix caching off), going on
        from the `known` keys of its leading ones."""
        return block_hashes(token_ids, self.block_size, salt, known) if self.prefix_caching else []

    def shared_prefix(self, token_ids: Sequence[int], salt: str = "") -> int:
        """How many of `token_ids`' leading blocks `acquire` would find cached in blocks
        already in use: shared for free, they take none of what is available."""
        keys = self.keys_of(token_ids, salt)[:(len(token_ids) - 1) // self.block_size]
        n = 0
        with self._lock:
            for k in keys:
                b = self._by_key.get(k)
                if b is None or b not in self._refs:
                    break
                n += 1
        return n

    def acquire(self, token_ids: Sequence[int], reuse: bool = True, salt: str = "") -> PrefixHit:
        """Blocks for a whole prompt: its cached leading blocks (referenced) plus new
        ones. At least the last token is always left to compute (its logits are needed).
        `reuse=False`: every block new (a prompt whose every position's logits are
        needed); its blocks are still cached once computed. Only blocks cached under the
        same `salt` are found (prefix_cache.py)."""
        keys = self.keys_of(token_ids, salt)
        with self._lock:
            return self._acquire(token_ids, keys, reuse)

    def _acquire(self, token_ids: Sequence[int], keys: list[int], reuse: bool = True) -> PrefixHit:
        bs = self.block_size
        usable = (len(token_ids) - 1) // bs if reuse else 0
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
        return PrefixHit(cached + fresh, keys, len(cached) * bs)

    def allocate(self, n: int) -> list[int]:
        """`n` fresh blocks, each with one user."""
        with self._lock:
            return self._allocate(n)

    def share(self, block_ids: Sequence[int]) -> None:
        """One more user of each of `block_ids` (a forked sequence's shared prompt)."""
        with self._lock:
            for b in block_ids:
                self._ref(b)

    def cache(self, block_ids: Sequence[int], keys: Sequence[int], computed_tokens: int) -> None:
        """The leading full blocks whose KV is computed (`computed_tokens`) become findable
        under `keys` while their sequence still runs, as vLLM caches a block once it is
        full: a prompt admitted later shares them instead of computing them again. The
        first holder of a key keeps it. No-op with prefix caching off."""
        if keys:
            with self._lock:
                self._cache(block_ids, keys, computed_tokens)

    def release(self, block_ids: Sequence[int], keys: Sequence[int] = (), computed_tokens: int = 0) -> None:
        """A user is done with `block_ids`; their computed full blocks are cached first
        (`cache`)."""
        with self._lock:
            self._cache(block_ids, keys, computed_tokens)
            self._unref(block_ids)

    def _cache(self, block_ids: Sequence[int], keys: Sequence[int], computed_tokens: int) -> None:
        full = min(len(keys), computed_tokens // self.block_size)
        for k, b in zip(keys[:full], block_ids):
            if k not in self._by_key and b not in self._key_of:
                self._by_key[k] = b
                self._key_of[b] = k

    def _ref(self, b: int) -> None:
        self._refs[b] = self._refs.get(b, 0) + 1
        self._idle.pop(b, None)

    def _unref(self, blocks: Sequence[int]) -> None:
        # Last block first: of a prompt's cached blocks the tail is then evicted first and
        # its head last, as a lookup, which walks from the head and stops at the first
        # block gone, can use (head first, one eviction left every other block unreachable).
        for b in reversed(blocks):
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
        fresh = self.pool.allocate(n)
        for b in fresh:
            self._refs[b] = 1
        return fresh
