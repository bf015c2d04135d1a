"""Structured output: a JSON schema compiled by xgrammar (the grammar engine vLLM and
SGLang use) into a matcher per sequence, which masks every token that cannot continue
valid output before the sampler chooses.

The router compiles each schema once to refuse a bad one with a 400; a worker compiles
it again (cached) and gives the sequence its own matcher, which follows the tokens the
sequence takes. JSON is generated compact (no free whitespace): a small model left free
to add whitespace can fill its whole budget with it.

The masks of a step are filled on a thread of their own while the forward pass runs
(engine.py), so their cost hides behind the step's.
"""
from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Callable

import torch

# Compiled grammars kept per process (schemas repeat: a client sends the same one).
CACHE_SIZE = 256
# A schema is text from a client: bound what compiling it may cost.
MAX_SCHEMA_CHARS = 64 * 1024

JSON_OBJECT = json.dumps({"type": "object"})        # response_format {"type": "json_object"}


class Grammars:
    """Compiles schemas for one tokenizer; thread-safe. The tokenizer is loaded on first
    use (`load_tokenizer`), so a worker that never sees a schema never pays for it."""

    def __init__(self, load_tokenizer: Callable[[], object], vocab_size: int, stop_token_ids: frozenset[int]) -> None:
        self._load = load_tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self._compiler = None
        self._cache: OrderedDict[str, object] = OrderedDict()
        self._lock = threading.Lock()

    def _compiler_for(self):
        if self._compiler is None:
            import xgrammar as xgr
            info = xgr.TokenizerInfo.from_huggingface(self._load(), vocab_size=self.vocab_size,
                                                      stop_token_ids=self.stop_token_ids or None)
            self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        return self._compiler

    def compile(self, schema: str):
        """The compiled grammar of `schema` (JSON text); ValueError if it is not one."""
        if len(schema) > MAX_SCHEMA_CHARS:
            raise ValueError(f"the JSON schema is longer than {MAX_SCHEMA_CHARS} characters")
        with self._lock:
            hit = self._cache.get(schema)
            if hit is not None:
                self._cache.move_to_end(schema)
                return hit
            try:
                parsed = json.loads(schema)
            except json.JSONDecodeError as exc:
                raise ValueError(f"the JSON schema is not valid JSON: {exc}") from None
            if not isinstance(parsed, (dict, bool)):
                raise ValueError("a JSON schema must be an object or a boolean")
            try:
                grammar = self._compiler_for().compile_json_schema(schema, any_whitespace=False)
            except Exception as exc:             # xgrammar raises RuntimeError and its own kinds
                raise ValueError(f"the JSON schema cannot be compiled: {str(exc).splitlines()[0][:300]}") from None
            self._cache[schema] = grammar
            if len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
            return grammar

    def constraint(self, schema: str) -> "Constraint":
        import xgrammar as xgr
        return Constraint(xgr.GrammarMatcher(self.compile(schema)), self.vocab_size)


class Constraint:
    """One sequence's place in its grammar."""

    def __init__(self, matcher, vocab_size: int) -> None:
        self._matcher = matcher
        self.vocab_size = vocab_size

    def accept(self, token_id: int) -> bool:
        return self._matcher.accept_token(token_id)

    @property
    def terminated(self) -> bool:
        return self._matcher.is_terminated()

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, row)


def fill_masks(constraints: list[Constraint | None]) -> Callable[[torch.Tensor], None] | None:
    """The masks of one step's sampling rows (None: a free row), as a function that
    applies them to the step's logits in place."""
    rows = [i for i, c in enumerate(constraints) if c is not None]
    if not rows:
        return None
    import xgrammar as xgr
    vocab = constraints[rows[0]].vocab_size
    bitmask = xgr.allocate_token_bitmask(len(constraints), vocab)
    for i in rows:
        constraints[i].fill(bitmask, i)

    def apply(logits: torch.Tensor) -> None:
        mask = bitmask.to(logits.device, non_blocking=True)
        xgr.apply_token_bitmask_inplace(logits, mask, vocab_size=min(vocab, logits.shape[-1]), indices=rows)
    return apply
