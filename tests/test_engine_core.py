"""The engine core in one process, float32: every parity prompt added at once runs in
mixed steps (decode tokens and prompt chunks of several sequences in one forward pass),
and each sequence's greedy output is token for token `model.generate`'s, whatever the
token budget, the chunk size or the preemptions a small pool forces, with and without
async scheduling (each step planned and launched before the last one's tokens are
read)."""
from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch

from services.engine.core.block_manager import BlockManager
from services.engine.core.block_pool import BlockPool
from services.engine.engine import LLMEngine
from services.engine.model.kv_cache import KVPoolMemory
from services.engine.model.runner import ModelRunner
from services.engine.core.sampling import SamplingParams
from services.engine.core.scheduler import Scheduler, SchedulerConfig
from services.engine.core.sequence import Sequence
from services.engine.text.tokenizer import eos_token_ids
from tests.parity_cases import CASES

BLOCK = 16


@pytest.fixture(scope="module")
def runner(model_dir):
    torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else 2)     # two workers: one each
    return ModelRunner(model_dir, "float32", "cpu")


def run_all(runner, model_dir, expected, config: SchedulerConfig, num_blocks: int, prefix_caching=False,
            async_scheduling=False, cases=CASES):
    blocks = BlockManager(BlockPool(num_blocks, BLOCK), prefix_caching=prefix_caching)
    memory = KVPoolMemory.allocate(runner.layout(num_blocks, BLOCK))
    engine = LLMEngine(runner, memory, Scheduler(blocks, config), async_scheduling=async_scheduling)
    eos = eos_token_ids(model_dir)
    out: dict[str, list[int]] = {}
    finished: dict[str, str] = {}
    for case in cases:
        prompt = expected[case.name].prompt_ids
        n = len(expected[case.name].token_ids) if case.stop else case.max_tokens
        engine.add(Sequence(case.name, list(prompt), len(prompt), SamplingParams(max_tokens=n, temperature=0), eos))
        out[case.name] = []
    mixed = 0
    while engine.has_work():
        for o in engine.step():
            out[o.request_id] += o.token_ids
            if o.finish_reason:
                finished[o.request_id] = o.finish_reason
        s = engine.last_step
        mixed += bool(s and s.prefill_tokens and s.decode_tokens)
    memory.close()
    assert blocks.num_available == num_blocks            # every block came back
    return out, finished, mixed, engine


# Synchronous mixed steps are what every cluster test runs (and the preemption test below);
# async ones are test_async_scheduling_gives_what_sync_gives' (every kind of request) and
# test_modes' aggregated cluster (chunked prompts beside decodes, async): both runs here go
# with the slow tests.
@pytest.mark.slow
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_mixed_steps_match_generate(runner, model_dir, expected, async_scheduling):
    out, finished, mixed, engine = run_all(runner, model_dir, expected,
                                           SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256), 512,
                                           async_scheduling=async_scheduling)
    for case in CASES:
        assert out[case.name] == expected[case.name].token_ids, case.name
        assert finished[case.name] in ("stop", "length")
    assert mixed > 0                                      # decode tokens shared passes with prompt chunks
    # with async scheduling, steps took their input tokens on the device from the step before
    assert (engine.overlapped_steps > 0) == async_scheduling
    assert "stop" in finished.values()                    # a row ran past its end and was dropped


# Async steps' parity is the mixed-steps test's above (and test_modes' cluster).
@pytest.mark.parametrize("async_scheduling", [False, pytest.param(True, marks=pytest.mark.slow)],
                         ids=["sync", "async"])
