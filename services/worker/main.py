"""The start-up and shutdown sequence both worker kinds share.

start:    load model -> build the service -> bind gRPC + metrics -> SERVING -> announce
          (file for a local supervisor; Redis record with a heartbeat, if --redis)
shutdown (SIGTERM/SIGINT): deregister -> NOT_SERVING, new work refused (UNAVAILABLE, so
          routers try another worker) -> drain: what was accepted runs to its end, up
          to --drain-timeout -> stop the server -> stop the engine (blocks released)
"""
from __future__ import annotations

import asyncio
import logging
import math
import time
from pathlib import Path
from typing import Callable

import grpc
import torch

from services.common.budgets import MIXED_PREFILL_CPU, MIXED_PREFILL_GPU, token_budget
from services.common.grpc_server import ServiceHost
from services.common.lifecycle import (announce, keep_freed_memory, set_torch_threads, settle_garbage_collector,
                                       stop_event_on_signals, stop_within)
from services.common.metrics import WorkerMetrics
from services.common.registry import Heartbeat, RedisRegistry
from services.common.security import ClusterSecret, KeyCheck, RequireBearer
from services.common.settings import SHUTDOWN_GRACE_SECONDS, WorkerSettings
from services.engine.text.model_store import checkpoint_parameters, resolve_model
from services.engine.model.runner import ModelRunner, pick_device
from services.engine.core.scheduler import SchedulerConfig
from services.engine.core.sampling import InvalidSampling, SamplingParams, no_token_left
from services.engine.structured import Grammars, SchemaError
from services.engine.text.tokenizer import eos_token_ids, load_tokenizer
from services.worker.ranks import rank_device, start_ranks
from services.worker.wire import ERROR_CODE_KEY, ERROR_PARAM_KEY, check_tokens

log = logging.getLogger(__name__)



def scheduler_config(settings: WorkerSettings, device: str = "cpu", context_cost: float = 0.0) -> SchedulerConfig:
    """`context_cost`: the runner's (ModelRunner.context_cost), by which a decode worker
    sizes the prompt chunks of its steps that decode."""
    prefill = settings.role == "prefill"
    budget = token_budget(settings.max_num_batched_tokens, settings.role, device)
    mixed = 0 if prefill else settings.mixed_prefill_tokens
    if mixed < 0:
        mixed = MIXED_PREFILL_CPU if device == "cpu" else MIXED_PREFILL_GPU
    whole = 0 if prefill else max(0, settings.mixed_whole_prompt_tokens)     # -1 here: none
    return SchedulerConfig(max_num_seqs=min(settings.max_batch, budget), max_num_batched_tokens=budget,
                           max_prefill_chunk=settings.prefill_chunk_tokens, max_mixed_prefill=mixed,
                           mixed_whole_prompt=whole, context_cost=0.0 if prefill else context_cost,
                           prefill_only=prefill, retain_finished=prefill)


def grammars_for(runner: ModelRunner, eos: frozenset[int]) -> Grammars:
    """The worker's structured-output compiler; the tokenizer loads on the first schema."""
    return Grammars(lambda: load_tokenizer(runner.model_dir), runner.vocab_size, eos)


def prepare(params: SamplingParams, vocab_size: int, grammars: Grammars, taken: list[int] = ()):
    """Check what `params` name against the vocabulary, and give the sequence its grammar
    constraint (None without a schema), moved past the tokens it has already `taken`
    (a first token sampled by the prefill worker). ValueError for what cannot run.
    Compiling can take a while: call it off the event loop."""
    check_tokens(params.token_ids_named(), vocab_size, "sampling parameters'", allow_empty=True)
    if params.structure is None:
        return None
    kind, text = params.structure
    constraint = grammars.constraint(text, kind, params.structure_after, params.structure_opens)
    for token in taken:
        if not constraint.accept(token):
            raise ValueError(f"token {token} does not fit the request's {kind}")
    return constraint


