"""Decode worker: holds the paged KV pool, accepts handoffs, runs continuous batching.

A request's life here, as queues:
  Reserve   -> the scheduler reserves blocks for the prompt (waiting for remote KV),
               handoff RESERVED with a write lease
  (the prefill worker writes the prompt's KV straight into those blocks)
  Decode    -> handoff COMPLETE -> DECODING; the sequence takes the reserved blocks and
               joins the engine's ready queue, then the running batch at the next step,
               and streams tokens
  Decode with local_prefill -> the engine prefills the prompt here, in chunks that
               share each forward pass with the running batch's decode tokens
  finish / cancel / failure -> blocks back to the pool, handoff RELEASED
  no Decode before the lease ends -> the scheduler expires the reservation, blocks back
               to the pool, handoff EXPIRED

The engine core (`services/engine/engine.py`) owns scheduling, blocks and the model, on
its own thread: reservations are made and given back there too (`EngineLoop.call`).
This service adds the handoff table, leases and the token streams.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time

import grpc

from kv_transfer.backends import open_transports
from kv_transfer.handoff import HandoffError, HandoffState, HandoffTable, KVHandoff
from services.common.mailbox import Mailbox
from services.common.metrics import WorkerMetrics
from services.common.settings import WorkerSettings
from services.common.shm import sweep_stale_segments
from services.engine.core.block_pool import NoFreeBlocks
from services.engine.core.sampling import MAX_CHOICES, SamplingParams
from services.engine.core.sequence import NO_TOKEN_LEFT, Sequence
from services.engine.core.speculation import Speculator
from services.engine.engine import EngineOutput, StepStats
from services.engine.model.draft import draft_proposer, draft_runner
from services.engine.model.kv_cache import KVPoolMemory
from services.engine.model.runner import ModelRunner
from services.rpc import worker_pb2, worker_pb2_grpc
from services.worker.engine_worker import EngineWorker
from services.worker.main import EngineStatus, WorkerParts, no_token_error, prepared, refuse
from services.worker.wire import (check_request_id, check_tokens, logprob_to_proto, prompt_logprobs_to_proto,
                                  sampling_from_proto)

log = logging.getLogger(__name__)

# A reservation outlives its writer's lease by this much before it expires: a Decode
# call on its way when the lease ends still finds it.
LEASE_GRACE_SECONDS = 2.0
# Finish reasons that end a call with an error: the tokens before them go out first.
FAILURES = frozenset({"error", NO_TOKEN_LEFT})


class DecodeWorker(EngineWorker):
    """The engine, its KV pool and the handoffs into it; no gRPC in here."""
    role = "decode"

    def __init__(self, settings: WorkerSettings, runner: ModelRunner, eos_token_ids: frozenset[int],
                 metrics: WorkerMetrics, ranks=None) -> None:
        super().__init__(settings, runner, eos_token_ids, metrics, ranks)
        config = self.config
        speculation = settings.speculation()
        draft = draft_runner(speculation, runner)        # a draft model's share comes off the pool's
        tokens = runner.kv_tokens(settings.kv_cache_tokens, settings.gpu_memory_utilization,
                                  config.max_num_batched_tokens, config.max_num_seqs, draft)
        num_blocks = tokens // settings.block_size
        if num_blocks * settings.block_size < runner.max_model_len:
            # A sequence that can never fit would wait (or preempt itself) forever.
            raise ValueError(f"a KV pool of {tokens} tokens cannot hold one full context of {runner.max_model_len} "
                             "tokens: give --kv-cache-tokens, or --max-model-len")
        self._layout(num_blocks)
        sweep_stale_segments()
        self.transports = open_transports(settings.kv_transport, settings.transport_options(),
                                          device=str(runner.device))
        memory = self._allocate_pool(settings, str(runner.device))
        self.offers = [worker_pb2.TransportOffer(backend=name, meta=t.register(memory, self.compat_hash))
                       for name, t in self.transports.items()]
        self.offers += self._rank_offers(shared=memory.path is not None)
        log.info("decode worker offers KV transports: %s", ", ".join(self.transports))
        overlap = settings.async_scheduling == "on" or (settings.async_scheduling == "auto"
                                                        and runner.device.type == "cuda")
        speculator = None
        if speculation is not None:
            speculator = Speculator(speculation, draft_proposer(speculation, runner, tokens, settings.block_size,
                                                                draft))
            metrics.export_speculation(lambda: speculator.stats)
        self._open(memory, settings.enable_prefix_caching, speculator, async_scheduling=overlap)
        log.info("async scheduling: %s", "on (each step launched before the last one's tokens are read)"
                 if overlap else "off")
        if speculation is not None:
            log.info("speculative decoding: %s, up to %d tokens a step, %s", speculation.method,
                     speculation.num_speculative_tokens,
                     "adaptive" if speculation.adaptive else "every draft found")
        runner.capture_graphs(memory)                   # on a GPU; before the worker says it is ready
        self.handoffs = HandoffTable(self.epoch)
        self.kv_bytes_received = 0
        self._lock = threading.Lock()           # the handoff table: RPC threads and the engine thread
        self._decoding: set[str] = set()        # request ids of the choices being decoded
        self._preemptions_seen = 0

    def _allocate_pool(self, settings: WorkerSettings, device: str) -> KVPoolMemory:
        """In shared memory when `shm` is offered; if /dev/shm is too small and other
        backends remain (auto), drop `shm` loudly instead of failing to start. Under
        tensor parallelism every rank's pool goes there if this one does: /dev/shm must
        hold them all."""
        heads = self.runner.kv_heads
        if "shm" not in self.transports:
            return KVPoolMemory.allocate(self.layout, device=device, heads=heads)
        try:
            return KVPoolMemory.allocate(self.layout, shared=True, device=device, heads=heads,
                                         pools=settings.tensor_parallel_size)
        except MemoryError as exc:
            if len(self.transports) == 1:
                raise ValueError(f"--kv-transport shm: {exc}") from None
            log.warning("not offering shm: %s", exc)
            self.transports.pop("shm").shutdown()
            return KVPoolMemory.allocate(self.layout, device=device, heads=heads)

    # ---- called from RPC handlers (any thread) ----
    async def reserve(self, request_id: str, num_tokens: int, lease_seconds: float) -> KVHandoff:
        """Blocks for a prompt's KV, reserved by the scheduler on the engine thread, and
        the handoff that leases them to a writer."""
        check_request_id(request_id)
        if not 1 <= num_tokens <= self.runner.max_model_len:
            raise ValueError(f"a reservation is for 1 to {self.runner.max_model_len} tokens, not {num_tokens}")
        if not lease_seconds > 0:
            raise ValueError(f"lease_seconds must be positive, not {lease_seconds}")
        # Whatever a caller asks, a reservation lasts at most this long unless decoding starts.
        lease_seconds = min(lease_seconds, self.settings.max_lease_seconds)
        with self._lock:
            if request_id in self._decoding:
                raise HandoffError(f"request {request_id} is already decoding here")
            if request_id in self.handoffs:
                raise HandoffError(f"request {request_id} already holds a reservation")
        # The writer's deadline and the blocks' expiry come from one instant: the wait for
        # the engine below must not push the deadline past the expiry, when the blocks go
        # back to the pool while the writer may still write them.
        deadline = time.time() + lease_seconds
        expires = deadline + LEASE_GRACE_SECONDS
        scheduler = self.engine.scheduler
        # At once, not at the next step: a decode step can take a tenth of a second, and
        # the prompt's prefill waits for these blocks.
        reserving = asyncio.ensure_future(asyncio.to_thread(
            self.engine.now, lambda: scheduler.reserve(request_id, num_tokens, expires)))
        try:
            r = await asyncio.shield(reserving)
        except asyncio.CancelledError:          # the caller left: the blocks, once reserved, go back
            def give_back(made: asyncio.Future) -> None:
                if not made.cancelled() and made.exception() is None:
                    self.loop.call(lambda: scheduler.cancel(request_id))
            reserving.add_done_callback(give_back)
            raise
        with self._lock:
            try:
                left = deadline - time.time()
                if left <= 0:
                    raise TimeoutError(f"request {request_id}: its lease ran out while its blocks were reserved")
                return self.handoffs.reserve(request_id, r.block_ids, num_tokens, left)
            except (HandoffError, TimeoutError):
                self.loop.call(lambda: scheduler.cancel(request_id))
                raise

    def release(self, request_id: str, epoch: str, reason: str) -> bool:
        with self._lock:
            try:
                h = self.handoffs.get(request_id, epoch)
            except HandoffError:
                if epoch != self.epoch:
                    raise
                if request_id not in self._decoding:
                    # Its Reserve may still be making the reservation (the caller gave up
                    # waiting): whatever the scheduler holds under this id goes back.
                    self.loop.call(lambda: self.engine.scheduler.cancel(request_id))
                    raise
                self.loop.abort(request_id)         # one choice of a request ends (a stop string)
                return True
            if h.state is HandoffState.DECODING:
                self.loop.abort(request_id)
                return True
            self.handoffs.pop(request_id, HandoffState.FAILED if reason else HandoffState.RELEASED)
        self.loop.call(lambda: self.engine.scheduler.cancel(request_id))     # a waiting prompt may fit now
        self.metrics.handoffs.labels("released_before_decode").inc()
        log.info("request %s: reservation released (%s)", request_id, reason or "no reason given")
        return True

    def admit(self, seq: Sequence, epoch: str | None, sinks: list, kv_bytes: int, backend: str) -> None:
        """Start decoding `seq` and the choices forked from it (`seq.forks`); sink i
        receives choice i's outputs from the engine thread. With an epoch the prompt KV
        came through a handoff, into the blocks reserved for it."""
        lookup = [epoch is None]            # a prompt computed here: its cache lookup, counted once
        def deliver(request_id: str, sink):
            def to(output: EngineOutput) -> None:
                if lookup[0] and output.token_ids and request_id == seq.request_id:
                    lookup[0] = False
                    self.metrics.observe_prefix(seq.prompt_len, output.cached_tokens)
                if output.finish_reason:
                    self._retire(request_id, output.finish_reason)
                sink(output)
            return to
        choices = [seq, *seq.forks]
        ids = [c.request_id for c in choices]
        first, *others = [deliver(c.request_id, sink) for c, sink in zip(choices, sinks, strict=True)]
        if epoch is None:
            with self._lock:
                self._claim(ids, reserved_ok=False)
            self.loop.submit(seq, first, fork_sinks=others)
            return
        with self._lock:
            h = self.handoffs.get(seq.request_id, epoch)
            if len(seq.token_ids) - 1 != h.num_tokens:
                raise HandoffError(f"handle covers {h.num_tokens} tokens, request has {len(seq.token_ids) - 1}")
            self._claim(ids, reserved_ok=True)          # from here the reservation cannot expire
            self.handoffs.advance(h, HandoffState.COMPLETE)
            self.handoffs.advance(h, HandoffState.DECODING)
        self.kv_bytes_received += kv_bytes
        self.metrics.kv_bytes.labels("received", backend).inc(kv_bytes)
        self.loop.submit(seq, first, prefilled=True, fork_sinks=others)

    def _claim(self, ids: list[str], reserved_ok: bool) -> None:
        """Mark `ids` as decoding here, or ValueError if one already is (or holds a
        reservation a local prefill would shadow): a caller's duplicate fails alone,
        and never takes over another sequence's stream or blocks. Under `_lock`."""
        taken = next((i for i in ids if i in self._decoding or (not reserved_ok and i in self.handoffs)), None)
        if taken is not None:
            raise ValueError(f"request {taken} is already here")
        self._decoding.update(ids)

    def abort(self, request_id: str) -> None:
        self.loop.abort(request_id)

    def check(self, request: worker_pb2.DecodeRequest) -> tuple[list[int], SamplingParams]:
        """The prompt and sampling of a Decode call, or ValueError: nothing a worker is
        sent runs before it is known to fit the model and its context."""
        check_request_id(request.request_id)
        vocab, context = self.runner.vocab_size, self.runner.max_model_len
        prompt = check_tokens(request.prompt_token_ids, vocab)
        check_tokens(taken_tokens(request), vocab, "first", allow_empty=True)
        if request.first_token_given and (request.n or 1) > 1:
            raise ValueError("a given first token is for one choice (n = 1)")
        params = sampling_from_proto(request.sampling)
        if len(prompt) + params.max_tokens > context:
            raise ValueError(f"{len(prompt)} prompt tokens and max_tokens {params.max_tokens} exceed the model's "
                             f"context of {context} tokens")
        return prompt, params

    # ---- engine thread ----
    def _tick(self) -> None:
        """Before each step: reservations whose lease ran out with no decode go back."""
        with self._lock:
            expired = self.engine.scheduler.expire(time.time(), claimed=self._decoding.__contains__)
            for r in expired:
                self.handoffs.pop(r.request_id, HandoffState.EXPIRED)
        for r in expired:
            log.warning("handoff %s EXPIRED; its %d blocks return to the pool", r.request_id, len(r.block_ids))
            self.metrics.handoffs.labels("expired").inc()
        super()._tick()
        sch = self.engine.scheduler
        self.metrics.running.set(len(sch.running))
        self.metrics.waiting.set(sch.num_waiting)

    def _on_step(self, stats: StepStats) -> None:
        kind = "mixed" if stats.prefill_tokens and stats.decode_tokens else "prefill" if stats.prefill_tokens \
            else "decode"
        self.metrics.step_seconds.labels(kind).observe(stats.seconds)
        self.metrics.prompt_tokens_computed.inc(stats.prefill_tokens)
        self.metrics.generated_tokens.inc(stats.generated)
        self.metrics.preemptions.inc(self.engine.scheduler.num_preemptions - self._preemptions_seen)
        self._preemptions_seen = self.engine.scheduler.num_preemptions

    def _retire(self, request_id: str, reason: str) -> None:
        with self._lock:
            self._decoding.discard(request_id)
            h = self.handoffs.pop(request_id, HandoffState.RELEASED)
        if h is not None:
            self.metrics.handoffs.labels("released").inc()
        self.metrics.requests.labels(reason).inc()

    def stats(self) -> worker_pb2.WorkerStats:
        return worker_pb2.WorkerStats(info=self.info(), prompt_tokens_computed=self.engine.prompt_tokens_computed,
                                      kv_bytes_received=self.kv_bytes_received, active_handoffs=len(self.handoffs))

    def busy(self) -> bool:
        """Anything accepted and not yet finished: sequences or reservations."""
        return bool(self.loop.num_requests or len(self.handoffs))

    def info(self) -> worker_pb2.WorkerInfo:
        info = super().info()
        sch = self.engine.scheduler
        info.running, info.waiting, info.max_batch = len(sch.running), sch.num_waiting, sch.config.max_num_seqs
        return info


