"""Structured output: a JSON schema, regular expression, EBNF grammar or structural tag
compiled by xgrammar (the grammar engine vLLM and SGLang use) into a matcher per
sequence, which masks every token that cannot continue valid output before the sampler
chooses. What follows says "schema"; the other kinds go the same way, checked by the
worker's compile alone.

The router reads each schema first and refuses a bad one with a 400 (no schema, or one
no value can meet: text/json_schema.py `parse`); xgrammar imports torch, which the router
does not load, so compiling is the worker's: it compiles each schema once (cached),
refuses one xgrammar cannot compile (SchemaError: INVALID_ARGUMENT, with the router's
error code for it, services/worker/main.py `refuse`), and gives each sequence its own matcher,
which follows the tokens the sequence takes. The router checks
what comes out against the schema too (router/schema_guard.py), since xgrammar does not
enforce every keyword. JSON's whitespace is fixed, not free: `", "` and `": "` between
items, as `json.dumps` writes them, and no other (xgrammar's default separators): a small
model left free to add whitespace can fill its whole budget with it.

The masks of a step are filled on a thread of their own while the forward pass runs
(engine.py), so their cost hides behind the step's; a grammar whose following takes past
TOKEN_SECONDS for a token (an ambiguous one costs more with every token) ends its
sequence with its error rather than stall every other one. Constraints compile on
threads of their own (`Grammars.executor`), once however many requests bring one.
"""
from __future__ import annotations

import json
import logging
import re
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

import torch

from services.engine.text import json_schema

log = logging.getLogger(__name__)

# Compiled grammars kept per process (schemas repeat: a client sends the same one), at
# most this many and this much memory (one schema of many patterns compiled to 228 MB;
# xgrammar's own cache, unbounded, is off).
CACHE_SIZE = 256
CACHE_BYTES = 1 << 30
# Threads that compile constraints, apart from the worker's default executor (which
# writes KV): a schema that takes a minute to compile holds one of them, not an export.
COMPILE_THREADS = 2
# The longest following a grammar may take for one token (its mask, or taking a token):
# an ambiguous grammar costs more with every token (1.1 s a token after 125 of
# `s ::= s s | "a" | ""`), and every sequence of the step waits for its mask. Past it,
# the sequence ends with the grammar's error (`Constraint.failure`).
TOKEN_SECONDS = 0.25
# The longest constraint of any kind (text/json_schema.py's bound on schemas): its size
# bounds the time xgrammar takes to compile it, about a second for this many characters
# of choices.
MAX_CHARS = json_schema.MAX_SCHEMA_CHARS
SLOW_COMPILE_SECONDS = 1.0
# xgrammar's messages start "[12:00:00] /project/cpp/file.cc:123: ": the client needs the rest.
_LOCATION = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*")

class SchemaError(ValueError):
    """A constraint (a JSON schema, regex, grammar or structural tag) that cannot be used;
    `code` is the API's error code for it."""

    def __init__(self, message: str, code: str = "invalid_json_schema") -> None:
        super().__init__(message)
        self.code = code


# What each kind is called in errors, and the API's error code when it cannot be used.
_KINDS = {"json_schema": ("JSON schema", "invalid_json_schema"), "regex": ("regex", "invalid_regex"),
          "grammar": ("grammar", "invalid_grammar"), "structural_tag": ("structural tag", "invalid_structural_tag")}