def test_small_chunks_and_preemption_still_match_generate(runner, model_dir, expected, async_scheduling):
    # the long prompt beside two short ones (every case is the mixed-steps test's, slow)
    cases = [c for c in CASES if c.name in ("long", "short", "hits_max_tokens")]
    longest = max(len(expected[c.name].prompt_ids) + len(expected[c.name].token_ids) for c in cases)
    # Barely more than the longest sequence: a short one's decode runs out of blocks and
    # preempts the long one. The count is exact: every prompt shares its first block
    # (the chat template's) with the ones running, so one block either way may leave room.
    blocks = -(-longest // BLOCK) + 3
    out, _, _, engine = run_all(runner, model_dir, expected,
                                SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=64, max_prefill_chunk=48),
                                blocks, prefix_caching=True, async_scheduling=async_scheduling, cases=cases)
    for case in cases:
        assert out[case.name] == expected[case.name].token_ids, case.name
    # Under a step in flight a sequence short of a block waits a step instead of
    # preempting one (only a step with nothing in flight preempts).
    if async_scheduling:
        assert engine.scheduler.num_sat_out > 0
    else:
        assert engine.scheduler.num_preemptions > 0


def test_a_finished_outputs_blocks_serve_the_next_turns_prompt(runner, model_dir, expected):
    """A finished sequence's generated tokens' full blocks stay in the prefix cache: a
    prompt that carries its prompt and its output (a conversation's next turn) finds
    them all, and its greedy output is what computing them again gives."""
    eos = eos_token_ids(model_dir)
    first = expected["hits_max_tokens"]
    assert len(first.token_ids) > BLOCK                  # its output fills a block of its own
    turn = first.prompt_ids + first.token_ids + first.prompt_ids[-9:]

    def serve(prefix_caching: bool, prompts: list[tuple[list[int], int]]) -> tuple[list[int], int]:
        blocks = BlockManager(BlockPool(256, BLOCK), prefix_caching=prefix_caching)
        memory = KVPoolMemory.allocate(runner.layout(256, BLOCK))
        engine = LLMEngine(runner, memory, Scheduler(blocks, SchedulerConfig(max_num_seqs=4)))
        try:
            for i, (prompt, max_tokens) in enumerate(prompts):     # one after the other, as turns come
                seq = Sequence(f"turn-{i}", list(prompt), len(prompt),
                               SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True), eos)
                engine.add(seq)
                out = []
                while engine.has_work():
                    out += [t for o in engine.step() for t in o.token_ids]
            assert blocks.num_available == 256
            return out, seq.num_cached
        finally:
            memory.close()
    again, cached = serve(True, [(first.prompt_ids, len(first.token_ids)), (turn, 8)])
    assert cached == (len(first.prompt_ids) + len(first.token_ids) - 1) // BLOCK * BLOCK
    assert again == serve(False, [(turn, 8)])[0]


def test_a_sequence_that_breaks_the_forward_pass_fails_alone(runner, model_dir, expected):
    """An id past the embedding table (what a caller that skips the worker's checks
    could send) makes the batch's forward pass raise: the engine runs the step again
    one sequence at a time, fails only that one, and the others' output is unchanged."""
    blocks = BlockManager(BlockPool(256, BLOCK))
    memory = KVPoolMemory.allocate(runner.layout(256, BLOCK))
    engine = LLMEngine(runner, memory, Scheduler(blocks, SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=512)))
    eos = eos_token_ids(model_dir)
    good = [c for c in CASES if not c.stop][:2]
    for case in good:
        prompt = expected[case.name].prompt_ids
        engine.add(Sequence(case.name, list(prompt), len(prompt), SamplingParams(max_tokens=case.max_tokens,
                                                                                  temperature=0), eos))
    poison = [5, 6, runner.vocab_size + 5, 7]
    engine.add(Sequence("poison", poison, len(poison), SamplingParams(max_tokens=4, temperature=0), eos))
    out, finished = {c.name: [] for c in good}, {}
    while engine.has_work():
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.token_ids)
            if o.finish_reason:
                finished[o.request_id] = o.finish_reason
    memory.close()
    assert finished["poison"] == "error" and out["poison"] == []
    for case in good:
        assert out[case.name] == expected[case.name].token_ids, case.name
    assert blocks.num_available == 256


