"""The engine core every worker drives: `add`, `step`, `abort`.

    step():  apply queued adds/aborts -> schedule -> pack -> one forward -> sample -> update

The decode worker, the prefill worker and aggregated mode all run this one core; a
worker adds only what its role needs around it (RPC, KV handoffs and leases, token
streaming). `add`, `add_prefilled`, `abort`, `release` and `call` (any other scheduler
change, such as a decode worker's reservation) may be called from any thread: they are
queued and applied at the start of the next step, so nothing a forward pass uses
changes under it, and the scheduler and its blocks have one thread. `step` runs on one thread, the engine thread (`EngineLoop`).

A step that raises is run again one sequence at a time: only a sequence that fails by
itself gets an "error" output (its blocks go back); the rest of the batch goes on.

With `async_scheduling` (vLLM's --async-scheduling), a step's tokens are not read back
when it is launched: the next step is planned and launched first, taking those tokens
on the device as its inputs, and only then are they read, so the device computes step
N+1 while the host turns step N's tokens into outputs and plans step N+2:

    step N+1:  schedule -> pack -> launch forward and sampling -> read step N's tokens
               -> outputs of step N -> step N+1 counts as launched (PENDING tokens)

Step N's tokens (and the log probabilities asked for) are copied to the host right
behind its sampling, and reading them waits for that copy alone (`DeviceStream.to_host`):
a plain read would wait for step N+1 too, queued on the same stream, and leave the device
idle while the host makes outputs and plans N+2. Nothing else on the launch path reads
the device or copies to it from pageable memory (which waits for the stream as well).

A sequence that finishes on step N's token has a row in step N+1 whose token is
dropped. Rows whose next step needs their token on the host first (structured output's
grammar, penalties over the history) make the engine read the step in flight before it
plans: those steps run as without async scheduling.

With speculative decoding (the scheduler's speculator), a verify chunk samples a token at
each of its positions, each as a row of its own would be sampled without drafts (its
index in the output, its history with the drafts before it), and the scheduler keeps
the drafts those samples agree with (core/speculation.py says why that is lossless).
Drafting needs the last token on the host, and planning after a verify step needs to
know how many drafts it kept. Under async scheduling, then, a step the speculator would
draft for first reads the step in flight (`Scheduler.drafts_need_tokens`), and a step
that verifies drafts is read as soon as it is launched; where drafting does not pay
(the adaptive speculator asks the proposer only then) steps overlap as without drafts.

With `yields` (a prefill worker's engine, whose every pass is prompts alone), a forward
pass pauses between two layers for a prompt more urgent than every one in it (a lower
priority: under a flood, another API key's, the router's fair share): that prompt's
step runs whole at the pause, its first token goes out at once, and the paused pass
goes on. Another key's prompt then waits a layer (~0.5 ms here) instead of the pass it
found running, which under a flood costs about as much as its own. Nothing the paused
pass uses changes: the urgent step takes only waiting sequences and free blocks, and
writes only its own.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Protocol, TypeVar

import torch

from services.engine.model.device import HostCopy, LayerPoster, to_device
from services.engine.model.hardware import threads_at_most
from services.engine.model.kv_cache import KVPoolMemory
from services.engine.model.runner import (DECODER_PROMPT_TOKENS, ONE_CALL_PROMPT_TOKENS, ForwardBatch, ModelRunner,
                                           PrefillSegment)
from services.engine.model.sampler import (History, Sampled, TokenHistory, as_token_logprobs, choose, logprob_tensors,
                                           read_sampled, to_read)
from services.engine.core.sampling import TokenLogprob
from services.engine.core.scheduler import Scheduler
from services.engine.core.sequence import PENDING, Chunk, Sequence, StepPlan
from services.engine.structured import fill_masks

log = logging.getLogger(__name__)
T = TypeVar("T")

# Called once each layer's KV is written (on a device: once its write has finished, see
# device.py), with the step's plan: where KV export hooks in. On a GPU it runs on a thread
# of its own while later layers compute; every call of a step is done before the step
# returns.
LayerHook = Callable[[int, StepPlan], None]


@dataclass(frozen=True)
class EngineOutput:
    request_id: str
    token_ids: list[int]                # new tokens (empty for a finish without one)
    finish_reason: str | None           # None while the sequence goes on; "error" if a step failed it
    logprobs: list[TokenLogprob] | None = None     # one per token, when its sampling asked
    # With a prompt computed here, on its first token, when asked: entry p is prompt token
    # p's (None for the first).
    prompt_logprobs: list[TokenLogprob | None] | None = None
    # With a prompt computed here, on its first token: its tokens the prefix cache held.
    cached_tokens: int = 0


@dataclass
class Launched:
    """A step on the device: its sampling chunks `rows` and their tokens `tokens`
    ([sampled rows] int64, `Chunk.num_sampled` a chunk, on the device, maybe not computed
    yet: the next step's pending inputs), and what the host reads of it on its way there
    (`copy`: `to_read`'s `num_sampled` tensors, then the log probabilities of the prompt
    positions `targets`)."""
    plan: StepPlan
    rows: list[Chunk]
    tokens: torch.Tensor
    copy: HostCopy
    num_sampled: int
    targets: list[tuple[Sequence, int]]
    started: float
    number: int = 0                     # the scheduler's launch number

    def read(self) -> Sampled:
        """The tokens on the host, waiting for this step's sampling alone; the prompt
        log probabilities go into their sequences."""
        host = self.copy.wait()
        if self.targets:
            record_prompt_logprobs(self.targets, host[self.num_sampled:])
        return read_sampled([c.seq.params for c, _ in sample_rows(self.rows)], host[:self.num_sampled])


def overlaps(seq: Sequence) -> bool:
    """Whether `seq`'s next step may be planned before its last token is read: not when
    the host needs that token to prepare the step (a grammar to follow, penalties over
    the history, bad words)."""
    return seq.constraint is None and not seq.params.reads_history


def _history(seq: Sequence, draft: tuple[int, ...]) -> History:
    """A sampling row's tokens; a penalized sequence keeps its copy on the device
    (`seq.kept_tokens`) from step to step."""
    if seq.params.penalized and seq.kept_tokens is None:
        seq.kept_tokens = TokenHistory()
    return History(seq.token_ids, seq.prompt_len, draft, seq.kept_tokens)


class StepHooks(Protocol):
    """Told before and after each step's forward pass (a tensor-parallel prefill
    worker's other ranks learn what to write, and say what failed)."""

    def before_step(self, plan: StepPlan) -> None: ...

    def after_step(self, plan: StepPlan) -> None: ...


# A forward pass of fewer tokens than this runs on a worker's own threads alone, when it
# also has threads on cores lent to it at a lower priority (`LLMEngine.own_threads`): its
# matmuls are too small to gain from a thread that waits its turn on a busy core, and the
# whole pass waits for that thread. Under bench.fairness's flood (Zen 4, a prefill worker
# with a thread on the busy decode core) its 10-token passes took 36 ms p50 against ~14
# on one idle core; another key's first token came p50 77 -> 57 ms (median of 3 runs each).
SMALL_STEP_TOKENS = 128
# Layers a pass that yields (LLMEngine's `yields`) is launched ahead of the device at
# most. A GPU computes one layer of a long prompt in about the time the host takes to
# launch dozens; launched whole, the pass would be queued before an urgent prompt comes,
# and that prompt would wait for all of it. Two keep a layer queued while the host waits.
PAUSE_AHEAD_LAYERS = 2
# Prompt tokens a pass that yields may run in the one-call decoder (runner.py's
# DECODER_PROMPT_TOKENS): an urgent prompt waits for that call whole, not for a layer,
# so the pass is kept short (16 tokens: ~23 ms on one Zen 4 core, bfloat16 SmolLM2-135M).
PAUSABLE_ONE_CALL_TOKENS = 16


def one_call_tokens(pausing: bool, hooked: bool) -> int:
    """The most prompt tokens a step may run in the one-call decoder: few in a pass that
    yields; DECODER_PROMPT_TOKENS where each layer is handed on as it is written (a
    prefill worker's KV push); else ONE_CALL_PROMPT_TOKENS (runner.py says why)."""
    return PAUSABLE_ONE_CALL_TOKENS if pausing else DECODER_PROMPT_TOKENS if hooked else ONE_CALL_PROMPT_TOKENS


@dataclass(frozen=True)
class StepStats:
    prefill_tokens: int                 # prompt tokens computed (chunks of more than one token)
    decode_tokens: int                  # decode rows: single-token ones and verify chunks' tokens
    sequences: int
    seconds: float
    generated: int = 0                  # tokens the step's sequences took


class LLMEngine:
    def __init__(self, runner: ModelRunner, memory: KVPoolMemory, scheduler: Scheduler,
                 layer_hook: LayerHook | None = None,
                 on_joined: Callable[[list[str]], None] | None = None, async_scheduling: bool = False,
                 step_hooks: StepHooks | None = None, own_threads: int = 0, yields: bool = False) -> None:
        if yields and not scheduler.config.prefill_only:
            raise ValueError("only a prefill-only engine's passes yield to urgent prompts: a pass that decodes "
                             "holds every running sequence's next token")
        if async_scheduling and (layer_hook is not None or scheduler.config.prefill_only):
            raise ValueError("async scheduling is for engines that decode: a prefill worker's step ends its "
                             "sequences and ships their KV")
        self.runner = runner
        self.async_scheduling = async_scheduling
        # Of torch's threads, those on the worker's own cores (0: all): the others run on
        # lent cores, and a pass of fewer than SMALL_STEP_TOKENS tokens leaves them out.
        self.own_threads = own_threads
        self._flight: Launched | None = None       # the step on the device whose tokens are unread
        self.overlapped_steps = 0                   # steps launched while the one before was in flight
        self._last_end = 0.0                        # when the last step's outputs were made
        self.memory = memory
        self.scheduler = scheduler
        self.step_hooks = step_hooks
        self._poster = (None if layer_hook is None
                        else LayerPoster(layer_hook, runner.stream.asynchronous, runner.device))
        # Told, before the forward pass, which prefilled sequences this step decodes first:
        # their first token (sampled elsewhere) can go out now, one step before the second.
        self.on_joined = on_joined
        # (request id, action): applied by the engine thread at the start of a step
        self._inbox: queue.SimpleQueue[tuple[str, Callable[[], list[EngineOutput]]]] = queue.SimpleQueue()
        # Held by the engine thread while it plans and records a step (and by whatever
        # drives it between steps, EngineLoop); free while the forward pass runs, when
        # `now` makes another thread's scheduler change without waiting for the step.
        self.scheduling = threading.RLock()
        self.last_step: StepStats | None = None
        self.prompt_tokens_computed = 0
        self.generated_tokens = 0
        self.busy_seconds = 0.0
        self._masks = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar")
        # `yields`: the pass running takes, between two layers, a step of the prompts that
        # arrived more urgent than all of its own (`_urgent`; `_below` is its priority
        # while it runs). Their outputs go to `interjected` at once (EngineLoop delivers).
        self.yields = yields
        self._below: int | None = None
        self._urgent: deque[tuple[str, Callable[[], list[EngineOutput]]]] = deque()
        self.interjected: Callable[[list[EngineOutput], StepStats | None], None] | None = None
        self.interjections = 0                      # steps run inside another's pass

    # ---- any thread ----
    def add(self, seq: Sequence) -> None:
        """A sequence whose prompt is computed here (with a first token given: the prompt
        and that token)."""
        self._admit(seq, self.scheduler.add)

    def add_prefilled(self, seq: Sequence) -> None:
        """A sequence whose prompt KV is already in `seq.block_ids` and whose first token
        (last in `seq.token_ids`) was sampled elsewhere."""
        self._admit(seq, self.scheduler.add_prefilled)

    def _admit(self, seq: Sequence, admit: Callable[[Sequence], str | None]) -> None:
        """`admit(seq)` at the next step; a first token that already ends `seq` is its
        only output."""
        def run() -> list[EngineOutput]:
            reason = admit(seq)
            return [EngineOutput(seq.request_id, [], reason)] if reason else []
        below = self._below
        if below is not None and seq.priority < below and admit == self.scheduler.add:
            self._urgent.append((seq.request_id, run))      # taken at the running pass's next layer
        else:
            self._inbox.put((seq.request_id, run))

    def abort(self, request_id: str) -> None:
        def end() -> list[EngineOutput]:
            seq = self.scheduler.abort(request_id)
            return [EngineOutput(request_id, [], "abort")] if seq is not None else []
        self._inbox.put((request_id, end))

    def release(self, request_id: str) -> None:
        """Blocks of a finished sequence that `retain_finished` kept (prefill worker)."""
        self._inbox.put((request_id, lambda: self.scheduler.release(request_id) or []))

    def call(self, action: Callable[[], T]) -> Future[T]:
        """`action()` on the engine thread, at the start of the next step (a scheduler
        change another thread needs the answer of: a reservation's blocks); its result,
        or what it raised, in the future."""
        future: Future[T] = Future()

        def run() -> list[EngineOutput]:
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(action())
                except Exception as exc:             # the caller's to handle
                    future.set_exception(exc)
            return []
        self._inbox.put(("", run))
        return future

    def has_work(self) -> bool:
        return (not self._inbox.empty() or bool(self._urgent) or self.scheduler.has_work()
                or bool(self.scheduler.orphans) or self.in_flight)

    @property
    def in_flight(self) -> bool:
        """A step is on the device whose tokens are not read yet (async scheduling)."""
        return self._flight is not None

    # ---- the engine thread ----
    def now(self, action: Callable[[], T]) -> T:
        """`action()` on the calling thread, at once while the engine is idle or in a
        forward pass (otherwise when the step's planning or recording ends): for a
        scheduler change that takes only free blocks (a reservation), which the step in
        flight never reads, and must not wait for that step to end."""
        with self.scheduling:
            return action()

    def step(self) -> list[EngineOutput]:
        with self.scheduling:
            return self._step()

    def _step(self) -> list[EngineOutput]:
        outputs = self._apply_inbox()
        outputs += self._orphans()
        if self._flight is not None and (not all(overlaps(s) for s in self.scheduler.running)
                                         or self.scheduler.drafts_need_tokens()):
            outputs += self._land()
        plan = self.scheduler.schedule()
        if self.scheduler.copies:               # forked choices' last prompt blocks, queued ahead of the step
            self.runner.copy_blocks(self.memory, self.scheduler.copies)
            if not plan:                        # no step to land them (the choices ended): wait for them here
                self.runner.stream.record().wait()
            self.scheduler.copies_made(done=not plan)
        if plan.joined and self.on_joined is not None:
            self.on_joined([seq.request_id for seq in plan.joined])
        overlap = self.async_scheduling and not plan.verify and all(overlaps(c.seq) for c in plan.chunks)
        if not (plan and overlap):
            outputs += self._land_before(plan)
        if not plan:
            return outputs
        t0 = time.perf_counter()
        try:
            launched = self._launch(plan, t0)
        except Exception:
            log.exception("engine step over %d sequences failed; running them one by one", len(plan.chunks))
            outputs += self._land_before(plan)
            plan, sampled = self._isolate(plan, outputs)
            rows = plan.sampling()
            self.scheduler.launched(plan, rows)
            return outputs + self._record(plan, rows, sampled, t0)
        launched.number = self.scheduler.launch()
        if self._flight is not None:            # only with overlap: otherwise it has landed
            self.overlapped_steps += 1
            outputs += self._land()
        self.scheduler.launched(plan, launched.rows)
        self._flight = launched
        return outputs if overlap else outputs + self._land()

    def _land_before(self, plan: StepPlan) -> list[EngineOutput]:
        """Land the step in flight, if any, before `plan` runs: the sequences that end on
        its tokens leave `plan`."""
        if self._flight is None:
            return []
        outputs = self._land()
        for seq in [c.seq for c in plan.chunks if c.seq.finish_reason]:
            plan._drop(seq)
        return outputs

    def _land(self) -> list[EngineOutput]:
        """Read the tokens of the step in flight and make its outputs."""
        flight, self._flight = self._flight, None
        try:
            sampled = flight.read()
        finally:
            self.scheduler.landed(flight.number)
        return self._record(flight.plan, flight.rows, sampled, flight.started)

    def _record(self, plan: StepPlan, rows: list[Chunk], sampled: Sampled, started: float) -> list[EngineOutput]:
        """The tokens of a launched step (`Scheduler.launched`) into its sampling chunks'
        sequences, and the outputs they make."""
        outputs: list[EngineOutput] = []
        logprobs = {}
        tokens, found = per_chunk(rows, sampled.token_ids), per_chunk(rows, sampled.logprobs)
        for c, ids, lps in zip(rows, tokens, found):
            if c.seq.finish_reason:
                continue                        # ended while the step ran: its token is dropped
            if lps[0] is not None:
                logprobs[c.seq] = lps
        updates = self.scheduler.resolve(rows, tokens)
        for u in updates:
            first = u.seq.num_generated == len(u.token_ids)
            lps = logprobs.get(u.seq)
            outputs.append(EngineOutput(u.seq.request_id, u.token_ids, u.finish_reason,
                                        lps[:len(u.token_ids)] if lps else None,
                                        u.seq.prompt_logprobs if first else None,
                                        u.seq.num_cached if first else 0))
        outputs += self._orphans()
        end = time.perf_counter()
        seconds = end - max(started, self._last_end)      # overlapping steps: each second counted once
        self._last_end = end
        prefill = sum(c.num_tokens for c in plan.prefill)
        generated = sum(len(u.token_ids) for u in updates)      # not the dropped tokens of ended sequences
        decode = len(plan.decode) + sum(c.num_tokens for c in plan.verify)
        self.last_step = StepStats(prefill, decode, len(plan.chunks), seconds, generated)
        self.prompt_tokens_computed += sum(min(c.num_tokens, max(0, c.seq.prompt_len - c.start))
                                           for c in plan.chunks)
        self.generated_tokens += generated
        if self.scheduler.speculator is not None and not plan.prefill:
            self.scheduler.speculator.observe(decode, seconds)
        self.busy_seconds += seconds
        return outputs

    def _orphans(self) -> list[EngineOutput]:
        orphans, self.scheduler.orphans = self.scheduler.orphans, []
        return [EngineOutput(seq.request_id, [], "abort") for seq in orphans]

    def _apply_inbox(self) -> list[EngineOutput]:
        # Urgent admissions first: whatever the inbox holds for them (an abort) came later.
        outputs = self._apply_urgent()
        while True:
            try:
                request_id, action = self._inbox.get_nowait()
            except queue.Empty:
                return outputs
            outputs += self._apply(request_id, action)

    def _apply_urgent(self) -> list[EngineOutput]:
        outputs: list[EngineOutput] = []
        while self._urgent:
            outputs += self._apply(*self._urgent.popleft())
        return outputs

    @staticmethod
    def _apply(request_id: str, action: Callable[[], list[EngineOutput]]) -> list[EngineOutput]:
        try:
            return action()
        except Exception:                           # a bad request fails alone
            log.exception("request %s could not be applied to the engine", request_id)
            return [EngineOutput(request_id, [], "error")]

    def _launch(self, plan: StepPlan, started: float, pausable: bool = True) -> Launched:
        """Run `plan`'s forward pass and choose its tokens, leaving them on the device and
        starting their copy to the host. With `yields`, a `pausable` pass takes a step
        of more urgent prompts between two layers (`_interject`)."""
        flight = self._flight
        if flight is not None and flight.plan.verify:
            # its sequences' next positions and tokens depend on the drafts it keeps
            raise RuntimeError("a step was planned while a verify step was in flight")
        pending = {c.seq: i for i, c in enumerate(flight.rows)} if flight is not None else {}
        batch, targets = pack(plan, pending)
        if batch.pending_rows:
            batch.pending_tokens = flight.tokens
        rows = plan.sampling()
        each = sample_rows(rows)
        constraints = [(c.seq.constraint, c.draft[:j]) for c, j in each]
        # Structured output's masks are filled while the forward pass runs.
        masks = self._masks.submit(fill_masks, constraints) if any(c for c, _ in constraints) else None
        pausing = pausable and self.yields
        hook = self._layer_hook(plan, pausing)
        hooks = self.step_hooks
        if hooks is not None:
            hooks.before_step(plan)
        self.scheduling.release()               # the forward pass: `now` may run meanwhile
        try:
            if pausing:
                self._below = min(c.seq.priority for c in plan.chunks)
            with threads_at_most(self.own_threads if self.own_threads and plan.num_tokens < SMALL_STEP_TOKENS
                                 else 0):
                logits = self.runner.execute(self.memory, batch, hook, one_call_tokens(pausing, hook is not None))
        finally:
            if pausing:
                self._below = None
            self.scheduling.acquire()
            if self._poster is not None:
                self._poster.flush()
            if hooks is not None:
                hooks.after_step(plan)
            mask = masks.result() if masks is not None else None
        prompt = prompt_logprob_tensors(logits[len(batch.sample_rows):], targets) if targets else []
        logits = logits[:len(batch.sample_rows)]
        histories = [_history(c.seq, tuple(c.draft[:j])) for c, j in each] \
            if any(c.seq.params.reads_history for c in rows) else None
        params = [c.seq.params for c, _ in each]
        chosen = choose(logits, params, [c.seq.num_generated + j for c, j in each],
                        rows[0].seq.eos_token_ids if rows else frozenset(), histories, mask)
        sampled = to_read(chosen, params)
        copy = self.runner.stream.to_host(sampled + prompt)
        return Launched(plan, rows, chosen.tokens, copy, len(sampled), targets, started)

    def _layer_hook(self, plan: StepPlan, pausable: bool) -> Callable[[int, object], None] | None:
        """What the runner calls as each layer's KV write is launched: the KV export's
        post, and for a pass that yields, a look for urgent prompts. On a device the host
        launches ahead of the device; a pass that yields runs at most PAUSE_AHEAD_LAYERS
        layers ahead (waiting on the fence of the layer that many back), so an urgent
        prompt's step is queued behind a few of its layers, not behind the whole pass."""
        poster = self._poster
        if not pausable:
            return None if poster is None else (lambda layer, fence: poster(layer, plan, fence))
        ahead: deque = deque()

        def hook(layer: int, fence) -> None:
            if poster is not None:
                poster(layer, plan, fence)
            ahead.append(fence)
            if len(ahead) > PAUSE_AHEAD_LAYERS:
                ahead.popleft().wait()
            if self._urgent:
                self._interject()
        return hook

    def _interject(self) -> None:
        """Inside a paused pass, between two layers (the engine thread): a step of the
        prompts that arrived more urgent than the pass, run whole, its outputs handed to
        `interjected` at once, with the step's stats. Prompts that arrive meanwhile wait
        for the next layer."""
        started = time.perf_counter()
        stats = None
        with self.scheduling:
            outputs = self._apply_urgent()
            plan = self.scheduler.schedule_ahead(self._below)
            if plan:
                try:
                    launched = self._launch(plan, started, pausable=False)
                    launched.number = self.scheduler.launch()
                    self.scheduler.launched(plan, launched.rows)
                    self._flight = launched
                    outputs += self._land()
                    stats = self.last_step
                    self.interjections += 1
                except Exception:                   # its prompts fail, never the paused pass
                    log.exception("a step of %d urgent prompts failed inside another's pass", len(plan.chunks))
                    for c in plan.chunks:
                        if self.scheduler.abort(c.seq.request_id) is not None:
                            outputs.append(EngineOutput(c.seq.request_id, [], "error"))
        if (outputs or stats) and self.interjected is not None:
            self.interjected(outputs, stats)

    def _isolate(self, plan: StepPlan, outputs: list[EngineOutput]) -> tuple[StepPlan, Sampled]:
        """After a failed step: run each of its chunks alone, so a request that breaks the
        forward pass or the sampler fails by itself ("error") and the rest go on. Writing
        a chunk's KV again is harmless: the same tokens give the same bytes. Returns the
        plan of the chunks that ran and their tokens, in `plan.sampling()` order. The runs
        count as one launch, landed once all are read: the block copies queued before
        them, and blocks given back meanwhile, are held until then."""
        number = self.scheduler.launch()
        try:
            return self._run_alone(plan, outputs)
        finally:
            self.scheduler.landed(number)

    def _run_alone(self, plan: StepPlan, outputs: list[EngineOutput]) -> tuple[StepPlan, Sampled]:
        kept, tokens = StepPlan(), Sampled([], [])
        for c in plan.chunks:
            alone = StepPlan()
            alone._add(c)
            try:
                one = self._launch(alone, 0.0, pausable=False).read()
                tokens.token_ids += one.token_ids
                tokens.logprobs += one.logprobs
            except Exception:
                log.exception("request %s fails the step by itself; it ends, the others go on", c.seq.request_id)
                if self.scheduler.abort(c.seq.request_id) is not None:
                    outputs.append(EngineOutput(c.seq.request_id, [], "error"))
                continue
            kept._add(c)
        return kept, tokens


def pack(plan: StepPlan, pending: dict[Sequence, int] | None = None
         ) -> tuple[ForwardBatch, list[tuple[Sequence, int]]]:
    """The forward pass for `plan`: single-token rows first, then each verify chunk's
    tokens as decode rows of their own (each attends over the blocks up to its position,
    whose K/V every row of the step writes before any attends: the drafts before it
    included), then prompt chunks. Verifying drafts is then a decode step, with its
    kernels, one-call decoder and CUDA graphs. Also which (sequence, prompt position)
    each of its `logprob_rows` predicts the token of. `pending`: for a sequence whose
    input token is still PENDING, its row among the tokens of the step in flight, which
    the runner takes on the device."""
    b = ForwardBatch()
    targets: list[tuple[Sequence, int]] = []

    def prompt_rows(c, row: int) -> None:
        if c.seq.params.prompt_logprobs is None:
            return
        for j in range(c.num_tokens):
            if c.start + j + 1 < c.seq.prompt_len:          # position p's logits predict token p + 1
                b.logprob_rows.append(row + j)
                targets.append((c.seq, c.start + j + 1))
    for row, c in enumerate(plan.decode):
        token = c.seq.token_ids[c.start]
        if token == PENDING:
            b.pending_rows.append(row)
            b.pending_sources.append(pending[c.seq])
            token = 0
        b.decode_tokens.append(token)
        b.decode_positions.append(c.start)
        b.decode_tables.append(c.seq.block_ids)
    for c in plan.verify:
        b.decode_tokens.extend(c.token_ids)
        b.decode_positions.extend(range(c.start, c.start + c.num_tokens))
        b.decode_tables.extend([c.seq.block_ids] * c.num_tokens)
    row = 0
    for c in plan.decode:
        if c.samples:
            b.sample_rows.append(row)
        prompt_rows(c, row)
        row += 1
    for c in plan.verify:
        b.sample_rows.extend(range(row, row + c.num_tokens))
        row += c.num_tokens
    for c in plan.prefill:
        b.prefill_tokens.extend(c.seq.token_ids[c.start:c.start + c.num_tokens])
        b.segments.append(PrefillSegment(c.start, c.num_tokens, c.seq.block_ids))
        prompt_rows(c, row)
        row += c.num_tokens
        if c.samples:
            b.sample_rows.append(row - 1)
    return b, targets


def sample_rows(rows: list[Chunk]) -> list[tuple[Chunk, int]]:
    """Each sampled row of a step's sampling chunks: its chunk and its place among the
    chunk's samples (a verify chunk's draft position; 0 otherwise)."""
    return [(c, j) for c in rows for j in range(c.num_sampled)]


def per_chunk(rows: list[Chunk], flat: list) -> list[list]:
    """`flat`, one entry per sampled row, as one list per chunk."""
    out, at = [], 0
    for c in rows:
        out.append(flat[at:at + c.num_sampled])
        at += c.num_sampled
    return out


def prompt_logprob_tensors(logits: torch.Tensor, targets: list[tuple[Sequence, int]]) -> list[torch.Tensor]:
    """Each target prompt token's log probability (and its position's likeliest), from
    the raw logits of the position before it, as vLLM reports prompt logprobs: left on
    the device for `record_prompt_logprobs`."""
    ids = to_device([seq.token_ids[p] for seq, p in targets], torch.long, logits.device)
    return list(logprob_tensors(logits, ids, max(seq.params.prompt_logprobs for seq, _ in targets)))


def record_prompt_logprobs(targets: list[tuple[Sequence, int]], found: list[torch.Tensor]) -> None:
    """`prompt_logprob_tensors`' result, on the host, into the targets' sequences. Written
    by position, so a chunk computed again (preemption, a failed step) writes the same."""
    found = as_token_logprobs([seq.token_ids[p] for seq, p in targets], found,
                              [seq.params.prompt_logprobs for seq, _ in targets])
    for (seq, p), lp in zip(targets, found):
        if seq.prompt_logprobs is None:
            seq.prompt_logprobs = [None] * seq.prompt_len
        seq.prompt_logprobs[p] = lp
