"""Same-host tensor-parallel ranks on a CPU talk through one shared-memory segment: the
all-reduce after each layer half, and rank 0's broadcast of each step's plan.

gloo over loopback took 0.6-1.6 ms an all-reduce of one decode step's hidden state
between two processes here (2-core AMD EPYC, Zen 4), and a model does two a layer:
60 for a 30-layer model, most of a step. Through shared memory it is a copy in, a flag,
and a sum (vLLM's CPU backend does the same with its shm all-reduce; its step plan goes
through a shared-memory broadcast queue, as here).

    segment:  counters (int64)   per rank: all-reduce sequence number; the broadcast's
                                 sequence number and length; per rank: broadcasts read
              broadcast area     rank 0's last message
              slots              [2][ranks][SLOT_BYTES]: each rank's partial sum, two
                                 sets used in turn

A rank writes its partial into its slot of set `seq % 2`, publishes `seq`, waits until
every rank has published `seq`, then sums the slots in rank order, so every rank gets
the same bits. Two sets suffice: a rank can only reach `seq + 2` (and reuse a set)
once all have published `seq + 1`, which each does after it has read the `seq` sums.
Ordering rests on x86's total store order (data stored before the flag is seen before
it); elsewhere the ranks use gloo (`usable`). Waits spin, yield, then sleep: a rank
idle between steps costs little, a step's all-reduces only microseconds.
"""
from __future__ import annotations

import mmap
import os
import platform
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from services.common.shm import new_segment_path

SLOT_BYTES = 8 << 20              # a partial sum: 8 MiB (e.g. 4,096 tokens x hidden 512 x float32)
BROADCAST_BYTES = 1 << 20         # one step's plan (a few KB) with room to spare
COUNTERS = 64
_BSEQ, _BLEN, _ACKS = 16, 17, 32  # counter indexes; per-rank all-reduce seqs start at 0
MAX_RANKS = 16
SPIN = 200                        # polls before sleeping
# A rank that waits longer than this for the others in an all-reduce gives up (gloo's
# default is 30 min; a step here takes well under a second): they are stuck or gone.
PEER_TIMEOUT = 120.0


class PeerTimeout(RuntimeError):
    """The other ranks did not reach an all-reduce (or read a message) in time."""


def usable(device: torch.device, size: int) -> bool:
    return device.type == "cpu" and platform.machine() in ("x86_64", "AMD64") and size <= MAX_RANKS


def segment_path() -> Path:
    """A new segment's name: the KV pools' prefix and this pid, so a dead worker's
    segment is swept like its pools (shm.sweep_stale_segments)."""
    return new_segment_path("tp-")


class SharedMemoryComm:
    def __init__(self, rank: int, size: int, path: Path, create: bool) -> None:
        self.rank, self.size = rank, size
        header = COUNTERS * 8
        total = header + BROADCAST_BYTES + 2 * size * SLOT_BYTES
        fd = os.open(path, (os.O_CREAT | os.O_EXCL | os.O_RDWR) if create else os.O_RDWR, 0o600)
        try:
            if create:
                os.posix_fallocate(fd, 0, total)
            self._mm = mmap.mmap(fd, total)
        except BaseException:
            if create:                      # /dev/shm full: nothing of it is left behind
                path.unlink(missing_ok=True)
            raise
        finally:
            os.close(fd)
        self._counters = np.frombuffer(self._mm, dtype=np.int64, count=COUNTERS)
        self._broadcast = np.frombuffer(self._mm, dtype=np.uint8, count=BROADCAST_BYTES, offset=header)
        self._slots = torch.frombuffer(self._mm, dtype=torch.uint8, count=2 * size * SLOT_BYTES,
                                       offset=header + BROADCAST_BYTES).view(2, size, SLOT_BYTES)
        self._seq = 0
        self._bseq = 0
        self.peer_timeout = PEER_TIMEOUT

    def _wait(self, ready: Callable[[], bool], limited: bool = True) -> None:
        polls = 0
        deadline = None
        while not ready():
            polls += 1
            if polls < SPIN:
                os.sched_yield()
                continue
            time.sleep(0.00005 if polls < 4 * SPIN else 0.0005)
            if limited:
                deadline = deadline or time.monotonic() + self.peer_timeout
                if time.monotonic() > deadline:
                    raise PeerTimeout(f"the other tensor-parallel ranks did not answer in {self.peer_timeout:g} s")

    # ---- all-reduce ----
    def fits(self, t: torch.Tensor) -> bool:
        return t.is_contiguous() and t.numel() * t.element_size() <= SLOT_BYTES

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's `t`, into `t` (the same bits on every rank)."""
        n = t.numel() * t.element_size()
        self._seq += 1
        seq, slots = self._seq, self._slots[self._seq & 1]
        slots[self.rank, :n].copy_(t.reshape(-1).view(torch.uint8))
        self._counters[self.rank] = seq
        counters = self._counters
        self._wait(lambda: all(counters[j] >= seq for j in range(self.size)))
        parts = [slots[j, :n].view(t.dtype).view(t.shape) for j in range(self.size)]
        torch.add(parts[0], parts[1], out=t)
        for part in parts[2:]:
            t.add_(part)
        return t

    # ---- rank 0's messages ----
    def send(self, payload: bytes) -> bool:
        """Publish `payload` to the other ranks; False if it does not fit (a -1 length
        tells them to take it from the fallback channel instead)."""
        counters = self._counters
        bseq = self._bseq
        self._wait(lambda: all(counters[_ACKS + j] >= bseq for j in range(1, self.size)))
        fits = len(payload) <= BROADCAST_BYTES
        if fits:
            self._broadcast[:len(payload)] = np.frombuffer(payload, dtype=np.uint8)
        counters[_BLEN] = len(payload) if fits else -1
        self._bseq += 1
        counters[_BSEQ] = self._bseq
        return fits

    def receive(self) -> bytes | None:
        """The next message (None: it is on the fallback channel)."""
        counters = self._counters
        want = self._bseq + 1
        self._wait(lambda: counters[_BSEQ] >= want, limited=False)       # idle between steps: no limit
        length = int(counters[_BLEN])
        payload = None if length < 0 else self._broadcast[:length].tobytes()
        self._bseq = want
        counters[_ACKS + self.rank] = want
        return payload

    def close(self) -> None:
        self._slots = self._broadcast = self._counters = None
        try:
            self._mm.close()
        except BufferError:             # a tensor view still alive: the mapping goes with the process
            pass
