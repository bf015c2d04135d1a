"""Routing policies: which decode worker, prefill here or there, which prefill worker.

Pure functions over snapshots of the workers (no I/O, no clocks), so every choice is
unit-tested on its own. The order of decisions for one request:

1. Decode worker: among those with room for the prompt's blocks and within
   DECODE_AFFINITY_SLACK sequences of the least loaded, the one holding the longest
   cached prefix of the prompt (it prefills there with --mode aggregated, and short
   prompts otherwise), then the least loaded (sequences running or routed there), then
   the one picked least recently. Where step 2 sends the prompt to a prefill worker,
   the decode worker's cache serves it nothing: the pick is made again by load alone.
2. Remote or local prefill, from a cost model of time to first token:
     remote(p) = overhead + (queued tokens at p + prompt tokens p has not cached) x c
                 + transfer tail
     local     = (prompts already sent there to prefill + this one) x c, plus the
                 stall it imposes: every sequence in the decode worker's batch waits
                 that long for its next token
   Local wins only for prompts up to a size limit, when local + stall < best remote.
3. Prefill worker: the smallest remote(p); a worker already holding the prompt's
   prefix wins unless its queue costs more than the cache saves.

The cost model's per-token prefill time, fixed overhead and transfer tail are moving
averages of what the workers report, so the model recalibrates as load and hosts change.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Container, Sequence

from services.engine.core.prefix_cache import cached_prefix_blocks


# How many more sequences than the least loaded decode worker one may run and still win
# a prompt by holding more of its prefix (SGLang's cache-aware router has the same knob).
DECODE_AFFINITY_SLACK = 4


@dataclass(frozen=True)
class DecodeLoad:
    key: str
    free_blocks: int
    running: int                     # sequences running or waiting there (seen or routed)
    last_pick: float = 0.0           # when this router last chose it (ties go round robin)
    cached_blocks: int = 0           # leading blocks of the prompt it holds in its prefix cache


@dataclass(frozen=True)
class PrefillLoad:
    key: str
    queued_tokens: int               # prompt tokens ahead of a new request
    held: Container[int] = frozenset()   # prefix keys it holds


def pick_decode(workers: Sequence[DecodeLoad], need_blocks: int) -> DecodeLoad | None:
    """Among those with room and load near the least, the longest cached prefix, then
    the least loaded; if none has room, the one with the most free blocks (the request
    waits there for blocks: that is the queue)."""
    if not workers:
        return None
    roomy = [w for w in workers if w.free_blocks >= need_blocks]
    if roomy:
        least = min(w.running for w in roomy)
        near = [w for w in roomy if w.running <= least + DECODE_AFFINITY_SLACK]
        return min(near, key=lambda w: (-w.cached_blocks, w.running, w.last_pick, w.key))
    return max(workers, key=lambda w: (w.free_blocks, -w.running))


@dataclass
class CostModel:
    """Seconds-per-token and overhead estimates, updated from measurements (EWMA)."""
    prefill_s_per_token: float = 0.002
    remote_overhead_s: float = 0.02
    transfer_tail_s_per_token: float = 0.00002
    alpha: float = 0.2
    samples: int = field(default=0, init=False)

    def _mix(self, old: float, new: float) -> float:
        return new if self.samples == 0 else (1 - self.alpha) * old + self.alpha * new

    def observe(self, computed_tokens: int, prefill_seconds: float, transfer_seconds: float,
                overhead_seconds: float, prompt_tokens: int, seconds_per_token: float = 0.0) -> None:
        """One remote prefill's report: compute time, transfer tail, the worker's own cost
        a prompt token (0: not measured yet; then compute over computed tokens, from
        prompts long enough for it to mean something), and the time the remote path took
        from the plan beyond the prompt's own compute: the overhead, that is the
        reservation, the calls and the wait in the worker's queue. The queue then counts
        twice in remote_ttft, as the wait ahead of this prompt (its queued tokens) and as
        the recent wait (the overhead), which stands for what this prompt adds to the
        prompts that queue behind it: the counterpart of a local prefill's stall. Never
        the router's own queue: it comes first, whichever way the prompt goes."""
        if seconds_per_token > 0:
            self.prefill_s_per_token = self._mix(self.prefill_s_per_token, seconds_per_token)
        elif computed_tokens >= 16 and prefill_seconds > 0:
            compute = max(prefill_seconds - transfer_seconds, 0.0)
            self.prefill_s_per_token = self._mix(self.prefill_s_per_token, compute / computed_tokens)
        if prompt_tokens > 0:
            self.transfer_tail_s_per_token = self._mix(self.transfer_tail_s_per_token,
                                                       max(transfer_seconds, 0.0) / prompt_tokens)
        self.remote_overhead_s = self._mix(self.remote_overhead_s, max(overhead_seconds, 0.0))
        self.samples += 1

    def terms(self) -> dict[str, float]:
        """The model's terms by name, for /metrics."""
        return {"prefill_seconds_per_token": self.prefill_s_per_token,
                "remote_overhead_seconds": self.remote_overhead_s,
                "transfer_tail_seconds_per_token": self.transfer_tail_s_per_token}

    def remote_ttft(self, queued_tokens: int, uncached_tokens: int, prompt_tokens: int) -> float:
        return (self.remote_overhead_s + (queued_tokens + uncached_tokens) * self.prefill_s_per_token
                + prompt_tokens * self.transfer_tail_s_per_token)

    def local_ttft(self, prompt_tokens: int, queued_tokens: int = 0) -> float:
        return (queued_tokens + prompt_tokens) * self.prefill_s_per_token


@dataclass(frozen=True)
class PrefillPlan:
    prefill: PrefillLoad | None      # None: prefill on the decode worker
    cached_tokens: int               # prompt tokens the chosen prefill worker holds
    reason: str


def plan_prefill(prefills: Sequence[PrefillLoad], keys: Sequence[int], prompt_tokens: int, block_size: int,
                 decode_running: int, model: CostModel, local_max_tokens: int,
                 local_queued_tokens: int = 0) -> PrefillPlan:
    """Decide where the prompt is computed. `keys` are the prompt's chained block keys."""
    if not prefills:
        return PrefillPlan(None, 0, "no prefill worker")
    usable_blocks = (prompt_tokens - 1) // block_size        # the last token is always computed

    def cost(p: PrefillLoad) -> tuple[float, int]:
        cached = min(cached_prefix_blocks(keys, p.held), usable_blocks) * block_size
        return model.remote_ttft(p.queued_tokens, prompt_tokens - cached, prompt_tokens), cached

    scored = [(cost(p), p) for p in prefills]
    (remote, cached), best = min(scored, key=lambda s: (s[0][0], s[1].key))
    # A longer prompt is still a candidate while the prefill pool is backed up (its least
    # queue holds more work than this prompt), as Dynamo's conditional disaggregation
    # prefills locally once the prefill queue is full: then the decode worker's spare
    # time, in chunks between its steps, is the sooner place.
    backed_up = local_max_tokens > 0 and best.queued_tokens > prompt_tokens
    if prompt_tokens <= local_max_tokens or backed_up:
        local = model.local_ttft(prompt_tokens, local_queued_tokens)
        stall = decode_running * model.local_ttft(prompt_tokens)
        if local + stall < remote:
            return PrefillPlan(None, 0, f"local {local * 1000:.0f} ms + stall of {decode_running} running "
                                        f"{stall * 1000:.0f} ms < remote {remote * 1000:.0f} ms")
    return PrefillPlan(best, cached, f"remote {remote * 1000:.0f} ms, {cached} cached tokens")
