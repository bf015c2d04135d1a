"""KV is shipped only after the device has written it, a step's tokens are read without
waiting for the step after it, and every fence is on the pool's device
(services/engine/model/device.py).

No GPU here: `LaggingStream` stands in for one. Work launched on it runs later, on a
"device" thread, in launch order, after a delay, as a GPU's queued kernels do; a fence
passes once the work before it has run. A push that copies a layer's blocks as soon as the
layer is launched (the order the prefill worker had) sees the blocks' old bytes; one that
waits on the layer's fence (LayerPoster, inline or on its own thread) sees the new ones.
A tensor it marks as the device's waits for all the work launched before, when the host
reads it (`tolist`, `item`...), as a blocking copy on a CUDA stream does; `to_host`
copies behind the work launched so far and waits for that alone. `FakeCuda` stands in for
torch.cuda's per-thread current device, streams and events.
"""
from __future__ import annotations

import queue
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from services.engine.core.block_manager import BlockManager
from services.engine.core.block_pool import BlockPool
from services.engine.model.device import PASSED, Fence, HostCopy, HostStream, LayerPoster, stream_for, use_device
from services.engine.engine import LLMEngine
from services.engine.loop import EngineLoop
from services.engine.model.kv_cache import KVPoolMemory
from services.engine.model.runner import ModelRunner
from services.engine.core.sampling import SamplingParams
from services.engine.core.scheduler import Scheduler, SchedulerConfig
from services.engine.core.sequence import Sequence

BLOCK = 16


class _Done(Fence):
    def __init__(self) -> None:
        self.event = threading.Event()

    def wait(self) -> None:
        assert self.event.wait(30), "the device never reached the fence"


# What reads a tensor's values on the host: on a CUDA tensor, a blocking copy.
HOST_READS = {torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.numpy, torch.Tensor.__bool__,
              torch.Tensor.__int__, torch.Tensor.__float__, torch.Tensor.__index__}


class _Copy(HostCopy):
    def __init__(self) -> None:
        super().__init__([])
        self.copied: Fence = PASSED

    def wait(self) -> list[torch.Tensor]:
        self.copied.wait()
        return self._tensors