def _run_choices(runner, model_dir, prompt, params, n, num_blocks=256, prefilled_first=None):
    """Choice 0 computes the prompt (or arrives prefilled with `prefilled_first`); the
    others fork from it. Returns each choice's tokens and the block high-water mark."""
    blocks = BlockManager(BlockPool(num_blocks, BLOCK))
    memory = KVPoolMemory.allocate(runner.layout(num_blocks, BLOCK))
    engine = LLMEngine(runner, memory, Scheduler(blocks, SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256)))
    eos = eos_token_ids(model_dir)
    forks = [Sequence(f"r#{i}", [], len(prompt), replace(params, seed=params.seed + i), eos) for i in range(1, n)]
    if prefilled_first is None:
        engine.add(Sequence("r#0", list(prompt), len(prompt), params, eos, forks=forks))
    else:       # the prompt's KV as a prefill worker would have written it, by computing it here first
        donor = Sequence("donor", list(prompt), len(prompt), replace(params, max_tokens=1), eos)
        engine.scheduler.config = replace(engine.scheduler.config, retain_finished=True)
        engine.add(donor)
        while engine.has_work():
            engine.step()
        parent = Sequence("r#0", list(prompt) + [prefilled_first], len(prompt), params, eos, forks=forks)
        donated = engine.scheduler.retained.pop("donor").block_ids
        reserved = engine.scheduler.reserve("r#0", len(prompt), float("inf")).block_ids
        engine.memory.copy_blocks(list(zip(donated, reserved)))      # the handoff's writes
        engine.scheduler.blocks.release(donated)
        engine.scheduler.config = replace(engine.scheduler.config, retain_finished=False)
        engine.add_prefilled(parent)
    out = {f"r#{i}": [] for i in range(n)}
    if prefilled_first is not None:
        out["r#0"].append(prefilled_first)             # sampled "elsewhere": the engine does not repeat it
    peak = 0
    while engine.has_work():
        for o in engine.step():
            out[o.request_id] += o.token_ids
        peak = max(peak, blocks.num_blocks - blocks.num_available)
    memory.close()
    assert blocks.num_available == num_blocks            # shared blocks came back exactly once
    return [out[f"r#{i}"] for i in range(n)], peak


def test_forked_choices_share_the_prompt_and_draw_their_own_seeds(runner, model_dir, expected):
    """n choices of one prompt: the prompt is computed once, its full blocks shared and
    the last one copied; greedy choices equal the single greedy answer, and each sampled
    choice equals the same seed run alone. Locally prefilled and handed over alike."""
    prompt = expected["long"].prompt_ids[:120]           # 8 blocks, the last one partial
    greedy = SamplingParams(max_tokens=10, temperature=0)
    alone, peak_one = _run_choices(runner, model_dir, prompt, greedy, 1)
    choices, peak = _run_choices(runner, model_dir, prompt, greedy, 3)
    assert choices == [alone[0]] * 3
    # Each other choice holds its copied last prompt block and at most one more for its
    # 10 tokens (the prompt's last block has 8 free): not a prompt of its own.
    assert peak <= peak_one + 2 * 2, (peak, peak_one)
    handed, _ = _run_choices(runner, model_dir, prompt, greedy, 3, prefilled_first=alone[0][0])
    assert handed == choices
    sampled = SamplingParams(max_tokens=6, temperature=1.0, seed=5)
    together, _ = _run_choices(runner, model_dir, prompt, sampled, 2)
    for i in range(2):
        one, _ = _run_choices(runner, model_dir, prompt, replace(sampled, seed=5 + i), 1)
        assert together[i] == one[0], i


