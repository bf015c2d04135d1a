"""Routing policies on their own: decode choice, remote-or-local prefill from the cost
model, prefill choice by queue and prefix overlap, and the model's recalibration."""
from services.engine.core.prefix_cache import block_hashes
from services.router.policy import (DECODE_AFFINITY_SLACK, CostModel, DecodeLoad, PrefillLoad, pick_decode,
                                    plan_prefill)

BS = 16
PROMPT = list(range(1000, 1000 + 1088))          # 1,024-token shared prefix + 64 more
KEYS = block_hashes(PROMPT, BS)
HELD = frozenset(KEYS[:64])                       # the 1,024-token prefix


def model(**kw) -> CostModel:
    return CostModel(prefill_s_per_token=0.002, remote_overhead_s=0.02, transfer_tail_s_per_token=0.0, **kw)


def test_decode_least_loaded_among_those_with_room():
    ws = [DecodeLoad("a", free_blocks=500, running=3), DecodeLoad("b", free_blocks=80, running=1),
          DecodeLoad("c", free_blocks=10, running=0)]
    assert pick_decode(ws, need_blocks=69).key == "b"        # c has no room for the prompt
    assert pick_decode(ws, need_blocks=100).key == "a"
    assert pick_decode(ws, need_blocks=600).key == "a"       # nobody has room: most free, and wait there
    assert pick_decode([], 1) is None
    tie = [DecodeLoad("x", 100, 2, last_pick=5.0), DecodeLoad("y", 300, 2, last_pick=7.0)]
    assert pick_decode(tie, 10).key == "x"                   # equal load: round robin


def test_decode_worker_holding_the_prefix_wins_unless_it_is_much_busier():
    ws = [DecodeLoad("a", 500, running=2), DecodeLoad("b", 500, running=2 + DECODE_AFFINITY_SLACK, cached_blocks=3),
          DecodeLoad("c", 500, running=3, cached_blocks=1)]
    assert pick_decode(ws, 10).key == "b"                    # the longest prefix, within the slack
    busier = [ws[0], DecodeLoad("b", 500, running=3 + DECODE_AFFINITY_SLACK, cached_blocks=3), ws[2]]
    assert pick_decode(busier, 10).key == "c"                # b is too busy: the next longest prefix
    assert pick_decode([ws[0], DecodeLoad("b", 5, 0, cached_blocks=9)], 10).key == "a"   # no room in b


def test_prefix_holder_wins_while_not_overloaded():
    ps = [PrefillLoad("cold", 0), PrefillLoad("warm", 0, HELD)]
    plan = plan_prefill(ps, KEYS, len(PROMPT), BS, decode_running=0, model=model(), local_max_tokens=0)
    assert plan.prefill.key == "warm" and plan.cached_tokens == 1024
    # Its queue grows past what the cache saves (1,024 tokens): the cold worker is faster.
    busy = [PrefillLoad("cold", 0), PrefillLoad("warm", 1500, HELD)]
    assert plan_prefill(busy, KEYS, len(PROMPT), BS, 0, model(), 0).prefill.key == "cold"
    ok = [PrefillLoad("cold", 0), PrefillLoad("warm", 900, HELD)]
    assert plan_prefill(ok, KEYS, len(PROMPT), BS, 0, model(), 0).prefill.key == "warm"


def test_a_partial_prefix_only_counts_its_leading_blocks():
    other = block_hashes(PROMPT[:512] + [7] * 576, BS)        # same first 512 tokens, then different
    ps = [PrefillLoad("half", 0, frozenset(other)), PrefillLoad("none", 0)]
    plan = plan_prefill(ps, KEYS, len(PROMPT), BS, 0, model(), 0)
    assert plan.prefill.key == "half" and plan.cached_tokens == 512


def test_fully_cached_prompt_still_computes_its_last_token():
    prompt = PROMPT[:1024]
    keys = block_hashes(prompt, BS)
    plan = plan_prefill([PrefillLoad("w", 0, frozenset(keys))], keys, 1024, BS, 0, model(), 0)
    assert plan.cached_tokens == 1008


def test_short_prompt_prefills_locally_only_when_it_stalls_nobody_much():
    ps = [PrefillLoad("p", 0)]
    idle = plan_prefill(ps, block_hashes(list(range(40)), BS), 40, BS, decode_running=0, model=model(),
                        local_max_tokens=256)
    assert idle.prefill is None and "local" in idle.reason
    busy = plan_prefill(ps, block_hashes(list(range(40)), BS), 40, BS, decode_running=8, model=model(),
                        local_max_tokens=256)
    assert busy.prefill is not None                           # 8 running sequences would each wait
    off = plan_prefill(ps, [], 40, BS, 0, model(), local_max_tokens=0)
    assert off.prefill is not None                            # always disaggregate
    long = plan_prefill(ps, KEYS, len(PROMPT), BS, 0, model(), local_max_tokens=256)
    assert long.prefill is not None


