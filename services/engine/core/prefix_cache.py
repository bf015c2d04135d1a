"""Prefix keys: KV blocks named by a chained hash of their tokens.

Block i of a prompt (full blocks only) is keyed by hash(key of block i-1, its tokens),
so equal keys mean equal whole prefixes, and the key alone says where a prompt's
cached run ends. The hash is stable across processes: a worker's block manager keeps
computed blocks under these keys (`block_manager.BlockManager`), and the router
computes the same keys from a prompt to see which worker already holds its prefix.

A salt (vLLM's `cache_salt`; the router gives each tenant, an API key or the keys named
alike, its own) starts the chain
from a key of its own, so prompts of different salts never share a block: a tenant
cannot learn from `cached_tokens` or from its time to first token whether another sent
a prompt, and nothing of one tenant's is ever computed from another's KV.
"""
from __future__ import annotations

import hashlib
import struct
from typing import Container, Sequence

_SEED = 0x5044_5345_5256_4531        # any fixed value: "PDSERVE1"


def block_hashes(token_ids: Sequence[int], block_size: int, salt: str = "", known: Sequence[int] = ()) -> list[int]:
    """Chained 64-bit keys of the prompt's full blocks, in order, under `salt`. `known`:
    keys of its leading blocks computed before (under the same salt); the chain goes on
    from them."""
    keys = list(known[:len(token_ids) // block_size])
    prev = keys[-1] if keys else _SEED if not salt else int.from_bytes(
        hashlib.blake2b(salt.encode(), digest_size=8, key=_SEED.to_bytes(8, "little")).digest(), "little")
    for start in range(len(keys) * block_size, len(token_ids) - block_size + 1, block_size):
        block = token_ids[start:start + block_size]
        digest = hashlib.blake2b(struct.pack(f"<Q{block_size}I", prev, *block), digest_size=8).digest()
        prev = int.from_bytes(digest, "little")
        keys.append(prev)
    return keys


def cached_prefix_blocks(keys: Sequence[int], held: Container[int]) -> int:
    """How many leading blocks of a prompt (by its keys) a worker holding `held` has."""
    n = 0
    for k in keys:
        if k not in held:
            break
        n += 1
    return n