def taken_tokens(request: worker_pb2.DecodeRequest) -> list[int]:
    """What follows the prompt before this worker samples: the first token, where it was
    sampled elsewhere (a handoff, or an earlier try that sent it)."""
    return [request.first_token_id] if not request.local_prefill or request.first_token_given else []


class DecodeService(EngineStatus, worker_pb2_grpc.DecodeWorkerServicer):
    _mailbox: Mailbox | None = None
    _refused = 0                        # Decode calls refused for --fault-refuse-decodes

    def _faults_left(self) -> bool:
        if self._refused < self.engine.settings.fault_refuse_decodes:
            self._refused += 1
            return True
        return False

    def _mailbox_for(self, loop: asyncio.AbstractEventLoop) -> Mailbox:
        """The streams' tokens reach the RPC handlers through one mailbox per event loop:
        a step's tokens for every stream wake the loop once."""
        if self._mailbox is None or self._mailbox.loop is not loop:
            self._mailbox = Mailbox(loop)
        return self._mailbox

    async def Reserve(self, request, context):
        e = self.engine
        if self.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "this decode worker is draining")
        try:
            h = await e.reserve(request.request_id, request.num_prompt_tokens, request.lease_seconds or 30.0)
        except NoFreeBlocks as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"no free KV blocks: {exc}")
        except TimeoutError as exc:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, str(exc))
        except (ValueError, HandoffError) as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return worker_pb2.KVHandle(
            request_id=h.request_id, epoch=e.epoch, block_ids=h.block_ids, num_tokens=h.num_tokens,
            write_deadline=h.write_deadline, write_seconds=max(0.0, h.write_deadline - time.time()), offers=e.offers,
            compat_hash=e.compat_hash)

    async def Release(self, request, context):
        try:
            released = self.engine.release(request.request_id, request.epoch, request.reason)
        except HandoffError:
            released = False
        return worker_pb2.ReleaseResponse(released=released)

    async def Decode(self, request, context):
        e = self.engine
        mailbox = self._mailbox_for(asyncio.get_running_loop())
        out: asyncio.Queue = asyncio.Queue()

        def sink(index: int):
            return lambda output: mailbox.post(out.put_nowait, (index, output))

        if self.draining and request.local_prefill:      # new work; a handoff in flight is finished
            await context.abort(grpc.StatusCode.UNAVAILABLE, "this decode worker is draining")
        if self._faults_left():
            await context.abort(grpc.StatusCode.UNAVAILABLE, "fault testing: --fault-refuse-decodes")
        n = request.n or 1
        try:
            prompt, params = e.check(request)
            if n > MAX_CHOICES:
                raise ValueError(f"n must be between 1 and {MAX_CHOICES}, not {n}")
            taken = taken_tokens(request)
            constraint = await prepared(params, e.runner.vocab_size, e.grammars, taken)
            forks = []
            for i in range(1, n):           # each its own seed, and its own place in the grammar
                p = params.for_choice(i)
                forks.append(Sequence(f"{request.request_id}#{i}", [], len(prompt), p, e.eos,
                                      constraint=await prepared(p, e.runner.vocab_size, e.grammars),
                                      priority=request.priority))
        except ValueError as exc:
            await refuse(context, exc)
        seq = Sequence(request.request_id, prompt + taken, len(prompt), params, e.eos, constraint=constraint,
                       forks=forks, priority=request.priority)
        ids = [request.request_id] + [c.request_id for c in forks]
        try:
            e.admit(seq, None if request.local_prefill else request.epoch, [sink(i) for i in range(n)],
                    request.kv_bytes, request.transport)
        except (HandoffError, ValueError) as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        running = set(range(n))
        made = [len(taken)] + [0] * (n - 1)     # each choice's output tokens so far
        held = None                     # taken from `out` while joining, not sent yet
        try:
            while running:
                if held is None:
                    held = await out.get()
                (index, o), held = held, None
                while not o.finish_reason and not out.empty():
                    following = out.get_nowait()
                    if not _joins(index, o, following):
                        held = following
                        break
                    o = _joined(o, following[1])
                reason = o.finish_reason or ""
                made[index] += len(o.token_ids)
                if reason == "error":
                    await context.abort(grpc.StatusCode.INTERNAL, "decode step failed")
                if reason == NO_TOKEN_LEFT:
                    await refuse(context, no_token_error(params, (seq, *forks)[index].constraint, made[index]))
                if reason:
                    running.discard(index)
                yield worker_pb2.DecodeChunk(token_ids=o.token_ids, finish_reason=reason, index=index,
                                             logprobs=[logprob_to_proto(lp) for lp in o.logprobs or ()],
                                             prompt_logprobs=prompt_logprobs_to_proto(o.prompt_logprobs),
                                             cached_tokens=o.cached_tokens)
        finally:
            for index in running:               # client went away or the RPC was cancelled
                e.abort(ids[index])


