"""Process plumbing shared by every service: logging, readiness announcements, signals."""
from __future__ import annotations

import asyncio
import contextlib
import faulthandler
import io
import json
import logging
import os
import signal
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Awaitable, Iterable, Iterator

log = logging.getLogger(__name__)


def setup_logging(level: str, role: str, fmt: str = "text") -> None:
    """Every record of the process through one handler on the root logger: `text` lines,
    or (`json`) one JSON object per line."""
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter(role) if fmt == "json" else
                         logging.Formatter(f"%(asctime)s {role} %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=level.upper(), handlers=[handler])
    for noisy in ("httpx", "uvicorn.access"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    # `kill -USR1 <pid>`: every thread's stack on stderr, the service running on (a
    # process that hangs says where, with no debugger at hand in its pod)
    stderr = _stderr_file()
    if stderr is not None:
        faulthandler.register(signal.SIGUSR1, file=stderr, all_threads=True)


def _stderr_file():
    """A stderr with a file descriptor, which faulthandler writes to (the process's own
    where sys.stderr is not one: a test's capture); None where neither is."""
    for stream in (sys.stderr, sys.__stderr__):
        try:
            stream.fileno()
        except (AttributeError, OSError, ValueError):
            continue
        return stream
    return None


class JsonFormatter(logging.Formatter):
    """One JSON object per record: time (UTC, ISO 8601), level, service, logger, message,
    the exception if any, and the record's own `fields` (given as extra={"fields": {...}})
    as keys of their own, so a log collector can filter on them."""

    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        out = {"time": datetime.fromtimestamp(record.created, timezone.utc).isoformat(timespec="milliseconds"),
               "level": record.levelname, "service": self.service, "logger": record.name,
               "message": record.getMessage()}
        out.update(getattr(record, "fields", {}))
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        elif record.stack_info:
            out["stack"] = self.formatStack(record.stack_info)
        return json.dumps(out, ensure_ascii=False, default=str)


def announce(path: str | None, **fields) -> None:
    """Tell a supervisor where this service listens: a JSON file written atomically."""
    if not path:
        return
    tmp = Path(f"{path}.tmp")
    tmp.write_text(json.dumps({"pid": os.getpid(), **fields}))
    tmp.replace(path)


def stop_event_on_signals(loop: asyncio.AbstractEventLoop) -> asyncio.Event:
    """An event set by SIGINT/SIGTERM, so services drain instead of dying mid-request."""
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    return stop


@contextlib.contextmanager
def stop_within(seconds: float, process_ends: bool) -> Iterator[None]:
    """The stop inside ends within `seconds`: if not, every thread's stack goes to stderr
    (headed "Timeout (h:mm:ss)!") and the process exits with status 1, rather than hang
    until its supervisor's SIGKILL says nothing. With `process_ends` (the service is the
    process) the watch goes on through the process's own end; without (a service inside
    another process: a Ray actor's) it ends with the block. One a process: faulthandler
    keeps one such timer."""
    stderr = _stderr_file()
    if stderr is not None:
        faulthandler.dump_traceback_later(seconds, exit=True, file=stderr)
    try:
        yield
    finally:
        if not process_ends and stderr is not None:
            faulthandler.cancel_dump_traceback_later()


async def within(awaited: Awaitable, seconds: float, what: str) -> bool:
    """Waits up to `seconds` for `awaited` (a coroutine or task); whether it ended. One
    still running is left as it is, and said by name: the stop goes on without it."""
    task = asyncio.ensure_future(awaited)
    await asyncio.wait([task], timeout=seconds)
    if not task.done():
        log.warning("%s: still running after %.1f s; going on without it", what, seconds)
        return False
    if not task.cancelled() and task.exception() is not None:
        log.warning("%s failed: %r", what, task.exception())
    return True


async def cancel_and_wait(tasks: Iterable[asyncio.Task], seconds: float, what: str) -> None:
    """Cancels `tasks` and waits up to `seconds` for them to end. One still running then
    (it swallowed its cancellation, or waits on what cancelling cannot end) is left, and
    logged with its stack: a stop never waits on it unbounded."""
    running = [t for t in tasks if not t.done()]
    for task in running:
        task.cancel()
    if not running:
        return
    _, left = await asyncio.wait(running, timeout=seconds)
    for task in left:
        stack = io.StringIO()
        task.print_stack(file=stack)
        log.warning("%s: %s still running %.1f s after it was cancelled\n%s", what, task.get_name(), seconds,
                    stack.getvalue())


def set_torch_threads(threads: int) -> None:
    import torch
    if threads > 0:
        torch.set_num_threads(threads)
        os.environ.setdefault("OMP_NUM_THREADS", str(threads))


# glibc mallopt parameters
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


def keep_freed_memory(mmap_threshold: int = 32 << 20, trim_threshold: int = 2**31 - 1) -> bool:
    """Let freed activation memory be reused instead of handed back to the kernel.

    A worker runs its model in an executor thread, whose glibc arena returns freed
    memory to the kernel after every pass; the next pass then takes a page fault, and
    a freshly zeroed page, for every 4 KiB it touches: ~80,000 faults and ~10 % of a
    1,024-token prefill here. A fixed mmap threshold (allocations below it come from
    the heap) and a trim threshold that is never reached stop that; the heap stays at
    the largest pass's working set, as a caching allocator's would. Not glibc: no-op."""
    import ctypes
    import ctypes.util
    name = ctypes.util.find_library("c")
    if not name:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    ok = mallopt(_M_MMAP_THRESHOLD, mmap_threshold) == 1       # 32 MiB is glibc's maximum
    return mallopt(_M_TRIM_THRESHOLD, trim_threshold) == 1 and ok


def settle_garbage_collector() -> None:
    """Once a service has built what it keeps for its lifetime (model, pools, servers):
    move those objects out of the collector's view, and collect young objects less
    often. An engine step allocates many short-lived Python objects; with the default
    thresholds the collector ran several times a step and walked the whole model each
    time (~4 % of a worker's CPU time here)."""
    import gc
    gc.collect()
    gc.freeze()
    gen0, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(max(gen0, 20_000), gen1, gen2)


def exit_now(code: int) -> None:
    """End the process with `code` at once, its output flushed, without tearing down the
    interpreter: for a service that has stopped everything it started. Tearing down a
    worker that holds torch and Triton takes most of a second more, and has Triton's
    bindings report hundreds of objects they never freed (nanobind's leak list) on every
    stop; a router's teardown would join its tokenizer threads and wait on gRPC's own
    shutdown, neither bounded."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)
