"""The `draft` proposer: a smaller model with the same tokenizer drafts each sequence's
next tokens, greedily, on the decode worker, over a paged KV pool of its own.

    propose_all(sequences):
      catch up   each sequence's tokens the draft has not seen (its whole prompt the
                 first time; later the tokens accepted since), one forward pass for all
                 of them, sampling the first draft at each sequence's last token
      draft      k - 1 more decode steps over those sequences, each feeding the draft
                 before it

What the draft cache holds of a sequence is tracked as the tokens fed to it: after a
verify step the drafts the target rejected are no longer a prefix of the sequence, and
the cache is valid up to where the two part (later positions are written over). Blocks
come from the draft pool's own BlockManager; a sequence the pool cannot hold now gets no
draft. Drafts are the draft model's argmax, a point mass, so verification keeps the
target's distribution whatever the draft is (core/speculation.py).
"""
from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass, field

import torch

from services.common.speculative_config import SpeculativeConfig
from services.engine.core.block_manager import BlockManager
from services.engine.core.block_pool import BlockPool, NoFreeBlocks
from services.engine.core.sequence import Sequence
from services.engine.model.kv_cache import KVPoolMemory
from services.engine.model.runner import ForwardBatch, ModelRunner, PrefillSegment

log = logging.getLogger(__name__)


@dataclass
class _Drafted:
    """What the draft cache holds of one sequence: the tokens whose KV it computed, in
    order, and the blocks they are in."""
    fed: list[int] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    valid: int = 0              # leading tokens of `fed` known to be the sequence's