def test_choices_waiting_on_an_aborted_prompt_end_with_it(runner, model_dir, expected):
    prompt = expected["long"].prompt_ids[:200]
    blocks = BlockManager(BlockPool(256, BLOCK))
    memory = KVPoolMemory.allocate(runner.layout(256, BLOCK))
    engine = LLMEngine(runner, memory, Scheduler(blocks, SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64)))
    params = SamplingParams(max_tokens=4, temperature=0)
    eos = eos_token_ids(model_dir)
    forks = [Sequence(f"r#{i}", [], len(prompt), params, eos) for i in (1, 2)]
    engine.add(Sequence("r#0", list(prompt), len(prompt), params, eos, forks=forks))
    engine.step()                                         # the first chunk of the prompt only
    engine.abort("r#0")
    ended = {o.request_id: o.finish_reason for o in engine.step()}
    assert ended == {"r#0": "abort", "r#1": "abort", "r#2": "abort"}
    assert not engine.has_work() and blocks.num_available == 256
    memory.close()


def test_a_fork_without_a_free_block_waits_and_computes_its_prompt(runner, model_dir, expected):
    """A pool with room for the prompt and one block more: the second extra choice finds
    no block to copy into, waits, and computes the prompt itself once blocks free up;
    every choice still gives the greedy answer, and every block comes back."""
    prompt = expected["long"].prompt_ids[:40]                 # 3 blocks, the last one partial
    choices, _ = _run_choices(runner, model_dir, prompt, SamplingParams(max_tokens=4, temperature=0), 3,
                              num_blocks=4)
    alone, _ = _run_choices(runner, model_dir, prompt, SamplingParams(max_tokens=4, temperature=0), 1)
    assert choices == [alone[0]] * 3


def _run_mixed_requests(runner, model_dir, expected, async_scheduling: bool):
    """Greedy, seeded sampling, log probabilities, a repetition penalty, two choices of one
    prompt, and a request aborted once it has three tokens, all at once. Returns each
    request's tokens, finish reason and log probabilities, and the engine."""
    blocks = BlockManager(BlockPool(256, BLOCK))
    memory = KVPoolMemory.allocate(runner.layout(256, BLOCK))
    engine = LLMEngine(runner, memory, Scheduler(blocks, SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=128)),
                       async_scheduling=async_scheduling)
    eos = eos_token_ids(model_dir)
    prompts = [expected[c.name].prompt_ids for c in CASES]
    requests = {
        "greedy": (prompts[0], SamplingParams(max_tokens=16, temperature=0)),
        "sampled": (prompts[1][:90], SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, seed=11)),
        "logprobs": (prompts[2], SamplingParams(max_tokens=8, temperature=0, logprobs=2)),
        "penalty": (prompts[0], SamplingParams(max_tokens=8, temperature=0, repetition_penalty=1.3)),
        "aborted": (prompts[-1], SamplingParams(max_tokens=30, temperature=0)),
    }
    for rid, (prompt, params) in requests.items():
        engine.add(Sequence(rid, list(prompt), len(prompt), params, eos))
    forked = SamplingParams(max_tokens=10, temperature=1.0, seed=3)
    fork = Sequence("choices#1", [], len(prompts[1][:50]), replace(forked, seed=4), eos)
    engine.add(Sequence("choices#0", list(prompts[1][:50]), 50, forked, eos, forks=[fork]))
    out: dict[str, list[int]] = {}
    finished, logprobs = {}, {}
    while engine.has_work():
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.token_ids)
            if o.logprobs:
                logprobs.setdefault(o.request_id, []).extend((lp.token_id, lp.logprob) for lp in o.logprobs)
            if o.finish_reason:
                finished[o.request_id] = o.finish_reason
        if len(out.get("aborted", [])) >= 3 and "aborted" not in finished:
            engine.abort("aborted")
    memory.close()
    assert blocks.num_available == 256                   # every block came back, held ones too
    return out, finished, logprobs, engine


