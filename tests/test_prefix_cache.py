"""The block manager's prefix cache on its own: chained keys, reuse, reference counts, LRU eviction."""
import pytest

from services.engine.core.block_manager import BlockManager
from services.engine.core.block_pool import BlockPool, NoFreeBlocks
from services.engine.core.prefix_cache import block_hashes, cached_prefix_blocks

BS = 4


def done(cache, hit, computed=True):
    """A request ends: its blocks go back, computed full blocks cached."""
    cache.release(hit.block_ids, hit.keys, len(hit.block_ids) * BS if computed else 0)


def test_keys_are_chained_and_stable():
    a = block_hashes(list(range(12)), BS)
    assert len(a) == 3 and a == block_hashes(list(range(12)) + [99], BS)   # partial block: no key
    b = block_hashes([7] + list(range(1, 12)), BS)
    assert a[0] != b[0] and a[1] != b[1] and a[2] != b[2]   # one early token changes every later key
    assert block_hashes(list(range(4, 8)), BS)[0] != a[1]   # same tokens, other position: other key
    assert cached_prefix_blocks(a, {a[0], a[2]}) == 1


def test_second_request_reuses_the_prefix_and_computes_the_rest():
    pool = BlockPool(16, BS)
    cache = BlockManager(pool, prefix_caching=True)
    first = cache.acquire(list(range(10)))          # 2 full blocks + 2 tokens
    assert first.cached_tokens == 0 and len(first.block_ids) == 3
    done(cache, first, True)
    assert cache.num_cached == 2 and pool.num_free == 14

    second = cache.acquire(list(range(8)) + [50, 51, 52])
    assert second.cached_tokens == 8 and second.block_ids[:2] == first.block_ids[:2]
    done(cache, second, True)
    assert cache.hits == 1 and cache.queries == 2


def test_a_salt_keeps_its_prompts_blocks_to_itself():
    """vLLM's cache_salt (the router's per API key): every key of a salted prompt is its
    salt's own, and a prompt finds only blocks cached under its own salt."""
    plain, a, b = (block_hashes(list(range(12)), BS, salt) for salt in ("", "tenant-a", "tenant-b"))
    assert not set(plain) & set(a) and not set(a) & set(b) and a == block_hashes(list(range(12)), BS, "tenant-a")
    assert block_hashes(list(range(12)), BS, "tenant-a", known=a[:2]) == a          # the chain goes on from them
    assert block_hashes(list(range(6)), BS, "tenant-a", known=a) == a[:1]
    cache = BlockManager(BlockPool(16, BS), prefix_caching=True)
    done(cache, cache.acquire(list(range(10)), salt="tenant-a"))
    for salt in ("", "tenant-b"):
        other = cache.acquire(list(range(10)), salt=salt)
        assert other.cached_tokens == 0
        done(cache, other, computed=False)
    assert cache.acquire(list(range(10)), salt="tenant-a").cached_tokens == 8


def test_the_router_salts_each_keys_prompts_unless_the_cache_is_shared():
    from services.router.admission import TENANT
    from services.router.frontend import FrontEnd
    fe = FrontEnd(None, None, None, "m", 100, 100)
    assert fe.cache_salt(None) == ""                                  # no keys, no salt: one cache
    token = TENANT.set("team-a")
    try:
        own, asked = fe.cache_salt(None), fe.cache_salt("x")
        assert own and asked and own != asked and fe.cache_salt(None) == own
        fe.shared_prefix_cache = True
        assert fe.cache_salt(None) == "" and fe.cache_salt("x") not in ("", asked)
    finally:
        TENANT.reset(token)


def test_the_last_token_is_always_computed():
    cache = BlockManager(BlockPool(8, BS), prefix_caching=True)
    done(cache, cache.acquire(list(range(8))))
    again = cache.acquire(list(range(8)))           # fully cached prompt: its last block is recomputed
    assert again.cached_tokens == 4
    done(cache, again, True)


def test_failed_prefill_caches_nothing_and_leaks_nothing():
    pool = BlockPool(8, BS)
    cache = BlockManager(pool, prefix_caching=True)
    hit = cache.acquire(list(range(9)))
    done(cache, hit, False)
    assert cache.num_cached == 0 and pool.num_free == 8


def test_blocks_in_use_are_never_evicted_and_idle_ones_go_lru_first():
    pool = BlockPool(4, BS)
    cache = BlockManager(pool, prefix_caching=True)
    a = cache.acquire(list(range(0, 9)))            # 3 blocks: keys a0, a1
    done(cache, a, True)                 # a0, a1 cached, idle; 2 free
    b = cache.acquire(list(range(100, 105)))        # 2 blocks, fits in the free ones
    done(cache, b, True)                 # b0 cached; 3 free of 4 counting idle
    assert cache.num_cached == 3 and cache.num_available == 4
    held = cache.acquire(list(range(0, 5)))         # a0 in use again, plus the last free block
    assert held.cached_tokens == 4 and cache.num_available == 2
    with pytest.raises(NoFreeBlocks):
        cache.acquire(list(range(200, 216)))        # 4 blocks; only a1 and b0 are evictable
    assert cache.num_available == 2 and cache.num_cached == 3   # the failed call took nothing
    cache.acquire(list(range(300, 301)))            # 1 block: evicts a1, the least recently used
    keys = set(cache.keys_newest_first(10))
    a0, a1 = block_hashes(list(range(8)), BS)
    assert a1 not in keys and {a0, block_hashes(list(range(100, 104)), BS)[0]} <= keys
    done(cache, held, True)
    assert cache.acquire(list(range(0, 5))).cached_tokens == 4       # a0 survived: it was in use


def test_disabled_cache_is_plain_allocation():
    pool = BlockPool(8, BS)
    cache = BlockManager(pool)
    for _ in range(2):
        hit = cache.acquire(list(range(9)))
        assert hit.cached_tokens == 0 and len(hit.block_ids) == 3
        done(cache, hit, True)
    assert cache.num_cached == 0 and pool.num_free == 8
