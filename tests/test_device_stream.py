"""KV is shipped only after the device has written it (services/engine/device.py).

No GPU here: `LaggingStream` stands in for one. Work launched on it runs later, on a
"device" thread, in launch order, after a delay, as a GPU's queued kernels do; a fence
passes once the work before it has run. A push that copies a layer's blocks as soon as the
layer is launched (the order the prefill worker had) sees the blocks' old bytes; one that
waits on the layer's fence (LayerPoster, inline or on its own thread) sees the new ones.
"""
from __future__ import annotations

import queue
import threading
import time

import pytest
import torch

from services.engine.block_manager import BlockManager
from services.engine.block_pool import BlockPool
from services.engine.device import Fence, HostStream, LayerPoster
from services.engine.engine import LLMEngine
from services.engine.kv_cache import KVPoolMemory
from services.engine.runner import ModelRunner
from services.engine.sampling import SamplingParams
from services.engine.scheduler import Scheduler, SchedulerConfig, Sequence

BLOCK = 16


class _Done(Fence):
    def __init__(self) -> None:
        self.event = threading.Event()

    def wait(self) -> None:
        assert self.event.wait(30), "the device never reached the fence"


class LaggingStream(HostStream):
    """A test double of a GPU stream: launched work runs `lag` seconds later on a device
    thread, in order; `ready()` (the host reads a result) waits for all of it."""

    def __init__(self, lag: float = 0.005, asynchronous: bool = True) -> None:
        self.lag = lag
        self.asynchronous = asynchronous
        self._work: queue.Queue = queue.Queue()
        self._error: BaseException | None = None
        threading.Thread(target=self._device, daemon=True).start()

    def _device(self) -> None:
        while True:
            item = self._work.get()
            if isinstance(item, _Done):
                item.event.set()
                continue
            time.sleep(self.lag)
            try:
                with torch.inference_mode():
                    item()
            except BaseException as exc:
                self._error = exc

    def launch(self, fn) -> None:
        self._work.put(fn)

    def record(self) -> Fence:
        fence = _Done()
        self._work.put(fence)
        return fence

    def ready(self) -> None:
        self.record().wait()
        if self._error is not None:
            raise self._error


@pytest.fixture(scope="module")
def runner(model_dir):
    torch.set_num_threads(1)
    return ModelRunner(model_dir, "float32", "cpu", attention="torch")


PROMPT = [(i * 7919) % 20000 + 100 for i in range(40)]
BLOCKS = [3, 7, 1]                                          # 40 tokens in three blocks


def _layer_blocks(pool: KVPoolMemory, layer: int) -> torch.Tensor:
    return pool.tensor[layer][:, BLOCKS].clone()


def _prefill_with(runner, stream, on_layer_for):
    """Prefill PROMPT on `stream` into a fresh pool; `on_layer_for(pool, copies)` makes
    the on_layer callback, which stores what a transfer of each layer would read."""
    pool = KVPoolMemory.allocate(runner.layout(8, BLOCK))
    pool.tensor.fill_(-7.0)                                 # the "old bytes" of reused blocks
    copies: dict[int, torch.Tensor] = {}
    runner.stream = stream
    try:
        logits = runner.prefill(pool, PROMPT, BLOCKS, on_layer=on_layer_for(pool, copies))
    finally:
        runner.stream = HostStream()
    final = {layer: _layer_blocks(pool, layer) for layer in range(runner.num_layers)}
    pool.close()
    return logits, copies, final


def test_the_double_catches_a_push_that_does_not_wait(runner):
    """The order the prefill worker had: post (here: copy) layer L at once. On the
    lagging stream the copies hold the old bytes: this is the race a GPU would have."""
    def naive(pool, copies):
        return lambda layer, fence: copies.__setitem__(layer, _layer_blocks(pool, layer))
    _, copies, final = _prefill_with(runner, LaggingStream(), naive)
    stale = [layer for layer in final if not torch.equal(copies[layer], final[layer])]
    assert len(stale) == runner.num_layers, f"only layers {stale} were read before their write"


@pytest.mark.parametrize("asynchronous", [False, True], ids=["inline", "poster-thread"])
def test_a_layer_is_posted_only_after_its_write(runner, asynchronous):
    reference, _, ref_final = _prefill_with(runner, HostStream(), lambda pool, copies: None)

    def ordered(pool, copies):
        poster = LayerPoster(lambda layer, _: copies.__setitem__(layer, _layer_blocks(pool, layer)), asynchronous)
        ordered.poster = poster
        return lambda layer, fence: poster(layer, None, fence)
    logits, copies, final = _prefill_with(runner, LaggingStream(asynchronous=asynchronous), ordered)
    ordered.poster.flush()
    assert sorted(copies) == list(range(runner.num_layers))
    for layer in final:
        assert torch.equal(copies[layer], final[layer]), f"layer {layer} was posted before its write finished"
        assert torch.equal(final[layer], ref_final[layer])
    assert torch.equal(logits, reference)                   # the lagging stream computes the same


def test_the_engine_posts_every_layer_of_a_step_after_its_write_and_before_the_step_ends(runner, model_dir):
    """The engine drives the hook the prefill worker registers: with a lagging,
    asynchronous stream every layer's push sees its final bytes, and all of a step's
    pushes are done when step() returns."""
    from services.engine.tokenizer import eos_token_ids
    pool = KVPoolMemory.allocate(runner.layout(32, BLOCK))
    pool.tensor.fill_(-7.0)
    seen: list[tuple[int, torch.Tensor, list[int]]] = []

    def hook(layer, plan):
        ids = [b for c in plan.chunks for b in c.seq.block_ids]
        seen.append((layer, pool.tensor[layer][:, ids].clone(), ids))
    runner.stream = LaggingStream(asynchronous=True)
    try:
        engine = LLMEngine(runner, pool, Scheduler(BlockManager(BlockPool(32, BLOCK)), SchedulerConfig(
            max_num_seqs=4, max_num_batched_tokens=256, prefill_only=True, retain_finished=True)), layer_hook=hook)
        eos = eos_token_ids(model_dir)
        for i in range(3):
            prompt = PROMPT[i:] + PROMPT[:i]
            engine.add(Sequence(f"r{i}", prompt, len(prompt), SamplingParams(max_tokens=1, temperature=0), eos))
        steps = 0
        while engine.has_work() and steps < 10:
            engine.step()
            steps += 1
            assert len(seen) % runner.num_layers == 0, "a step returned before all its layers were posted"
            for layer, copy, ids in seen:
                assert torch.equal(copy, pool.tensor[layer][:, ids]), f"layer {layer} posted before its write"
            seen.clear()
    finally:
        runner.stream = HostStream()
        pool.close()