def test_async_scheduling_gives_what_sync_gives(runner, model_dir, expected):
    """Every kind of request, side by side: with async scheduling each gets the tokens,
    finish and log probabilities it gets without; the aborted one stops early either way
    (a step later or not), its tokens a prefix of the same greedy run."""
    sync_out, sync_finished, sync_lp, _ = _run_mixed_requests(runner, model_dir, expected, False)
    out, finished, lp, engine = _run_mixed_requests(runner, model_dir, expected, True)
    assert engine.overlapped_steps > 0
    assert engine.generated_tokens == sum(len(t) for t in out.values())    # dropped tokens not counted
    assert finished.pop("aborted") == sync_finished.pop("aborted") == "abort"
    a, b = out.pop("aborted"), sync_out.pop("aborted")
    assert 3 <= len(a) < 30 and 3 <= len(b) < 30 and a[:3] == b[:3]
    assert out == sync_out and finished == sync_finished
    assert lp.keys() == {"logprobs"} and [t for t, _ in lp["logprobs"]] == [t for t, _ in sync_lp["logprobs"]]
    assert lp["logprobs"] == pytest.approx(sync_lp["logprobs"])


def test_a_reservation_is_made_during_the_forward_pass_not_after_it(runner, model_dir, expected, monkeypatch):
    """`LLMEngine.now` (a decode worker's Reserve) runs while a step's forward pass does,
    instead of waiting for the step to end: the scheduler is free then. From inside the
    forward pass, another thread's reservation completes; the step's output is still
    `generate`'s and every block comes back."""
    import threading
    blocks = BlockManager(BlockPool(64, BLOCK))
    memory = KVPoolMemory.allocate(runner.layout(64, BLOCK))
    engine = LLMEngine(runner, memory, Scheduler(blocks, SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=512)))
    made = []
    execute = runner.execute

    def forward(*args, **kwargs):
        if not made:
            t = threading.Thread(target=lambda: made.append(
                engine.now(lambda: engine.scheduler.reserve("handoff", 40, float("inf")))))
            t.start()
            t.join(timeout=30)
            assert made, "the reservation waited for the step"
        return execute(*args, **kwargs)

    monkeypatch.setattr(runner, "execute", forward)
    case = CASES[0]
    prompt = expected[case.name].prompt_ids
    engine.add(Sequence(case.name, list(prompt), len(prompt), SamplingParams(max_tokens=case.max_tokens,
                                                                              temperature=0), eos_token_ids(model_dir)))
    out = []
    while engine.has_work():
        out += [t for o in engine.step() for t in o.token_ids]
    assert out == expected[case.name].token_ids
    assert len(made[0].block_ids) == 3 and blocks.num_available == 64 - 3
    engine.scheduler.cancel("handoff")
    memory.close()
    assert blocks.num_available == 64


def test_a_small_pass_leaves_out_the_threads_on_lent_cores(runner, model_dir, monkeypatch):
    """With `own_threads` (a prefill worker that also runs on the decode core, where its
    thread waits its turn), a forward pass of fewer than SMALL_STEP_TOKENS tokens runs on
    the worker's own threads alone, a bigger one on all of them; the calling thread's
    count is as it was after each."""
    from services.engine.engine import SMALL_STEP_TOKENS
    blocks = BlockManager(BlockPool(64, BLOCK))
    memory = KVPoolMemory.allocate(runner.layout(64, BLOCK))
    engine = LLMEngine(runner, memory, Scheduler(blocks, SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=512)),
                       own_threads=1)
    seen = []
    execute = runner.execute

    def forward(memory, batch, hook=None, *more):
        seen.append((len(batch.decode_tokens) + len(batch.prefill_tokens), torch.get_num_threads()))
        return execute(memory, batch, hook, *more)

    monkeypatch.setattr(runner, "execute", forward)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        eos = eos_token_ids(model_dir)
        for name, n in (("small", 40), ("big", SMALL_STEP_TOKENS + 72)):
            engine.add(Sequence(name, [(i * 31) % 5000 + 100 for i in range(n)], n,
                                SamplingParams(max_tokens=2, temperature=0, ignore_eos=True), eos))
            while engine.has_work():
                engine.step()
            assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
        memory.close()
    assert seen[0] == (40, 1) and (SMALL_STEP_TOKENS + 72, 2) in seen
    assert all(threads == 1 for tokens, threads in seen if tokens < SMALL_STEP_TOKENS)


