"""When the device has finished what the host asked of it: the seam between a forward
pass and the thread that ships its KV.

On a GPU a kernel launch returns at once; the KV write of layer L has only been queued
when the forward moves on to layer L+1. A transfer posted then (NIXL reads the memory
from the NIC, not through the stream) can ship the blocks' old bytes. So the forward
records a fence after each layer's write, and whoever posts that layer's transfer waits
on the fence first, on a thread of its own so the compute keeps running meanwhile (vLLM
and SGLang likewise send only once the device work is done).

    DeviceStream.launch(fn)   queue work on the stream (runs it now on a CPU)
    DeviceStream.record()     a Fence after everything launched so far
    DeviceStream.ready()      the host is about to read what the stream wrote
    DeviceStream.to_host(ts)  copy tensors to the host behind the work launched so far;
                              HostCopy.wait() waits for that copy alone, not for work
                              launched after it (async scheduling reads step N's tokens
                              while step N+1 computes)
    Fence.wait()              block until the work before the fence is done
    LayerPoster               waits each layer's fence, then posts its transfers:
                              inline for a synchronous stream, on a thread otherwise;
                              flush() at the end of the step
    use_device(device)        make the device current for the calling thread

CUDA's current device is per thread and 0 until a thread sets it, and an event records
on whichever stream it is given (the current device's when none is): so each thread that
touches a device sets it, and fences and copies name their device's stream, or a worker
on cuda:1 would fence device 0's stream, which has nothing queued.

A CPU runs every op to completion before returning, so its stream is synchronous and
its fences are already passed. tests/test_device_stream.py replaces the stream with a
double that defers the writes the way a GPU does, and fails a push that does not wait.
"""
from __future__ import annotations

import queue
import threading
from typing import Callable, Sequence

import torch


class Fence:
    """A point in a stream; this one is already passed."""

    def wait(self) -> None:
        return None


PASSED = Fence()


class HostCopy:
    """Tensors on their way to the host; these are there already."""

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        self._tensors = list(tensors)

    def wait(self) -> list[torch.Tensor]:
        """The tensors, on the host, once copied."""
        return self._tensors


def use_device(device: torch.device) -> torch.device:
    """Make a CUDA `device` current for the calling thread ("cuda" alone: the current one)
    and return it with its index; any other device is returned as it is."""
    if device.type != "cuda":
        return device
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.set_device(device)
    return device


class HostStream:
    """The CPU: work runs when launched."""
    asynchronous = False

    def launch(self, fn: Callable[[], None]) -> None:
        fn()

    def record(self) -> Fence:
        return PASSED

    def ready(self) -> None:
        return None

    def to_host(self, tensors: Sequence[torch.Tensor]) -> HostCopy:
        return HostCopy(tensors)


class _CudaFence(Fence):
    def __init__(self, device: torch.device) -> None:
        self.event = torch.cuda.Event()
        self.event.record(torch.cuda.current_stream(device))     # after what is queued there

    def wait(self) -> None:
        self.event.synchronize()


class _PinnedCopy(HostCopy):
    """Copied without blocking into pinned host memory, then an event: reading waits for
    the event alone. (A plain copy to the host, `tolist()` or `item()`, waits for all the
    stream's work, including a step launched after these tensors were made.)"""

    def __init__(self, tensors: Sequence[torch.Tensor], device: torch.device) -> None:
        super().__init__([torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
                          for t in tensors])
        self._copied = _CudaFence(device)

    def wait(self) -> list[torch.Tensor]:
        self._copied.wait()
        return self._tensors


class CudaStream(HostStream):
    """A CUDA device's current stream: launches are queued, consumers on the same stream
    are ordered after them, and another thread learns of completion through events."""
    asynchronous = True

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def record(self) -> Fence:
        return _CudaFence(self.device)

    def to_host(self, tensors: Sequence[torch.Tensor]) -> HostCopy:
        return _PinnedCopy(tensors, self.device)


def stream_for(device: torch.device) -> HostStream:
    return CudaStream(device) if device.type == "cuda" else HostStream()


def to_device(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`values` (a list or a host tensor) as a tensor on `device`, without waiting for
    the work already queued there. A plain copy to a CUDA device from pageable memory
    synchronizes the stream first, so it would wait out a step still running (async
    scheduling); from pinned memory, without blocking, it is queued behind that step
    (torch's pinned allocator keeps the buffer until the copy is done)."""
    host = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    host = host.to(dtype)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


LayerCallback = Callable[[int, object], None]


class LayerPoster:
    """Calls `post(layer, context)` for each layer once that layer's fence has passed.

    With a synchronous stream it posts inline (the fence has passed when it is
    recorded). With an asynchronous one a thread waits the fences in order and posts,
    so layer L's transfer starts as soon as its write is done while later layers
    compute; `flush()` returns when every layer handed over so far is posted. That thread
    makes `device` its current one: what `post` queues goes to the pool's device."""

    def __init__(self, post: LayerCallback, asynchronous: bool, device: torch.device | None = None) -> None:
        self.post = post
        self.asynchronous = asynchronous
        self.device = device
        self._queue: queue.Queue = queue.Queue()
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None

    def __call__(self, layer: int, context: object, fence: Fence) -> None:
        if not self.asynchronous:
            fence.wait()
            self.post(layer, context)
            return
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kv-post", daemon=True)
            self._thread.start()
        self._queue.put((layer, context, fence))

    def _run(self) -> None:
        if self.device is not None:
            use_device(self.device)
        while True:
            layer, context, fence = self._queue.get()
            try:
                fence.wait()
                self.post(layer, context)
            except BaseException as exc:            # re-raised on the engine thread at flush()
                self._error = exc
            finally:
                self._queue.task_done()

    def flush(self) -> None:
        if self._thread is not None:
            self._queue.join()
        if self._error is not None:
            error, self._error = self._error, None
            raise error