async def prepared(params: SamplingParams, vocab_size: int, grammars: Grammars, taken: list[int] = ()):
    """`prepare` on the grammar compilers' own threads (a slow compile holds one of them,
    not the threads that write KV)."""
    return await asyncio.get_running_loop().run_in_executor(grammars.executor, prepare, params, vocab_size,
                                                            grammars, taken)


def no_token_error(params: SamplingParams, constraint, position: int) -> ValueError:
    """The caller's error for a sequence that ended with no token left at output
    `position`: its grammar's, where following it became too costly, else its
    constraints'."""
    failure = getattr(constraint, "failure", None)
    return failure if failure is not None else no_token_left(params, position)


async def refuse(context, exc: ValueError) -> None:
    """Abort the call with INVALID_ARGUMENT for `exc`; a schema that cannot be used also
    says so in the trailing metadata, so the router answers with the code it gives the
    schemas it refuses itself."""
    if isinstance(exc, SchemaError):
        context.set_trailing_metadata(((ERROR_CODE_KEY, exc.code),))
    elif isinstance(exc, InvalidSampling):
        context.set_trailing_metadata(((ERROR_PARAM_KEY, exc.param),))
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))


class EngineStatus:
    """The Info and Stats RPCs every worker servicer answers from its engine, and the
    draining flag: once set, the servicer refuses new work with UNAVAILABLE."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.draining = False

    async def Info(self, request, context):
        info = self.engine.info()
        info.draining = self.draining
        return info

    async def Stats(self, request, context):
        return self.engine.stats()


class WorkerParts:
    """What a worker's `build` callback returns: its servicer registration, its engine
    (for the registry record) and teardown."""

    def __init__(self, service_name: str, servicer: EngineStatus, register: Callable,
                 stop: Callable[[], None]) -> None:
        self.service_name = service_name
        self.servicer = servicer
        self.engine = servicer.engine
        self.register = lambda server: register(servicer, server)
        self.stop = stop


async def _drain(engine, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    if engine.busy():
        log.info("draining: waiting up to %.0f s for accepted requests to finish", timeout)
    while engine.busy():
        if time.monotonic() > deadline:
            log.warning("drain timeout: stopping with requests still in progress")
            return
        await asyncio.sleep(0.1)


# Bytes a weight takes on a GPU in each --dtype (auto: bfloat16) and with int8 layers.
WEIGHT_BYTES = {"auto": 2, "bfloat16": 2, "float16": 2, "float32": 4}


def check_fits_the_card(model_dir: Path, settings: WorkerSettings) -> None:
    """On a GPU: ValueError, before minutes of loading, where a rank's share of the
    weights alone passes what --gpu-memory-utilization allows of its card (the ranks also
    hold the embeddings whole, the activations and the KV pool: this is a floor), with
    the tensor-parallel size that would leave room."""
    device = pick_device(settings.device)
    if device.type != "cuda":
        return
    per_weight = 1 if settings.quantization == "int8" else WEIGHT_BYTES.get(settings.dtype, 2)
    weights = checkpoint_parameters(model_dir) * per_weight
    tp = settings.tensor_parallel_size
    allowed = torch.cuda.mem_get_info(device)[1] * settings.gpu_memory_utilization
    if weights / tp >= allowed:
        needed = 1 << math.ceil(math.log2(weights / (0.8 * allowed)))     # tensor-parallel sizes go by twos
        raise ValueError(f"{model_dir.name}'s weights take {weights / 2**30:.1f} GiB, {weights / tp / 2**30:.1f} GiB "
                         f"a rank at --tensor-parallel-size {tp}: more than {settings.gpu_memory_utilization:g} of "
                         f"{device}'s {allowed / settings.gpu_memory_utilization / 2**30:.0f} GiB allows, with "
                         f"nothing left for the KV cache; use --tensor-parallel-size {needed} or more, int8 "
                         "(--quantization int8), or cards with more memory")


async def run_worker(settings: WorkerSettings, build: Callable[..., WorkerParts],
                     stop: asyncio.Event | None = None) -> int:
    """Serve until `stop` is set (default: SIGTERM/SIGINT), then drain and stop. Returns
    the process's exit status: 1 where the worker stopped because its engine's steps kept
    failing (its supervisor starts a fresh one), else 0."""
    import sys
    sys.setswitchinterval(0.0005)
    set_torch_threads(settings.threads)
    keep_freed_memory()
    model_dir = resolve_model(settings.model, settings.revision)
    check_fits_the_card(model_dir, settings)
    ranks = start_ranks(settings, model_dir) if settings.tensor_parallel_size > 1 else None
    device = str(rank_device(settings.device, 0)) if ranks is not None else settings.device
    runner = ModelRunner(model_dir, settings.dtype, device, attention=settings.attention_kernel,
                         matmul=settings.matmul_kernel, role=settings.role, own_threads=settings.own_threads,
                         max_model_len=settings.max_model_len, quantization=settings.quantization,
                         cuda_graphs=settings.cuda_graphs and not (ranks is not None and ranks.group.shared),
                         max_batch=settings.max_batch, group=ranks.group if ranks is not None else None)
    metrics = WorkerMetrics(settings.role, (settings.served_model_name or [model_dir.name])[0])
    parts = build(settings, runner, eos_token_ids(model_dir), metrics, ranks)
    if ranks is not None:
        ranks.watch()
    secret = ClusterSecret.from_file(settings.cluster_secret_file)
    host = ServiceHost([parts.service_name],
                       [RequireBearer(KeyCheck([secret.call_token]), "cluster credential")] if secret else None)
    parts.register(host.server)
    port = host.bind(settings.host, settings.grpc_port, settings.tls.server_credentials())
    metrics_port = metrics.serve(settings.host, settings.metrics_port)
    process_ends = stop is None                 # given no stop, the service is the process
    if stop is None:
        stop = stop_event_on_signals(asyncio.get_running_loop())
    failing: list[bool] = []
    serving = asyncio.get_running_loop()

    def engine_failing() -> None:
        """On the engine thread: steps keep failing (a device lost). The worker stops, as
        a stop signal stops it, and leaves the registry and the routers' choice."""
        failing.append(True)
        serving.call_soon_threadsafe(stop.set)
    parts.engine.loop.on_failing = engine_failing
    await host.server.start()
    settle_garbage_collector()
    await host.set_status(True)
    log.info("%s worker serving gRPC%s on %s:%d, metrics on :%d; model %s in %s", settings.role,
             " over TLS" if settings.tls_cert else "", settings.host, port, metrics_port, model_dir.name,
             runner.describe())
    if secret is None:
        log.warning("no --cluster-secret-file: any caller that reaches %s:%d can reserve KV blocks and read "
                    "prompts", settings.host, port)
    heartbeat = None
    if settings.redis:
        address = settings.advertise_address(port)
        started = time.time()

        def record():
            info = parts.engine.info()
            info.address, info.started_at = address, started
            return info
        registry = RedisRegistry(settings.redis, ttl=settings.registry_ttl, secret=secret)
        heartbeat = Heartbeat(registry, record)
        await heartbeat.start()
        log.info("registered in %s as %s %s", registry.where, settings.role, address)
    announce(settings.announce_file, grpc_port=port, metrics_port=metrics_port)
    try:
        await stop.wait()
    finally:
        with stop_within(settings.stop_seconds, process_ends):
            if heartbeat is not None:
                await heartbeat.stop()
            await host.set_status(False)
            parts.servicer.draining = True
            await _drain(parts.engine, settings.drain_timeout)
            await host.server.stop(SHUTDOWN_GRACE_SECONDS)
            parts.stop()
            if ranks is not None:
                ranks.stop()
            log.info("%s worker stopped%s", settings.role, " (its engine's steps kept failing)" if failing else "")
    return 1 if failing else 0