def _joins(index: int, output: EngineOutput, following: tuple[int, EngineOutput]) -> bool:
    """Whether `following`, queued behind `output` (choice `index`'s), can go out in
    the same message: the same choice, a step's tokens (no prompt's figures), and no
    failure (the tokens before a failure go out before the error does)."""
    then_index, then = following
    return (then_index == index and then.finish_reason not in FAILURES and then.prompt_logprobs is None
            and not then.cached_tokens and (output.logprobs is None) == (then.logprobs is None))


def _joined(output: EngineOutput, then: EngineOutput) -> EngineOutput:
    """One choice's consecutive outputs as one. They queue up when the event loop falls
    behind the engine's steps (many streams, a slow reader): one message then carries
    them all, so the worker, the wire and the router each do less per token exactly
    when they are behind."""
    logprobs = None if output.logprobs is None else output.logprobs + then.logprobs
    return dataclasses.replace(output, token_ids=output.token_ids + then.token_ids,
                               finish_reason=then.finish_reason, logprobs=logprobs)


def build(settings: WorkerSettings, runner: ModelRunner, eos: frozenset[int], metrics: WorkerMetrics, ranks=None):
    worker = DecodeWorker(settings, runner, eos, metrics, ranks)
    worker.start()
    return WorkerParts("pdserve.v1.DecodeWorker",
                       DecodeService(worker), worker_pb2_grpc.add_DecodeWorkerServicer_to_server, worker.stop)
