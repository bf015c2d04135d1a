"""A worker's tensor-parallel ranks as processes (services/engine/model/parallel.py
splits the model and carries the steps).

Rank 0 is the worker process itself: its gRPC service, scheduler and block manager
serve all ranks. It starts ranks 1..N-1 (`start_ranks`), each on its own device (on a
CPU, with its own torch threads), and they meet rank 0 through torch.distributed. A
rank then loads the model, keeps its shard, and follows rank 0's commands:

    POOL     allocate this rank's KV pool (its heads of the same blocks) and register it
             with the worker's KV transports; the metadata goes back to rank 0, which
             offers it to writers with the rank's number (a decode worker), or uses it
             to write (a prefill worker)
    STEP     run the step's forward pass over this rank's shard
    CAPTURE  capture the decode steps' CUDA graphs, all-reduces inside, as rank 0 does
    COPY     copy KV blocks, as rank 0 does (forked choices, copy-on-write)
    CONNECT  pair this rank's transport with a peer rank's pool (a prefill worker)
    EXPORTS  before a prefill step: which blocks of which heads this rank writes where,
             layer by layer as the step computes them; after it, whether they landed
    STOP     leave

A rank dies with the worker (the kernel's parent-death signal), and the worker dies
with any rank (`Ranks.watch`): a worker missing a shard cannot compute a step, so it
exits and its supervisor (`pdserve up`, Kubernetes) starts it again, as for any
worker that dies. Requests it held fail over as for any dead worker.
"""
from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from kv_transfer.backends import open_transports
from kv_transfer.base import HeadSlice, KVTransport, PeerHandle, TransferError, wait_all
from services.common.lifecycle import set_torch_threads, setup_logging
from services.common.settings import WorkerSettings
from services.engine.model.device import LayerPoster
from services.engine.model.kv_cache import KVPoolMemory
from services.engine.model.parallel import Command, RankGroup, TensorParallel, decode_batch, rendezvous
from services.engine.model.runner import ForwardBatch, ModelRunner, PrefillSegment, pick_device

log = logging.getLogger(__name__)

# How often rank 0 looks at its ranks' processes.
WATCH_SECONDS = 0.2


def rank_device(device: str, rank: int) -> torch.device:
    """Rank `rank`'s device: the next GPU after the worker's first (--device cuda:N
    starts at N), round again when there are fewer GPUs than ranks (`shares_gpus`), or
    the CPU."""
    first = pick_device(device)
    if first.type != "cuda":
        return first
    return torch.device("cuda", ((first.index or 0) + rank) % torch.cuda.device_count())


def shares_gpus(device: str, size: int) -> bool:
    """Whether `size` ranks from `device` on must put two on one GPU: for correctness
    checks only (NCCL refuses two ranks on one GPU; gloo sums through the host then)."""
    first = pick_device(device)
    return first.type == "cuda" and (first.index or 0) + size > torch.cuda.device_count()


@dataclass(frozen=True)
class RankSpec:
    """What a rank process is started with (pickled once, at its start)."""
    settings: WorkerSettings
    model_dir: Path
    rank: int
    address: str                        # rank 0's rendezvous, host:port


class Ranks:
    """Rank 0's side: the other ranks' processes and the group they share."""

    def __init__(self, group: RankGroup, processes: list[multiprocessing.Process]) -> None:
        self.group = group
        self.processes = processes
        self._watch: threading.Thread | None = None
        self._stopping = False

    def open_pools(self, num_blocks: int, block_size: int, shared: bool, compat_hash: str) -> list[list]:
        """Every other rank allocates its KV pool and registers it; returns each one's
        [(backend, metadata)], rank 1 first."""
        self.group.send(Command.POOL, [num_blocks, block_size, int(shared)], compat_hash.encode())
        pools = self.group.gather(None)[1:]
        failed = [f"rank {rank}: {p}" for rank, p in enumerate(pools, start=1) if isinstance(p, str)]
        if failed:
            raise RuntimeError("tensor-parallel ranks could not open their KV pools: " + "; ".join(failed))
        return pools

    def watch(self) -> None:
        """From now on, a rank that dies takes the worker with it."""
        def run() -> None:
            while not self._stopping:
                for p in self.processes:
                    if not p.is_alive() and not self._stopping:
                        log.critical("tensor-parallel rank %s (pid %s) died with exit code %s: this worker "
                                     "cannot compute without it, and exits", p.name, p.pid, p.exitcode)
                        logging.shutdown()
                        os._exit(70)
                time.sleep(WATCH_SECONDS)
        self._watch = threading.Thread(target=run, name="rank-watch", daemon=True)
        self._watch.start()

    def stop(self) -> None:
        self._stopping = True
        try:
            self.group.send(Command.STOP)
        except Exception as exc:          # noqa: BLE001 - a rank already gone
            log.warning("could not tell the ranks to stop: %s", exc)
        for p in self.processes:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
        self.group.close()


