"""A fixed pool of KV block ids: allocation, release and leak accounting.

Plain Python, no torch: the tensors that hold the blocks live elsewhere
(`services.engine.model.kv_cache.KVPoolMemory`); this only decides which ids are in use.
"""
from __future__ import annotations


class NoFreeBlocks(Exception):
    """The pool cannot satisfy an allocation right now."""


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))     # block 0 on top
        self._used = bytearray(num_blocks)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise NoFreeBlocks(f"need {n} blocks, {len(self._free)} free")
        ids = [self._free.pop() for _ in range(n)]
        for i in ids:
            self._used[i] = 1
        return ids

    def free(self, ids: list[int]) -> None:
        for i in ids:
            if not self._used[i]:
                raise RuntimeError(f"block {i} freed twice")
            self._used[i] = 0
            self._free.append(i)