class LaggingStream(HostStream):
    """A test double of a GPU stream: launched work runs `lag` seconds later on a device
    thread, in order; `ready()` (the host reads a result) waits for all of it, and so does
    a host read of a tensor `on_device` marked (counted in `host_reads`); `to_host`
    copies when the device gets there and waits for that alone."""

    def __init__(self, lag: float = 0.005, asynchronous: bool = True) -> None:
        self.lag = lag
        self.asynchronous = asynchronous
        self.host_reads = 0
        self._work: queue.Queue = queue.Queue()
        self._error: BaseException | None = None
        stream = self

        class DeviceTensor(torch.Tensor):
            @classmethod
            def __torch_function__(cls, func, types, args=(), kwargs=None):
                if func in HOST_READS:
                    stream.host_reads += 1
                    stream.ready()
                return super().__torch_function__(func, types, args, kwargs)
        self._device_tensor = DeviceTensor
        threading.Thread(target=self._device, daemon=True).start()

    def on_device(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor`, and whatever is computed from it, as the device's."""
        return tensor.as_subclass(self._device_tensor)

    def to_host(self, tensors) -> HostCopy:
        copy = _Copy()
        self.launch(lambda: copy._tensors.extend(t.as_subclass(torch.Tensor).clone() for t in tensors))
        copy.copied = self.record()
        return copy

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
    from services.engine.text.tokenizer import eos_token_ids
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


def test_async_scheduling_reads_a_steps_tokens_while_the_next_step_computes(runner, model_dir, monkeypatch):
    """Step N's tokens, and the log probabilities asked for, are copied to the host behind
    its sampling, and reading them waits for that copy alone: here the device holds step
    N+1's work at a gate, and step N's outputs come out while it is held. (A blocking read
    of a device tensor, `tolist()`, would wait for the gate; none happens on the step's
    path.) The tokens and log probabilities are the synchronous engine's."""
    from services.engine.text.tokenizer import eos_token_ids
    eos = eos_token_ids(model_dir)
    params = SamplingParams(max_tokens=4, temperature=0, logprobs=2, prompt_logprobs=1)

    def run(engine, pool, on_second_step=lambda outputs: None):
        engine.add(Sequence("r", list(PROMPT), len(PROMPT), params, eos))
        out, steps = [], 0
        while engine.has_work():
            outputs = engine.step()
            steps += 1
            if steps == 2:
                on_second_step(outputs)
            out += [(o.token_ids, o.logprobs, o.prompt_logprobs) for o in outputs]
        pool.close()
        return out

    def engine_over(stream, async_scheduling):
        runner.stream = stream
        pool = KVPoolMemory.allocate(runner.layout(8, BLOCK))
        scheduler = Scheduler(BlockManager(BlockPool(8, BLOCK)), SchedulerConfig(max_num_seqs=2,
                                                                                max_num_batched_tokens=64))
        return LLMEngine(runner, pool, scheduler, async_scheduling=async_scheduling), pool

    try:
        expected = run(*engine_over(HostStream(), False))
        stream = LaggingStream(lag=0.0)
        gate, held, launches = threading.Event(), [], []
        execute = runner.execute

        def on_device(pool, batch, on_layer=None, *more):
            logits = execute(pool, batch, on_layer, *more)
            launches.append(batch)
            if len(launches) == 2:                      # the rest of step 2's work waits at the gate
                stream.launch(lambda: held.append(gate.wait(3)))
            return stream.on_device(logits)
        monkeypatch.setattr(runner, "execute", on_device)
        engine, pool = engine_over(stream, True)

        def second(outputs):
            # step 1 (the prompt) launched, step 2 launched behind the gate, step 1 read
            assert [o.token_ids for o in outputs] == [expected[0][0]]
            assert held == [], "step 1's tokens were read only once step 2's work had run"
            gate.set()
        got = run(engine, pool, second)
    finally:
        runner.stream = HostStream()
    assert stream.host_reads == 0
    assert engine.overlapped_steps > 0 and got == expected
    assert expected[0][2][1] is not None and expected[0][1]


class FakeCuda:
    """torch.cuda's devices, streams and events, on a machine without CUDA: as in CUDA,
    a thread's current device is 0 until it sets one, and an event records on the stream
    it is given (the current device's when none is). `recorded`: the device of each
    event's stream."""

    def __init__(self, monkeypatch) -> None:
        self._thread = threading.local()
        self.recorded: list[int] = []
        monkeypatch.setattr(torch.cuda, "set_device", self.set_device)
        monkeypatch.setattr(torch.cuda, "current_device", self.current_device)
        monkeypatch.setattr(torch.cuda, "current_stream", self.current_stream)
        monkeypatch.setattr(torch.cuda, "Event",
                            lambda: SimpleNamespace(record=self._record, synchronize=lambda: None))

    def set_device(self, device) -> None:
        self._thread.index = device.index if isinstance(device, torch.device) else int(device)

    def current_device(self) -> int:
        return getattr(self._thread, "index", 0)

    def current_stream(self, device=None) -> SimpleNamespace:
        return SimpleNamespace(device=torch.device("cuda", self.current_device() if device is None
                                                   else torch.device(device).index))

    def _record(self, stream=None) -> None:
        self.recorded.append((stream or self.current_stream()).device.index)


def test_fences_are_recorded_on_the_pools_device_whatever_the_threads_current_one(monkeypatch):
    """A worker on cuda:1 fences cuda:1's stream: a fence on device 0's (the current
    device of a thread that never set one) would pass at once, before the KV is written."""
    cuda = FakeCuda(monkeypatch)
    stream = stream_for(torch.device("cuda", 1))
    stream.record().wait()
    assert cuda.recorded == [1]
    assert torch.cuda.current_device() == 0                 # this thread never set one


def test_every_thread_that_touches_the_device_makes_it_current(monkeypatch):
    """The engine thread and the thread that posts KV transfers run on the pool's device;
    "cuda" alone means the current one."""
    FakeCuda(monkeypatch)
    device = torch.device("cuda", 1)
    assert use_device(torch.device("cuda")) == torch.device("cuda", 0)
    seen: dict[str, int] = {}
    poster = LayerPoster(lambda layer, _: seen.__setitem__("kv-post", torch.cuda.current_device()), True, device)
    poster(0, None, PASSED)
    poster.flush()

    class Idle:
        runner = SimpleNamespace(device=device)
        on_joined = last_step = None
        in_flight = False

        def has_work(self) -> bool:
            seen.setdefault("engine", torch.cuda.current_device())
            return False
    loop = EngineLoop(Idle())
    loop.start()
    for _ in range(100):
        if "engine" in seen:
            break
        time.sleep(0.02)
    loop.stop()
    assert seen == {"kv-post": 1, "engine": 1}
    assert torch.cuda.current_device() == 0