class Grammars:
    """Compiles constraints for one tokenizer; thread-safe. The tokenizer is loaded on
    first use (`load_tokenizer`), so a worker that never sees one never pays for it."""

    def __init__(self, load_tokenizer: Callable[[], object], vocab_size: int, stop_token_ids: frozenset[int]) -> None:
        self._load = load_tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self._compiler = None
        self._cache: OrderedDict[tuple[str, str], object] = OrderedDict()
        self._cached_bytes = 0
        self._compiling: dict[tuple[str, str], Future] = {}     # by key: one compile of a constraint at a time
        self._lock = threading.Lock()
        self.executor = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="grammar")

    def _compiler_for(self):
        if self._compiler is None:
            import xgrammar as xgr
            info = xgr.TokenizerInfo.from_huggingface(self._load(), vocab_size=self.vocab_size,
                                                      stop_token_ids=self.stop_token_ids or None)
            self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        return self._compiler

    def compile(self, text: str, kind: str = "json_schema"):
        """The compiled grammar of `text`, a constraint of `kind` (sampling.STRUCTURE_KINDS);
        SchemaError if it is not one. Compiling is outside the lock (xgrammar lets go of
        the GIL meanwhile): a constraint that takes long to compile (a long bounded
        repetition can take seconds) delays its own request, not the others'."""
        name, code = _KINDS[kind]
        if len(text) > MAX_CHARS:
            raise SchemaError(f"the {name} is longer than {MAX_CHARS} characters", code)
        key = (kind, text)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
            pending = self._compiling.get(key)
            if pending is None:
                mine = self._compiling[key] = Future()
        if pending is not None:             # another request's compile of it: its result
            return pending.result()
        try:
            grammar = self._compile(text, kind, name, code)
        except BaseException as exc:
            mine.set_exception(exc)
            raise
        else:
            mine.set_result(grammar)
        finally:
            with self._lock:
                del self._compiling[key]
        with self._lock:
            self._cache[key] = grammar
            self._cached_bytes += grammar.memory_size_bytes
            while len(self._cache) > 1 and (len(self._cache) > CACHE_SIZE or self._cached_bytes > CACHE_BYTES):
                self._cached_bytes -= self._cache.popitem(last=False)[1].memory_size_bytes
        return grammar

    def _compile(self, text: str, kind: str, name: str, code: str):
        """`text` compiled by xgrammar (a JSON schema checked first, then as xgrammar is
        to read it: json_schema.for_the_grammar); SchemaError if it cannot be."""
        read = text
        if kind == "json_schema":
            try:
                read = json.dumps(json_schema.for_the_grammar(json_schema.parse(text)))
            except ValueError as exc:
                raise SchemaError(str(exc)) from None
        with self._lock:
            compiler = self._compiler_for()
        started = time.perf_counter()
        try:
            grammar = compiler.compile_json_schema(read, any_whitespace=False) if kind == "json_schema" \
                else compiler.compile_regex(text) if kind == "regex" \
                else compiler.compile_grammar(text) if kind == "grammar" \
                else compiler.compile_structural_tag(text)
        except Exception as exc:             # xgrammar raises RuntimeError and its own kinds
            reason = _LOCATION.sub("", (str(exc).splitlines() or [type(exc).__name__])[0])
            raise SchemaError(f"the {name} cannot be compiled: {reason[:300]}", code) from None
        took = time.perf_counter() - started
        if took > SLOW_COMPILE_SECONDS:
            log.warning("compiling a %s of %d characters took %.1f s", name, len(text), took)
        return grammar

    def constraint(self, text: str, kind: str = "json_schema", after: tuple[int, ...] = (),
                   opens: tuple[int, ...] = ()) -> "Constraint":
        import xgrammar as xgr
        # the matcher can roll back any number of tokens
        return Constraint(xgr.GrammarMatcher(self.compile(text, kind)), self.vocab_size, after, opens, kind)


