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


def test_a_cached_prompt_loses_its_tail_first():
    """Blocks go idle last block first, so eviction takes a cached prompt's tail before
    its head: a lookup walks from the head, and one eviction of the head left every
    other block of the prompt unreachable."""
    cache = BlockManager(BlockPool(8, 4), prefix_caching=True)
    prompt = list(range(100, 117))                       # 4 full blocks and a token
    hit = cache.acquire(prompt)
    cache.release(hit.block_ids, hit.keys, len(prompt))
    cache.release(cache.allocate(cache.pool.num_free + 1))     # every free block, and one evicted
    assert cache.acquire(prompt).cached_tokens == 12


def test_scheduler_shares_a_running_prefix_counts_it_once_and_caches_what_preemption_frees():
    """A prompt whose prefix a running sequence holds needs only its own blocks to be
    admitted (the shared ones were counted as new: it waited for the other to end); a
    preempted sequence's computed blocks are cached, remote KV included, and its
    cached_tokens stay what its first admission found."""
    from services.engine.core.sampling import SamplingParams
    from services.engine.core.scheduler import Scheduler, SchedulerConfig
    from services.engine.core.sequence import SeqStatus, Sequence

    def seq(rid, tokens, n=40):
        return Sequence(rid, list(tokens), len(tokens), SamplingParams(max_tokens=n, temperature=0), frozenset({2}))

    def step(s):
        plan = s.schedule()
        rows = plan.sampling()
        s.launched(plan, rows)
        s.resolve(rows, [[7] * c.num_sampled for c in rows])
        return plan
    s = Scheduler(BlockManager(BlockPool(24, 4), prefix_caching=True), SchedulerConfig(max_num_batched_tokens=128))
    system = list(range(100, 164))                       # 16 blocks
    a = seq("a", system + [1, 1, 1, 1])
    s.add(a)
    step(s)
    b = seq("b", system + [5, 6, 7, 8], n=5)
    s.add(b)
    assert b in [c.seq for c in step(s).chunks] and b.num_cached == 64
    s = Scheduler(BlockManager(BlockPool(10, 4), prefix_caching=True), SchedulerConfig(max_num_batched_tokens=64))
    s.add(seq("l", range(300, 308), n=30))
    step(s)
    remote = seq("r", range(200, 224), n=30)          # joins after it: the newest, preempted first
    s.reserve("r", 24, float("inf"))
    remote.token_ids.append(9)
    s.add_prefilled(remote)
    while not s.num_preemptions:
        step(s)
    assert remote.status is SeqStatus.WAITING
    keys = s.blocks.keys_of(remote.token_ids)
    assert all(k in s.blocks._by_key for k in keys[:6])    # its prompt's blocks, found when it comes back


def test_cached_tokens_are_what_the_first_admission_found_not_a_preempted_prompts_own_chunks():
    from services.engine.core.sampling import SamplingParams
    from services.engine.core.scheduler import Scheduler, SchedulerConfig
    from services.engine.core.sequence import Sequence
    s = Scheduler(BlockManager(BlockPool(8, 4), prefix_caching=True),
                  SchedulerConfig(max_num_batched_tokens=8, max_prefill_chunk=4, max_num_seqs=4))

    def seq(rid, tokens, n):
        return Sequence(rid, list(tokens), len(tokens), SamplingParams(max_tokens=n, temperature=0), frozenset({2}))

    def step():
        plan = s.schedule()
        rows = plan.sampling()
        s.launched(plan, rows)
        s.resolve(rows, [[7] * c.num_sampled for c in rows])
    s.add(seq("b", range(500, 507), 4))
    step()
    a = seq("a", range(100, 121), 5)                    # nothing of it cached anywhere
    s.add(a)
    while a.num_generated == 0:
        step()
    assert s.num_preemptions and a.num_cached == 0