def start_ranks(settings: WorkerSettings, model_dir: Path) -> Ranks:
    """Start ranks 1..N-1 of a worker of degree N and meet them (this process is rank 0)."""
    size = settings.tensor_parallel_size
    store, address = rendezvous(size)
    ctx = multiprocessing.get_context("spawn")
    processes = []
    for rank in range(1, size):
        p = ctx.Process(target=serve_rank, args=(RankSpec(settings, model_dir, rank, address),),
                        name=f"{settings.role}-rank-{rank}", daemon=True)
        p.start()
        processes.append(p)
    log.info("tensor parallel: %d ranks (pids %s) joining rank 0 at %s", size,
             ", ".join(str(p.pid) for p in processes), address)
    if shares_gpus(settings.device, size):
        log.warning("tensor parallel: %d ranks on %d GPU(s): ranks share a GPU and sum through gloo on the "
                    "host, with no CUDA graphs: for correctness checks, not speed", size, torch.cuda.device_count())
    return Ranks(RankGroup(TensorParallel(size, 0), rank_device(settings.device, 0), address,
                           shared=shares_gpus(settings.device, size), store=store), processes)


# ---- ranks 1..N-1 ----

def _die_with_parent() -> None:
    """Linux: SIGKILL this process when the worker that started it dies."""
    try:
        import ctypes
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)          # PR_SET_PDEATHSIG
    except OSError:
        pass


def serve_rank(spec: RankSpec) -> None:
    _die_with_parent()
    s = spec.settings
    setup_logging(s.log_level, f"{s.role}-rank-{spec.rank}", s.log_format)
    set_torch_threads(s.threads)
    device = rank_device(s.device, spec.rank)
    shared = shares_gpus(s.device, s.tensor_parallel_size)
    group = RankGroup(TensorParallel(s.tensor_parallel_size, spec.rank), device, spec.address, shared=shared)
    runner = ModelRunner(spec.model_dir, s.dtype, str(device), attention=s.attention_kernel,
                         matmul=s.matmul_kernel, role=s.role, own_threads=s.own_threads,
                         max_model_len=s.max_model_len, cuda_graphs=s.cuda_graphs and not shared,
                         max_batch=s.max_batch, group=group)
    log.info("rank %d of %d ready: %s", spec.rank, s.tensor_parallel_size, runner.describe())
    try:
        Follower(runner, group, s).run()
    finally:
        group.close()


# Commands that every rank must carry out alike, or fail together: a step (its
# all-reduces), a block copy (the KV the next steps read), a graph capture (replayed
# graphs and eager steps do not meet in their all-reduces). Rank 0 exits where one of
# them fails there (ModelRunner.execute); a rank after it exits where one fails here.
IN_STEP = frozenset({Command.STEP, Command.COPY, Command.CAPTURE})


class Follower:
    """A rank after the first: does what rank 0 says, over its own shard and pool."""

    def __init__(self, runner: ModelRunner, group: RankGroup, settings: WorkerSettings) -> None:
        self.runner = runner
        self.group = group
        self.settings = settings
        self.pool: KVPoolMemory | None = None
        self.transports: dict[str, KVTransport] = {}
        self.writer = RankWriter(group.tp.rank)
        # each layer's writes posted once its KV is written, on a thread of their own on
        # a GPU (as rank 0's, services/engine/engine.py)
        self.poster = LayerPoster(lambda layer, _: self.writer.push_layer(layer), runner.stream.asynchronous,
                                  runner.device)

    def run(self) -> None:
        handlers = {Command.STEP: self._step, Command.COPY: self._copy, Command.POOL: self._pool,
                    Command.CONNECT: self._connect, Command.EXPORTS: self.writer.plan,
                    Command.CAPTURE: lambda ints, data: self.runner.capture_graphs(self.pool)}
        try:
            while True:
                command, ints, data = self.group.receive()
                if command is Command.STOP:
                    return
                try:
                    handlers[command](ints, data)
                except Exception as exc:    # noqa: BLE001
                    log.exception("rank %d: %s failed", self.group.tp.rank, command.name)
                    if command in IN_STEP:
                        self.group.lost(f"{command.name} failed here ({type(exc).__name__}: {exc})")
        finally:
            for t in self.transports.values():
                t.shutdown()
            if self.pool is not None:
                self.pool.close()

    def _step(self, ints: list[int], data: bytes) -> None:
        batch = decode_batch(ints, ForwardBatch, PrefillSegment)
        if batch.pending_rows:
            batch.pending_tokens = self.group.receive_tensor(ints[-1])
        exporting, self.writer.active = self.writer.active, False
        try:
            self.runner.execute(self.pool, batch,
                                (lambda layer, fence: self.poster(layer, None, fence)) if exporting else None)
        finally:
            if exporting:
                self.poster.flush()
                self.group.marked(self.writer.num_exports, self.writer.settle())

    def _copy(self, ints: list[int], data: bytes) -> None:
        self.pool.copy_blocks(list(zip(ints[::2], ints[1::2])))

    def _pool(self, ints: list[int], data: bytes) -> None:
        """Allocate and register this rank's pool; rank 0 hears back either way (its
        offers, or what failed)."""
        try:
            offers = self._open_pool(ints, data)
        except Exception as exc:             # noqa: BLE001 - rank 0 reports it and stops the worker
            log.exception("rank %d: opening the KV pool failed", self.group.tp.rank)
            self.group.gather(f"{type(exc).__name__}: {exc}")
            return
        self.group.gather(offers)

    def _open_pool(self, ints: list[int], data: bytes) -> list[tuple[str, bytes]]:
        num_blocks, block_size, shared = ints
        layout = self.runner.layout(num_blocks, block_size)
        s = self.settings
        self.transports = open_transports(s.kv_transport, s.transport_options(), drop_rate=s.fault_drop_transfers,
                                          device=str(self.runner.device))
        if not shared and s.role == "decode":        # rank 0 did not offer it either
            shm = self.transports.pop("shm", None)
            if shm is not None:
                shm.shutdown()
        self.pool = KVPoolMemory.allocate(layout, shared=bool(shared), device=str(self.runner.device),
                                          heads=self.runner.kv_heads)
        compat = data.decode()
        offers = [(name, t.register(self.pool, compat)) for name, t in self.transports.items()]
        self.writer.transports, self.writer.compat_hash = self.transports, compat
        return offers

    def _connect(self, ints: list[int], data: bytes) -> None:
        self.writer.connect(ints, data)