class DraftProposer:
    def __init__(self, config: SpeculativeConfig, target: ModelRunner, num_tokens: int, block_size: int,
                 runner: ModelRunner | None = None) -> None:
        """A draft model (`config.model`, loaded like the target: its device, dtype and
        kernels) with a KV pool of `num_tokens`; `runner`: one already built (tests)."""
        self.runner = runner or draft_runner(config, target)
        # Draft models of a family may pad their vocabulary to another size: a draft past
        # the target's vocabulary ends the draft there.
        self.vocab_size = target.vocab_size
        num_blocks = max(1, num_tokens // block_size)
        self.blocks = BlockManager(BlockPool(num_blocks, block_size))
        self.memory = KVPoolMemory.allocate(self.runner.layout(num_blocks, block_size), device=str(target.device))
        self._seqs: weakref.WeakKeyDictionary[Sequence, _Drafted] = weakref.WeakKeyDictionary()
        log.info("draft model: %s", self.runner.describe())

    def propose(self, seq: Sequence, most: int) -> list[int]:
        return self.propose_all([(seq, most)]).get(seq, [])

    @torch.inference_mode()
    def propose_all(self, wanted: list[tuple[Sequence, int]]) -> dict[Sequence, list[int]]:
        rows = [(seq, most) for seq, most in wanted if self._make_room(seq, most)]
        unseen = {seq: seq.token_ids[len(self._seqs[seq].fed):] for seq, _ in rows}
        # A token past the draft's own vocabulary (a smaller one than the target's, as
        # Qwen2.5-0.5B's against 7B's) cannot be fed to it: that sequence gets no drafts.
        rows = [(seq, most) for seq, most in rows if max(unseen[seq], default=0) < self.runner.vocab_size]
        if not rows:
            return {}
        # a sequence with one unseen token is a decode row; one with more, a prompt segment
        order = [r for r in rows if len(unseen[r[0]]) == 1] + [r for r in rows if len(unseen[r[0]]) > 1]
        batch = ForwardBatch()
        for seq, _ in order:
            d, new = self._seqs[seq], unseen[seq]
            if len(new) == 1:
                batch.decode_tokens.append(new[0])
                batch.decode_positions.append(len(d.fed))
                batch.decode_tables.append(d.block_ids)
            else:
                batch.prefill_tokens += new
                batch.segments.append(PrefillSegment(len(d.fed), len(new), d.block_ids))
            d.fed, d.valid = list(seq.token_ids), len(seq.token_ids)
        row, batch.sample_rows = len(batch.decode_tokens), list(range(len(batch.decode_tokens)))
        for seg in batch.segments:
            row += seg.num_tokens
            batch.sample_rows.append(row - 1)
        try:
            return self._draft(order, batch)
        except BaseException:
            for seq, _ in order:            # what was fed may not have reached the draft cache
                self._seqs[seq].fed, self._seqs[seq].valid = [], 0
            raise

    def _draft(self, order: list[tuple[Sequence, int]], batch: ForwardBatch) -> dict[Sequence, list[int]]:
        """The catch-up pass `batch`, then the decode steps drafting the rest."""
        drafts = {seq: [t] for (seq, _), t in zip(order, self._greedy(batch))}
        longest = max(most for _, most in order)
        for _ in range(1, longest):
            going = [(seq, most) for seq, most in order if len(drafts[seq]) < most]
            if not going:
                break
            batch = ForwardBatch(decode_tokens=[drafts[seq][-1] for seq, _ in going],
                                 decode_positions=[len(self._seqs[seq].fed) for seq, _ in going],
                                 decode_tables=[self._seqs[seq].block_ids for seq, _ in going],
                                 sample_rows=list(range(len(going))))
            for seq, _ in going:
                self._seqs[seq].fed.append(drafts[seq][-1])
            for (seq, _), t in zip(going, self._greedy(batch)):
                drafts[seq].append(t)
        return {seq: _within(d, self.vocab_size) for seq, d in drafts.items() if d[0] < self.vocab_size}

    def _greedy(self, batch: ForwardBatch) -> list[int]:
        return self.runner.execute(self.memory, batch).argmax(-1).tolist()

    def _make_room(self, seq: Sequence, most: int) -> bool:
        """The draft cache's record of `seq`, cut back to where the sequence and what was
        fed part, with blocks for its tokens and `most` - 1 drafts; False when the pool
        cannot hold them (no draft this step)."""
        d = self._seqs.get(seq)
        if d is None:
            d = self._seqs[seq] = _Drafted()
        ids = seq.token_ids
        limit = min(len(d.fed), len(ids) - 1)           # the last token is always fed again
        keep = min(d.valid, limit)
        while keep < limit and d.fed[keep] == ids[keep]:
            keep += 1
        del d.fed[keep:]
        d.valid = keep
        need = self.blocks.blocks_for(len(ids) + most - 1) - len(d.block_ids)
        if need > 0:
            try:
                d.block_ids += self.blocks.allocate(need)
            except NoFreeBlocks:
                return False
        return True

    def finished(self, seq: Sequence) -> None:
        d = self._seqs.pop(seq, None)
        if d is not None and d.block_ids:
            self.blocks.release(d.block_ids)

    def close(self) -> None:
        self.memory.close()


def _within(draft: list[int], vocab_size: int) -> list[int]:
    for i, t in enumerate(draft):
        if t >= vocab_size:
            return draft[:i]
    return draft


def draft_runner(config: SpeculativeConfig | None, target: ModelRunner) -> ModelRunner | None:
    """The `draft` method's model, loaded like the target (its device, dtype and
    kernels); None for the other methods. Loaded before the target's KV pool is sized,
    so that on a GPU its weights and its pool come off the card's budget too."""
    if config is None or config.method != "draft":
        return None
    from services.engine.text.model_store import resolve_model
    return ModelRunner(resolve_model(config.model, None), target.dtype_name, str(target.device),
                       quantization=config.quantization, max_model_len=target.max_model_len, cuda_graphs=False)


def draft_proposer(config: SpeculativeConfig, target: ModelRunner, num_tokens: int,
                   block_size: int, runner: ModelRunner | None = None) -> DraftProposer | None:
    """The `draft` method's proposer for a decode worker (on `runner`, draft_runner's),
    or None for the others."""
    if config.method != "draft":
        return None
    return DraftProposer(config, target, num_tokens, block_size, runner)