def _prefill_engine(runner, num_blocks: int, layer_hook=None, yields=False):
    blocks = BlockManager(BlockPool(num_blocks, BLOCK))
    memory = KVPoolMemory.allocate(runner.layout(num_blocks, BLOCK))
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=4096, prefill_only=True, retain_finished=True)
    return LLMEngine(runner, memory, Scheduler(blocks, config), layer_hook=layer_hook, yields=yields), memory


def _kv(memory, seq) -> torch.Tensor:
    return memory.tensor[:, :, seq.block_ids].clone()


def test_a_prefill_pass_pauses_between_layers_for_a_more_urgent_prompt(runner, model_dir, expected):
    """A prefill worker's engine (`yields`): a prompt more urgent than the pass running
    (a lower priority: another API key's, under a flood), added while that pass runs, is
    computed whole between two of its layers, and its first token is out before the
    paused pass ends. Both first tokens are `generate`'s, each prompt's KV is bitwise what
    it is when computed alone, and every block comes back."""
    eos = eos_token_ids(model_dir)
    a, b = expected["multi_turn"], expected["short"]

    def seq(name, case, priority):
        return Sequence(name, list(case.prompt_ids), len(case.prompt_ids),
                        SamplingParams(max_tokens=1, temperature=0), eos, priority=priority)

    alone = {}
    for name, case in (("a", a), ("b", b)):
        engine, memory = _prefill_engine(runner, 256)
        s = seq(name, case, 0)
        engine.add(s)
        while engine.has_work():
            engine.step()
        alone[name] = _kv(memory, s)
        memory.close()

    seen: list[tuple[str, int]] = []
    urgent = seq("b", b, 0)

    def layer_hook(layer, plan):
        seen.append((plan.chunks[0].seq.request_id, layer))
        if seen == [("a", i) for i in range(4)]:
            engine.add(urgent)          # arrives while layer 3 of a's pass runs

    engine, memory = _prefill_engine(runner, 256, layer_hook, yields=True)
    early = []
    engine.interjected = lambda outputs, stats: early.extend((o.request_id, o.token_ids, stats) for o in outputs)
    paused = seq("a", a, 1)
    engine.add(paused)
    late = []
    while engine.has_work():
        late += [(o.request_id, o.token_ids) for o in engine.step()]
    layers = runner.layout(1, BLOCK).num_layers
    assert seen == ([("a", i) for i in range(4)] + [("b", i) for i in range(layers)]
                    + [("a", i) for i in range(4, layers)])
    assert [(r, t) for r, t, _ in early] == [("b", [b.token_ids[0]])] and early[0][2].prefill_tokens == len(b.prompt_ids)
    assert late == [("a", [a.token_ids[0]])] and engine.interjections == 1
    assert torch.equal(_kv(memory, paused), alone["a"]) and torch.equal(_kv(memory, urgent), alone["b"])
    for name in ("a", "b"):
        engine.release(name)
    engine.step()
    memory.close()
    assert engine.scheduler.blocks.num_available == 256


