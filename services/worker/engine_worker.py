"""What a prefill and a decode worker share: a model runner over a KV pool, the block
manager and scheduler that own the pool's blocks, the engine and its thread, the KV
transports, the structured-output compiler, and the records the router reads.

A subclass sizes its pool (`_open`), says what its engine does after each step
(`_on_step`) and adds its own fields to `info`.
"""
from __future__ import annotations

import logging
import uuid

from kv_transfer.base import KVTransport
from services.common.metrics import WorkerMetrics
from services.common.settings import WorkerSettings
from services.engine.core.block_manager import BlockManager
from services.engine.core.block_pool import BlockPool
from services.engine.core.scheduler import Scheduler
from services.engine.core.speculation import Speculator
from services.engine.engine import LLMEngine, StepStats
from services.engine.loop import EngineLoop
from services.engine.model.kv_cache import KVPoolMemory
from services.engine.model.runner import ModelRunner
from services.rpc import worker_pb2
from services.worker.main import grammars_for, scheduler_config
from services.worker.ranks import Ranks

log = logging.getLogger(__name__)


class EngineWorker:
    role = ""

    def __init__(self, settings: WorkerSettings, runner: ModelRunner, eos: frozenset[int],
                 metrics: WorkerMetrics, ranks: Ranks | None = None) -> None:
        self.settings = settings
        self.runner = runner
        self.ranks = ranks                          # tensor parallelism: the other ranks (services/worker/ranks.py)
        self.eos = eos
        self.metrics = metrics
        self.epoch = uuid.uuid4().hex[:12]          # a restarted worker is another epoch
        self.config = scheduler_config(settings, runner.device.type, runner.context_cost)
        self.transports: dict[str, KVTransport] = {}

    def _layout(self, num_blocks: int) -> None:
        """The pool's shape, and the hash a peer's must equal for KV to cross."""
        self.layout = self.runner.layout(num_blocks, self.settings.block_size)
        self.compat_hash = self.runner.compat_hash(self.layout)

    def _rank_offers(self, shared: bool) -> list[worker_pb2.TransportOffer]:
        """The other ranks' pools (same blocks, their own KV heads), allocated and
        registered with their transports: what a writer needs to reach each."""
        if self.ranks is None:
            return []
        pools = self.ranks.open_pools(self.layout.num_blocks, self.layout.block_size, shared, self.compat_hash)
        return [worker_pb2.TransportOffer(backend=name, meta=meta, rank=rank)
                for rank, offers in enumerate(pools, start=1) for name, meta in offers]

    def _open(self, memory: KVPoolMemory, prefix_caching: bool, speculator: Speculator | None = None,
              **engine_options) -> None:
        """The engine over `memory`: its blocks, scheduler (with `speculator`'s drafts),
        grammars and thread."""
        self.memory = memory
        n = self.layout.num_blocks
        self.blocks = BlockManager(BlockPool(n, self.layout.block_size), prefix_caching=prefix_caching)
        self.engine = LLMEngine(self.runner, memory, Scheduler(self.blocks, self.config, speculator),
                                own_threads=self.settings.own_threads, **engine_options)
        self.grammars = grammars_for(self.runner, self.eos)
        self.loop = EngineLoop(self.engine, tick=self._tick, on_step=self._on_step, name=f"{self.role}-engine")
        self.metrics.set_blocks(n, n)

    def start(self) -> None:
        self.loop.start()

    def stop(self) -> None:
        self.loop.stop()
        for t in self.transports.values():
            t.shutdown()
        self.memory.close()

    # ---- engine thread ----
    def _tick(self) -> None:
        """Before each step: the gauges."""
        sch = self.engine.scheduler
        self.metrics.set_blocks(self.blocks.num_available, self.blocks.num_blocks)
        self.metrics.set_queue(len(sch.running), sch.num_waiting)

    def _on_step(self, stats: StepStats) -> None:
        raise NotImplementedError

    # ---- any thread ----
    def info(self) -> worker_pb2.WorkerInfo:
        return worker_pb2.WorkerInfo(
            role=self.role, epoch=self.epoch, compat_hash=self.compat_hash, model_name=self.runner.model_dir.name,
            block_size=self.layout.block_size, num_blocks=self.blocks.num_blocks,
            free_blocks=self.blocks.num_available, max_model_len=self.runner.max_model_len,
            kv_transports=list(self.transports), prefix_hashes=self.blocks.keys_newest_first(),
            prefix_caching=self.blocks.prefix_caching)