@dataclass
class _Order:
    """One write this rank makes during a prefill step: blocks of some heads, to a peer."""
    export: int                         # the export's index in this step's list
    peer: int
    src: list[int]
    dst: list[int]
    heads: HeadSlice | None
    deadline: float                     # monotonic


class RankWriter:
    """A prefill rank's share of the KV export (services/worker/kv_export.py plans it on
    rank 0): its writes, posted as each layer is written, and whether they landed."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.transports: dict[str, KVTransport] = {}
        self.compat_hash = ""
        self.peers: dict[int, tuple[KVTransport, PeerHandle]] = {}
        self.orders: list[_Order] = []
        self.active = False                 # the next step exports: report how it went after it
        self.num_exports = 0                # the exports of that step, every rank's
        self._xfers: dict[int, list] = {}
        self._failed: set[int] = set()

    def connect(self, ints: list[int], data: bytes) -> None:
        """ints: (rank, peer index); data: backend name, a zero byte, the peer's metadata.
        Only for this rank: a failure is reported with the step that uses the peer."""
        rank, index = ints
        if rank != self.rank:
            return
        backend, _, meta = data.partition(b"\0")
        self.peers.pop(index, None)
        try:
            transport = self.transports[backend.decode()]
            self.peers[index] = (transport, transport.connect(meta, self.compat_hash))
        except (KeyError, TransferError) as exc:
            log.warning("rank %d cannot pair with a peer through %s: %s", self.rank, backend.decode(), exc)

    def plan(self, ints: list[int], data: bytes) -> None:
        """The next step's orders: (number of exports), then per order (rank, export,
        peer, n, src * n, dst * n, head src, head dst, head count (0: whole blocks),
        milliseconds to its deadline)."""
        self.active, self.num_exports = True, ints[0]
        self.orders, self._xfers, self._failed = [], {}, set()
        at = 1
        now = time.monotonic()
        while at < len(ints):
            rank, export, peer, n = ints[at:at + 4]
            src, dst = ints[at + 4:at + 4 + n], ints[at + 4 + n:at + 4 + 2 * n]
            hs, hd, count, ms = ints[at + 4 + 2 * n:at + 8 + 2 * n]
            at += 8 + 2 * n
            if rank == self.rank:
                self.orders.append(_Order(export, peer, src, dst, HeadSlice(hs, hd, count) if count else None,
                                          now + ms / 1000))

    def push_layer(self, layer: int) -> None:
        """Layer `layer` is written: post its writes."""
        for o in self.orders:
            if o.export in self._failed:
                continue
            try:
                if time.monotonic() >= o.deadline:
                    raise TransferError(f"write deadline passed at layer {layer}")
                transport, peer = self.peers[o.peer]
                self._xfers.setdefault(o.export, []).append(
                    (transport, transport.write(peer, o.src, o.dst, range(layer, layer + 1), o.heads, o.deadline)))
            except Exception as exc:            # noqa: BLE001 - any failed post leaves that KV incomplete
                log.warning("rank %d: export %d: %s", self.rank, o.export, exc)
                self._failed.add(o.export)

    def settle(self) -> list[int]:
        """After the step: wait for this step's writes to land; returns the exports whose
        writes failed (`RankGroup.marked` tells rank 0, which fails those requests)."""
        for export, xfers in self._xfers.items():
            if export in self._failed:
                continue
            deadline = min(o.deadline for o in self.orders if o.export == export)
            try:
                wait_all(xfers, deadline)
            except TransferError as exc:
                log.warning("rank %d: export %d: %s", self.rank, export, exc)
                self._failed.add(export)
        failed = sorted(self._failed)
        self.orders, self._xfers, self._failed = [], {}, set()
        return failed