def test_a_pass_that_yields_is_launched_at_most_a_few_layers_ahead_of_the_device(runner):
    """On a GPU the host launches a pass's layers far ahead of their computing (no double
    here models that: the doubles compute on the host, a layer at a time). Launched whole,
    a pass would be queued before an urgent prompt comes, and the prompt's step would
    wait for all of it. A pass that yields waits, as it launches layer L's KV write, for
    layer L - PAUSE_AHEAD_LAYERS's to be done: the urgent step goes in behind at most that
    many of its layers. A pass that does not yield waits for none (with no KV export,
    it has no hook at all)."""
    from services.engine import engine as engine_module
    from services.engine.core.sequence import StepPlan
    from services.engine.model.device import Fence
    waited: list[int] = []

    class Written(Fence):
        def __init__(self, layer: int) -> None:
            self.layer = layer

        def wait(self) -> None:
            waited.append(self.layer)
    engine, memory = _prefill_engine(runner, 16, yields=True)
    ahead = engine_module.PAUSE_AHEAD_LAYERS
    assert engine._layer_hook(StepPlan(), False) is None
    yielding = engine._layer_hook(StepPlan(), True)
    for layer in range(8):
        yielding(layer, Written(layer))
        assert waited == list(range(max(0, layer + 1 - ahead))), layer
    memory.close()


def test_a_pass_does_not_pause_for_a_prompt_as_urgent_as_its_own(runner, model_dir, expected):
    """Equal priority waits its turn (first come, first served), as does every prompt in
    an engine that does not yield."""
    eos = eos_token_ids(model_dir)
    a, b = expected["short"], expected["multi_turn"]
    for yields, priorities in ((True, (0, 0)), (True, (1, 1)), (False, (1, 0))):
        order = []

        def layer_hook(layer, plan):
            order.append(plan.chunks[0].seq.request_id)
            if order == ["a"]:
                engine.add(Sequence("b", list(b.prompt_ids), len(b.prompt_ids), SamplingParams(max_tokens=1),
                                    eos, priority=priorities[1]))

        engine, memory = _prefill_engine(runner, 256, layer_hook, yields=yields)
        engine.add(Sequence("a", list(a.prompt_ids), len(a.prompt_ids), SamplingParams(max_tokens=1), eos,
                            priority=priorities[0]))
        while engine.has_work():
            engine.step()
        memory.close()
        layers = runner.layout(1, BLOCK).num_layers
        assert order == ["a"] * layers + ["b"] * layers and engine.interjections == 0
    with pytest.raises(ValueError, match="prefill-only"):
        LLMEngine(runner, memory, Scheduler(BlockManager(BlockPool(8, BLOCK)), SchedulerConfig()), yields=True)


def test_an_urgent_step_that_fails_fails_alone_and_the_paused_pass_goes_on(runner, model_dir, expected,
                                                                            monkeypatch):
    """A step run inside a paused pass that raises ends its own prompts ("error"), never
    the paused pass, whose first token is still `generate`'s; every block comes back."""
    eos = eos_token_ids(model_dir)
    a, b = expected["short"], expected["multi_turn"]
    execute, depth = runner.execute, []

    def forward(*args, **kwargs):
        if depth:
            raise RuntimeError("the urgent step breaks")
        depth.append(1)
        try:
            return execute(*args, **kwargs)
        finally:
            depth.pop()

    def layer_hook(layer, plan):
        if layer == 3 and plan.chunks[0].seq.request_id == "a":
            engine.add(Sequence("b", list(b.prompt_ids), len(b.prompt_ids), SamplingParams(max_tokens=1), eos))

    monkeypatch.setattr(runner, "execute", forward)
    engine, memory = _prefill_engine(runner, 256, layer_hook, yields=True)
    early = []
    engine.interjected = lambda outputs, stats: early.extend((o.request_id, o.finish_reason) for o in outputs)
    engine.add(Sequence("a", list(a.prompt_ids), len(a.prompt_ids), SamplingParams(max_tokens=1, temperature=0),
                        eos, priority=1))
    late = []
    while engine.has_work():
        late += [(o.request_id, o.token_ids) for o in engine.step()]
    assert early == [("b", "error")] and late == [("a", [a.token_ids[0]])] and engine.interjections == 0
    engine.release("a")
    engine.release("b")
    engine.step()
    memory.close()
    assert engine.scheduler.blocks.num_available == 256