class Constraint:
    """One sequence's place in its grammar. A grammar that allows no token at all (an
    unsatisfiable schema) ends its sequence instead of letting it run on unconstrained.

    With `after` (token ids: a reasoning model's end of thinking, as the router's
    --reasoning-parser sends it), the output is free until it has made those tokens in a
    row, and the grammar holds what follows: the model thinks, then answers in the shape
    asked for, as vLLM's structured output does beside a reasoning parser. With `opens`
    as well (the start of thinking's first token, where the prompt left it to the model
    whether to think), that wait begins only if the output's first token is that one
    and the grammar refuses it; otherwise the grammar holds the output from its first
    token. The first token's mask allows it besides the grammar's."""

    def __init__(self, matcher, vocab_size: int, after: tuple[int, ...] = (), opens: tuple[int, ...] = (),
                 kind: str = "json_schema") -> None:
        self._matcher = matcher
        self.vocab_size = vocab_size
        self.kind = kind
        # Why the grammar can no longer be followed (it took past TOKEN_SECONDS for a
        # token): its rows then allow no token, and the sequence ends with this error.
        self.failure: SchemaError | None = None
        self._stuck = False
        self._after = tuple(after)
        self._recent: tuple[int, ...] = ()         # the output's last tokens while `after` is awaited
        self._opens = opens[0] if after and opens else None     # the output's first token may open a block
        self._waiting = bool(after) and self._opens is None

    def _awaited(self, recent: tuple[int, ...], token: int) -> tuple[tuple[int, ...], bool]:
        """The last tokens after `token`, and whether the grammar is still waiting."""
        recent = (*recent, token)[-len(self._after):]
        return recent, recent != self._after

    def _opened(self, token: int) -> bool | None:
        """For the output's first token, where it may open a block: True if it does (the
        matcher refuses it, and stays where it was), False if the matcher took it; None
        where the matcher has yet to judge it."""
        if token != self._opens:
            return None
        return not self._matcher.accept_token(token)

    def accept(self, token_id: int) -> bool:
        if self._opens is not None:                 # the output's first token
            opened = self._opened(token_id)
            self._opens = None
            if opened is not None:
                self._waiting = opened
                return True
        if self._waiting:
            self._recent, self._waiting = self._awaited(self._recent, token_id)
            return True
        started = time.perf_counter()
        ok = self._matcher.accept_token(token_id)
        self._timed(started, "taking a token")
        if not ok and not self._stuck:
            log.warning("no token fits the output's grammar here (token %d came); the output ends", token_id)
        self._stuck = self._stuck or not ok
        return ok

    @property
    def terminated(self) -> bool:
        return not self._waiting and (self._stuck or self._matcher.is_terminated())

    def _walk(self, tokens) -> tuple[int, int, bool]:
        """Take `tokens` as if output, stopping before one the grammar refuses and after
        one that ends it: how many were taken, how many of those the matcher took (the
        caller rolls them back), and whether the grammar still waits for its start."""
        recent, waiting, taken, fed = self._recent, self._waiting, 0, 0
        for token in tokens:
            opened = self._opened(token) if taken == 0 and self._opens is not None else None
            if opened is not None:
                waiting, fed = opened, fed + (not opened)
            elif waiting:
                recent, waiting = self._awaited(recent, token)
            elif self._matcher.is_terminated() or not self._matcher.accept_token(token):
                break
            else:
                fed += 1
            taken += 1
            if not waiting and self._matcher.is_terminated():
                break
        return taken, fed, waiting

    def fill(self, bitmask: torch.Tensor, row: int, ahead: tuple[int, ...] = ()) -> bool:
        """The mask of the next token, or of the token after `ahead` (drafted tokens,
        which the grammar accepts: `fitting`), in row `row`; False (row untouched) where
        the grammar does not hold that token yet."""
        if self.failure is not None:
            bitmask[row] = 0                        # no token: the sequence ends with the failure
            return True
        _, fed, waiting = self._walk(ahead)
        try:
            if not waiting:
                started = time.perf_counter()
                self._matcher.fill_next_token_bitmask(bitmask, row)
                if self._timed(started, "masking a token"):
                    bitmask[row] = 0
                if self._opens is not None and not ahead:
                    _allow(bitmask, row, self._opens)
        finally:                    # a failed fill leaves the matcher where the sequence is
            if fed:
                self._matcher.rollback(fed)
        return not waiting

    def _timed(self, started: float, what: str) -> bool:
        """Whether following the grammar has become too slow (`failure` set): one token's
        `what` took past TOKEN_SECONDS."""
        took = time.perf_counter() - started
        if took > TOKEN_SECONDS and self.failure is None:
            name, code = _KINDS[self.kind]
            log.warning("a %s took %.2f s %s: the sequence ends", name, took, what)
            self.failure = SchemaError(f"the {name} became too costly to follow: {what} took {took:.2f} s (at most "
                                       f"{TOKEN_SECONDS:g} s); an ambiguous grammar costs more with every token", code)
        return self.failure is not None

    def fitting(self, draft: list[int]) -> list[int]:
        """The leading tokens of `draft` the grammar allows from here (speculative
        decoding drafts only those), short of a stop token that ends the grammar: the
        verify row after it would have no next token to mask, and the row before it
        samples the end itself. The matcher is left where it was."""
        taken, fed, waiting = self._walk(draft)
        ended = not waiting and self._matcher.is_terminated()
        if fed:
            self._matcher.rollback(fed)
        return draft[:taken - (ended and fed > 0)]


def _allow(bitmask: torch.Tensor, row: int, token: int) -> None:
    """Set `token`'s bit in an xgrammar bitmask row (int32 words, bit i of word w is
    token 32w + i)."""
    word, bit = divmod(token, 32)
    bitmask[row, word] |= (1 << bit) - (1 << 32 if bit == 31 else 0)


def fill_masks(constraints: list[tuple[Constraint | None, tuple[int, ...]]]) -> Callable[[torch.Tensor], None] | None:
    """The masks of one step's sampling rows, each (its sequence's constraint, None for
    a free row; the drafted tokens before the row), as a function that applies them to
    the step's logits in place."""
    held = [i for i, (c, _) in enumerate(constraints) if c is not None]
    if not held:
        return None
    import xgrammar as xgr
    vocab = constraints[held[0]][0].vocab_size
    bitmask = xgr.allocate_token_bitmask(len(constraints), vocab)
    rows = [i for i in held if constraints[i][0].fill(bitmask, i, constraints[i][1])]
    if not rows:                                # every grammar still waits for its start
        return None

    def apply(logits: torch.Tensor) -> None:
        mask = bitmask.to(logits.device, non_blocking=True)
        xgr.apply_token_bitmask_inplace(logits, mask, vocab_size=min(vocab, logits.shape[-1]), indices=rows)
    return apply