def test_a_long_prompt_prefills_locally_only_while_the_prefill_pool_is_backed_up():
    """Past --local-prefill-max-tokens a prompt goes to a prefill worker, unless the
    least queue there holds more than the prompt itself and local is sooner by the
    cost model (the long workload on two cores: eight 1,024-token prompts in flight)."""
    n = len(PROMPT)
    keys = block_hashes(list(range(5000, 5000 + n)), BS)         # nothing cached anywhere
    short_queue = plan_prefill([PrefillLoad("p", n // 2)], keys, n, BS, 1, model(), local_max_tokens=256)
    assert short_queue.prefill is not None
    backed_up = plan_prefill([PrefillLoad("p", 7 * n)], keys, n, BS, 1, model(), local_max_tokens=256)
    assert backed_up.prefill is None and "local" in backed_up.reason
    stalls_many = plan_prefill([PrefillLoad("p", 7 * n)], keys, n, BS, 8, model(), local_max_tokens=256)
    assert stalls_many.prefill is not None                    # eight streams would wait meanwhile
    never = plan_prefill([PrefillLoad("p", 7 * n)], keys, n, BS, 0, model(), local_max_tokens=0)
    assert never.prefill is not None                          # 0: always disaggregate


def test_local_when_no_prefill_worker():
    plan = plan_prefill([], KEYS, len(PROMPT), BS, 5, model(), 0)
    assert plan.prefill is None and plan.reason == "no prefill worker"


def test_cached_prefix_on_a_prefill_worker_beats_local_prefill():
    # 200 tokens, 192 of them cached remotely: remote computes 8 tokens, local would compute 200.
    prompt = PROMPT[:200]
    keys = block_hashes(prompt, BS)
    plan = plan_prefill([PrefillLoad("w", 0, frozenset(keys))], keys, 200, BS, 0, model(), 256)
    assert plan.prefill is not None and plan.cached_tokens == 192


def test_cost_model_recalibrates_from_reports():
    m = CostModel(prefill_s_per_token=0.010, remote_overhead_s=0.5)
    for _ in range(30):                                       # the workers are much faster than guessed
        m.observe(computed_tokens=1000, prefill_seconds=1.05, transfer_seconds=0.05, overhead_seconds=0.03,
                  prompt_tokens=1000)
    assert abs(m.prefill_s_per_token - 0.001) < 1e-4
    assert abs(m.remote_overhead_s - 0.03) < 5e-3
    assert abs(m.transfer_tail_s_per_token - 0.00005) < 1e-5
    before = m.prefill_s_per_token
    m.observe(computed_tokens=3, prefill_seconds=5.0, transfer_seconds=0.0, overhead_seconds=0.03, prompt_tokens=1000)
    assert m.prefill_s_per_token == before                    # a near-fully cached prompt says nothing
    for _ in range(30):                                       # unless the worker says its own rate
        m.observe(computed_tokens=3, prefill_seconds=0.006, transfer_seconds=0.0, overhead_seconds=0.03,
                  prompt_tokens=40, seconds_per_token=0.002)
    assert abs(m.prefill_s_per_token - 0.002) < 1e-4


def test_a_prompt_prefilled_remotely_goes_to_the_decode_worker_its_load_picks():
    """A decode worker's prefix cache serves a prompt only when it prefills the prompt
    itself: prefilled there, the prompt goes to the worker holding its prefix (within the
    slack); sent to a prefill worker, to the least loaded decode worker instead."""
    from services.common.metrics import RouterMetrics
    from services.common.settings import RouterSettings
    from services.engine.core.sampling import SamplingParams
    from services.router.generation import Generation
    from services.router.latency import LatencyLedger
    from services.router.workers import WorkerSet
    from services.rpc import worker_pb2

    gen = Generation("r", PROMPT, SamplingParams(max_tokens=4))

    def workers(local_prefill_max_tokens: int) -> WorkerSet:
        ws = WorkerSet(RouterSettings(decode=["h:1", "l:2"], prefill=["p:3"],
                                      local_prefill_max_tokens=local_prefill_max_tokens),
                       RouterMetrics("test_affinity"), LatencyLedger(), model())
        for w, running, held in ((ws.decode[0], 2, KEYS[:64]), (ws.decode[1], 0, [])):
            w.seen(worker_pb2.WorkerInfo(role="decode", epoch=w.address, compat_hash="c", block_size=BS,
                                         num_blocks=1000, free_blocks=1000, running=running, prefix_hashes=held))
        ws.prefill[0].seen(worker_pb2.WorkerInfo(role="prefill", epoch="p", compat_hash="c", block_size=BS))
        return ws

    decode, prefill, _ = workers(local_prefill_max_tokens=4096).route(gen)
    assert prefill is None and decode.address == "h:1"           # computed where its prefix is
    decode, prefill, _ = workers(local_prefill_max_tokens=0).route(gen)
    assert prefill.address == "p:3" and decode.address == "l:2"   # computed remotely: by load


def test_a_worker_without_a_prefix_cache_is_credited_with_none():
    """A prompt prefilled on a worker counts as cached there for a while (its report
    comes later), only where the worker keeps prefixes: with --enable-prefix-caching
    off, affinity and the cost model would count on hits that never come."""
    from services.router.workers import Worker
    from services.rpc import worker_pb2
    keeps, forgets = Worker("prefill", "a:1"), Worker("prefill", "b:1")
    keeps.seen(worker_pb2.WorkerInfo(epoch="1", prefix_caching=True))
    forgets.seen(worker_pb2.WorkerInfo(epoch="2", prefix_caching=False))
    for w in (keeps, forgets):
        w.caches([11, 12])
    assert set(keeps.recent_keys) == {11, 12} and not forgets.recent_keys
