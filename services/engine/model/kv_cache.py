"""KV block memory: one tensor per worker, laid out [layer, k/v, block, slot, kv_head, dim].

A decode worker's pool may live in a shared-memory file so that a prefill worker on the
same host writes straight into its reserved blocks. Segment names carry the owner's
pid, so segments left behind by a process that died are found and removed at start.
"""
from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from services.common.shm import SHM_DIR, new_segment_path, shm_free_bytes
from services.engine.model.device import to_device

log = logging.getLogger(__name__)

PROTOCOL_VERSION = 1


@dataclass(frozen=True)
class KVLayout:
    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str                          # "float32", "bfloat16", "float16"

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.num_layers, 2, self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def block_bytes_per_layer(self) -> int:
        """Bytes of one block's K and V in one layer."""
        elem = torch.empty((), dtype=self.torch_dtype).element_size()
        return 2 * self.block_size * self.num_kv_heads * self.head_dim * elem

    @property
    def nbytes(self) -> int:
        """Bytes of a pool of this layout."""
        return self.block_bytes_per_layer * self.num_blocks * self.num_layers

    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


def compat_hash(model_id: str, layout: KVLayout) -> str:
    """Everything two workers must agree on for KV bytes to mean the same thing."""
    key = {k: v for k, v in asdict(layout).items() if k != "num_blocks"}
    key.update(model=model_id, protocol=PROTOCOL_VERSION)
    return hashlib.sha256(repr(sorted(key.items())).encode()).hexdigest()[:16]


# A decode worker's pool on a CPU when no size is given: host memory is not measured.
CPU_KV_TOKENS = 65536


def tokens_for_memory(free: int, total: int, utilization: float, bytes_per_token: int, reserve: int,
                      own: int | None = None) -> int:
    """KV tokens that fit in a device's memory: this worker may use `utilization` of
    `total`; what it already holds (`own`: its weights) and `reserve` (its activations)
    come off first, and the pool never takes more than is `free`. So workers sharing a
    GPU each get their own share whatever order they start in (vLLM's per-instance
    meaning). Without `own`, all memory in use counts as this worker's. Raises when
    nothing is left."""
    used = total - free if own is None else own
    budget = min(int(total * utilization) - used, free) - reserve
    tokens = budget // bytes_per_token if budget > 0 else 0
    if tokens <= 0:
        raise ValueError(f"no memory is left for the KV cache: {total / 2**30:.1f} GiB x {utilization:g} leaves "
                         f"{max(budget, 0) / 2**30:.2f} GiB after {used / 2**30:.1f} GiB in use "
                         f"({free / 2**30:.1f} GiB free) and "
                         f"{reserve / 2**30:.2f} GiB for activations; raise --gpu-memory-utilization or use a "
                         "smaller model")
    return tokens


def device_memory(device: torch.device) -> tuple[int, int]:
    """(free, total) bytes of a CUDA device."""
    return torch.cuda.mem_get_info(device)


class KVPoolMemory:
    """The tensor behind a block pool; `path` is set when it is shared memory."""

    def __init__(self, layout: KVLayout, tensor: torch.Tensor, path: Path | None = None,
                 owner: bool = True, heads: range | None = None) -> None:
        self.layout = layout
        self.tensor = tensor
        self.path = path
        self._owner = owner
        # The model's KV heads this pool holds: all of them, or a tensor-parallel rank's
        # (services/engine/model/parallel.py); writers of another split read it.
        self.heads = range(layout.num_kv_heads) if heads is None else heads

    @classmethod
    def allocate(cls, layout: KVLayout, shared: bool = False, device: str = "cpu",
                 heads: range | None = None, pools: int = 1) -> "KVPoolMemory":
        """`heads`: the model's KV heads it holds (a tensor-parallel rank's; None: all);
        `pools`: with shared memory, how many pools of this size /dev/shm must hold
        (every tensor-parallel rank's goes there if this one does)."""
        if not shared:
            return cls(layout, torch.zeros(layout.shape, dtype=layout.torch_dtype, device=device), heads=heads)
        nbytes = layout.nbytes
        free = shm_free_bytes()
        if free < nbytes * pools:
            # tmpfs pages are only taken on first write: an oversized segment would be
            # created fine and then kill the process with SIGBUS mid-request.
            whose = "the KV pool needs" if pools == 1 else f"the KV pools of {pools} ranks need"
            raise MemoryError(f"{SHM_DIR} has {free / 2**20:.0f} MiB free, {whose} "
                              f"{nbytes * pools / 2**20:.0f} MiB (in containers, mount a larger /dev/shm)")
        path = new_segment_path()
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            # Every page taken now, not on first write: a later shortage of /dev/shm then
            # fails here, at start, instead of as SIGBUS mid-request.
            os.posix_fallocate(fd, 0, nbytes)
        except OSError as exc:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise MemoryError(f"cannot reserve {nbytes / 2**20:.0f} MiB in {SHM_DIR}: {exc}") from None
        os.close(fd)
        memory = cls(layout, cls._map(path, layout), path, owner=True, heads=heads)
        # tmpfs zeroes a reserved page on its first touch; touch them all now, so no
        # writer (a prefill worker mid-transfer) pays for that.
        memory.tensor.zero_()
        return memory

    @classmethod
    def attach(cls, path: Path, layout: KVLayout) -> "KVPoolMemory":
        return cls(layout, cls._map(path, layout), path, owner=False)

    @staticmethod
    def _map(path: Path, layout: KVLayout) -> torch.Tensor:
        flat = torch.from_file(str(path), shared=True, size=layout.numel(), dtype=layout.torch_dtype)
        return flat.view(layout.shape)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Every layer's K and V of each source block into its destination block, queued
        behind the device's work without waiting for it (the scheduler holds both blocks
        until the step after the copy has run)."""
        device = self.tensor.device
        src = to_device([a for a, _ in pairs], torch.long, device)
        dst = to_device([b for _, b in pairs], torch.long, device)
        self.tensor.index_copy_(2, dst, self.tensor.index_select(2, src))

    def close(self) -> None:
        self.tensor = torch.empty(0)
        if self._owner and self.path is not None:
            self.path.unlink(missing_ok=True)
            self.path = None
