"""What the HTTP and gRPC front ends share: model and prompt checks, admission, and
each admitted request running as its own task.

The task feeds a queue that the response reads. Whatever happens to the connection,
the task's `finally` releases the request on every worker; a client that disconnects
cancels the task.
"""
from __future__ import annotations

import asyncio
import dataclasses
import functools
import hashlib
import inspect
import itertools
import logging
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable, TypeVar

from services.engine.core.sampling import MAX_BAD_WORDS, SamplingParams, TokenLogprob
from services.engine.text import json_schema
from services.engine.text.tokenizer import encode_chat, encode_prompt, token_bytes
from services.router.access import attach
from services.router.admission import TENANT, Admission, FairGate
from services.router.cluster import Cluster
from services.router.fairness import Ticket
from services.router.generation import Delta, Generation
from services.router.output_text import ChoiceText, TextOptions
from services.router.protocol import APIError, bad_request
from services.router.reasoning import Thinking, ThinkingTokens

log = logging.getLogger(__name__)


# A token of any tokenizer this serves covers far fewer characters than this: text longer
# than context x this cannot fit, and is refused before any tokenizing.
MAX_CHARS_PER_TOKEN = 64
# Deltas a response may hold unread before the generation waits for its client.
STREAM_BUFFER = 256
# Threads that tokenize (and compile schemas) for the front ends, off the event loop.
TOKENIZER_THREADS = 2
T = TypeVar("T")


@dataclass
class FrontEnd:
    """What the front ends (HTTP and gRPC) share."""
    cluster: Cluster
    admission: Admission
    tokenizer: object
    served_model_name: str
    max_model_len: int
    max_body_bytes: int
    request_timeout: float = 600.0
    # Tokenizing runs here, off the event loop: a long prompt must not stall every other
    # request (and /ready) while it is cut into tokens. Its turns go round the tenants.
    executor: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(
        max_workers=TOKENIZER_THREADS, thread_name_prefix="tokenize"))
    gate: FairGate = field(default_factory=lambda: FairGate(TOKENIZER_THREADS))
    sse_keepalive: float = 15.0
    shared_prefix_cache: bool = False
    # what a request's absent sampling fields take (router/sampling.py: sampling_defaults)
    sampling_defaults: dict = field(default_factory=dict)
    model_aliases: tuple[str, ...] = ()        # the other names clients may send (--served-model-name a b)
    reasoning_parser: str = "none"             # router/reasoning.py's PARSERS, or none
    tool_call_parser: str | None = "hermes"    # router/tool_syntax.py's SYNTAXES; None: no tool_choice auto
    tool_strict_level: str = "auto"            # which "auto" calls a grammar holds (tools.py ToolPlan.grammar_for_calls)
    _token_text: dict[int, str] = field(init=False, default_factory=dict)
    _tags: dict[str, tuple[int, ...]] = field(init=False, default_factory=dict)
    _running: weakref.WeakSet = field(init=False, default_factory=weakref.WeakSet)
    _drain_by: float | None = field(init=False, default=None)     # the loop time every request ends by, draining

    def drain(self, seconds: float) -> None:
        """Shutting down: every request running now ends within `seconds`, finished or
        with a clear 503 (an error event and [DONE] on a stream), never cut off."""
        when = asyncio.get_running_loop().time() + seconds
        self._drain_by = when                   # and those started from now on (a beam search's next steps)
        for running in list(self._running):
            running.end_by(when)

    async def _off_loop(self, fn: Callable[..., T], *args) -> T:
        """`fn(*args)` on a tokenizer thread, in the turn of the request's tenant."""
        async with self.gate.turn(TENANT.get()):
            return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    def cache_salt(self, asked: str | None) -> str:
        """The prompt's prefix-cache salt (engine/core/prefix_cache.py): its API key's own
        (the request's tenant) unless --shared-prefix-cache, and the client's cache_salt
        (vLLM's) beside it; "" where neither applies."""
        tenant = "" if self.shared_prefix_cache else TENANT.get()
        if not tenant and not asked:
            return ""
        return hashlib.sha256(f"{tenant}\0{asked or ''}".encode()).hexdigest()[:32]

    @property
    def vocab_size(self) -> int:
        return len(self.tokenizer)

    def _template_mentions(self, word: str) -> bool:
        template = self.tokenizer.chat_template
        return isinstance(template, str) and word in template

    @property
    def supports_tools(self) -> bool:
        """Whether the chat template renders a `tools` list (Hugging Face's convention)."""
        return self._template_mentions("tools")

    def token_text(self, token_id: int) -> str:
        """One token alone as text, for logprobs (a piece of a UTF-8 character shows as U+FFFD)."""
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.tokenizer.decode([token_id])
        return text

    def token_bytes(self, token_id: int) -> list[int]:
        """One token's own bytes, for logprobs: a piece of a UTF-8 character as the bytes it is."""
        return list(token_bytes(self.tokenizer, token_id, self.token_text(token_id)))

    async def check_schema(self, schema: str, param: str) -> str:
        """`schema` if it is one some value can meet; else a 400 naming `param`. Compiling
        it is the workers' (xgrammar loads torch, which the router does not)."""
        try:
            await self._off_loop(json_schema.parse, schema)
        except ValueError as exc:
            raise bad_request(str(exc), param=param, code="invalid_json_schema") from None
        return schema

    @property
    def model_names(self) -> tuple[str, ...]:
        return (self.served_model_name, *self.model_aliases)

    def check_model(self, model: str | None) -> None:
        if model and model not in self.model_names:
            served = ", ".join(f"`{name}`" for name in self.model_names)
            raise APIError(404, f"The model `{model}` does not exist. Served: {served}.",
                           code="model_not_found", param="model", grpc_code="NOT_FOUND")

    def _check_text(self, texts: list[str], param: str) -> None:
        chars = sum(len(t) for t in texts)
        if chars > self.max_model_len * MAX_CHARS_PER_TOKEN:
            raise APIError(400, f"This model's maximum context length is {self.max_model_len} tokens; a prompt of "
                                f"{chars} characters cannot fit in it.", code="context_length_exceeded", param=param)
        for t in texts:
            check_unicode(t, param)

    def _check_ids(self, ids: list[int], param: str) -> None:
        if len(ids) > self.max_model_len:       # first: walking millions of ids holds the event loop
            raise APIError(400, f"This model's maximum context length is {self.max_model_len} tokens; the prompt "
                                f"has {len(ids)}.", code="context_length_exceeded", param=param)
        vocab = len(self.tokenizer)
        if any(not 0 <= t < vocab for t in ids):
            raise bad_request(f"{param} token ids must be in [0, {vocab})", param=param)

    async def tokenize_chat(self, messages: list[dict], tools: list[dict] | None = None,
                            add_generation_prompt: bool = True, add_special_tokens: bool = False,
                            continue_final_message: bool = False, template_kwargs: dict | None = None) -> list[int]:
        """The conversation through the chat template. `template_kwargs` (vLLM's
        chat_template_kwargs) are more variables for the template; they may also set
        add_generation_prompt and continue_final_message, as in vLLM."""
        self._check_text([m["content"] for m in messages], "messages")
        if not self._template_mentions("developer"):
            # OpenAI's developer messages are its system messages, renamed for its
            # reasoning models: a template that knows no such role reads them as system.
            messages = [{**m, "role": "system"} if m["role"] == "developer" else m for m in messages]
        kwargs = dict(template_kwargs or {})
        reserved = sorted(set(kwargs) & self._template_arguments)
        if reserved:
            raise bad_request(f"chat_template_kwargs may not set {reserved[0]!r}: it is an argument of the template "
                              "call, not a variable of the template", param=f"chat_template_kwargs.{reserved[0]}")
        add_generation_prompt = kwargs.pop("add_generation_prompt", add_generation_prompt)
        continue_final_message = kwargs.pop("continue_final_message", continue_final_message)
        for name, value in (("add_generation_prompt", add_generation_prompt),
                            ("continue_final_message", continue_final_message)):
            if not isinstance(value, bool):
                raise bad_request(f"{name} must be true or false", param=f"chat_template_kwargs.{name}")
        if add_generation_prompt and continue_final_message:
            raise bad_request("add_generation_prompt and continue_final_message cannot both be true: the first opens "
                              "a new assistant message, the second continues the last one",
                              param="continue_final_message")
        encode = functools.partial(encode_chat, self.tokenizer, messages, tools, add_generation_prompt,
                                   add_special_tokens, continue_final_message, kwargs)
        try:
            return await self._off_loop(encode)
        except Exception as exc:                  # a template that rejects the conversation
            raise bad_request(f"cannot apply the chat template: {type(exc).__name__}", param="messages") from None

    def thinking_of(self, prompt_ids: list[int]) -> Thinking | None:
        """How a chat answer's thinking is told from its content (--reasoning-parser): open
        from its first token where the prompt ends with the start tag. None: no parser."""
        if self.reasoning_parser == "none":
            return None
        tail = self.tokenizer.decode(prompt_ids[-64:])        # where the template left the block
        return Thinking.for_prompt(self.reasoning_parser, tail)

    def grammar_start(self, prompt_ids: list[int],
                      structure: tuple[str, str] | None) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Where a structured output's grammar starts (SamplingParams' structure_after and
        structure_opens), beside a reasoning parser: where the prompt leaves the block
        open, the model thinks first, free, and the grammar holds the answer after the end
        tag, as vLLM's does; where the prompt closed it (a hybrid model told not to think),
        from the first token, as vLLM's does. Where it did neither (a hybrid model's
        template that leaves thinking to the model), vLLM waits for the end tag whatever
        the model does; here the model may open the block with its first token, and think
        until the end tag, or answer at once, held from its first token. That needs a
        start tag of one token, as reasoning models' vocabularies have: the first of
        several ("<") is no sign of thinking, and such a prompt's grammar holds from the
        first token. Without a parser or a structure: from the first token."""
        thinking = self.thinking_of(prompt_ids) if structure is not None else None
        if thinking is None or thinking.closed_in_prompt:
            return (), ()
        end, start = self._tag_ids(thinking.end), self._tag_ids(thinking.start)
        if thinking.open_at_start:
            return end, ()
        return (end, start) if len(start) == 1 else ((), ())

    def thinking_tokens(self, thinking: Thinking) -> ThinkingTokens:
        """A counter of one choice's thinking tokens (usage's reasoning_tokens)."""
        return ThinkingTokens(thinking.start, thinking.end, thinking.open_at_start, self.token_text)

    def _tag_ids(self, tag: str) -> tuple[int, ...]:
        """A reasoning tag's tokens (one token, in reasoning models' vocabularies)."""
        ids = self._tags.get(tag)
        if ids is None:
            ids = self._tags[tag] = tuple(self.tokenizer.encode(tag, add_special_tokens=False))
        return ids

    @functools.cached_property
    def _template_arguments(self) -> frozenset[str]:
        """apply_chat_template's own parameters, which chat_template_kwargs may not pass
        (but for the two vLLM lets it set)."""
        names = inspect.signature(self.tokenizer.apply_chat_template).parameters
        return frozenset(n for n, p in names.items() if p.kind is not p.VAR_KEYWORD) \
            - {"add_generation_prompt", "continue_final_message"} | {"messages", "chat_template", "tokenize"}

    async def tokenize_prompt(self, prompt: str | list[int], add_special_tokens: bool = True,
                              param: str = "prompt") -> list[int]:
        if isinstance(prompt, list):
            self._check_ids(prompt, param)
            return list(prompt)
        self._check_text([prompt], param)
        return await self._off_loop(encode_prompt, self.tokenizer, prompt, add_special_tokens)

    async def tokenize_bad_words(self, words: list[str]) -> list[list[int]]:
        """vLLM's bad_words as token sequences: each word as it would begin the output and,
        where that is a different token sequence of the same length, after a space."""
        self._check_text(words, "bad_words")
        if len(words) * 2 > MAX_BAD_WORDS:
            raise bad_request(f"bad_words takes at most {MAX_BAD_WORDS // 2} words", param="bad_words")

        def encode() -> list[list[int]]:
            out = []
            for word in words:
                plain = self.tokenizer.encode(word.lstrip(), add_special_tokens=False)
                spaced = self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
                out += [plain] if plain else []
                if spaced and (not plain or (spaced[0] != plain[0] and len(spaced) == len(plain))):
                    out.append(spaced)
            return out
        return await self._off_loop(encode)

    async def detokenize(self, ids: list[int]) -> str:
        self._check_ids(ids, "tokens")
        return await self._off_loop(self.tokenizer.decode, ids)

    def start(self, gens: list[Generation], deadline: float | None = None, tenant: str = "",
              text: TextOptions = TextOptions()) -> "RunningRequest":
        """Admit and run a request's choices (`gens`, one per choice) for `tenant` (its API
        key's); it must end within `deadline` seconds (default: the router's
        --request-timeout), queueing included. APIError 429 where it is not admitted."""
        return self.start_prompts([gens], deadline, tenant, text)

    def start_prompts(self, prompts: list[list[Generation]], deadline: float | None = None, tenant: str = "",
                      text: TextOptions = TextOptions()) -> "RunningRequest":
        """`start` for a request of several prompts (each a list of generations, one per
        choice): each prompt is admitted, routed and run on its own, as if sent alone.
        If one is not admitted, none runs."""
        for gens in prompts:
            for gen in gens:
                attach(gen)
        # What each prompt may cost the workers, as a token rate counts it: prompt and
        # max_tokens. The request is admitted as a whole or refused as one.
        tickets = self.admission.admit_all(tenant, [(len(gens[0].prompt_ids) + sum(g.params.max_tokens for g in gens),
                                                     len(gens)) for gens in prompts])
        texts = None
        # The cluster's text keeps a stop token's text; vLLM's leaves it out: written
        # again here where that can differ (a stop token that is no special token).
        if text.rewrites or prompts[0][0].params.stop_token_ids:
            texts = [[ChoiceText(self.tokenizer, g.prompt_ids, g.params.stop, text, g.params.min_tokens)
                      for g in gens] for gens in prompts]
        running = RunningRequest(self.cluster, self.admission, list(zip(tickets, prompts)),
                                 min(deadline or self.request_timeout, self.request_timeout), texts)
        if self._drain_by is not None:
            running.end_by(self._drain_by)
        self._running.add(running)
        return running


def choices(request_id: str, prompt_ids: list[int], params: SamplingParams, n: int) -> list[Generation]:
    """One generation per choice, each with its own seed (SamplingParams.for_choice)."""
    if n == 1:
        return [Generation(request_id, prompt_ids, params)]
    return [Generation(f"{request_id}-{i}", prompt_ids, params.for_choice(i)) for i in range(n)]


def check_unicode(text: str, param: str) -> str:
    """JSON escapes can carry a lone surrogate (\\ud800), which is no character: refuse it
    by name instead of letting the tokenizer fail on it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise bad_request(f"{param} holds an unpaired UTF-16 surrogate (U+{ord(text[exc.start]):04X}) at "
                          f"character {exc.start}: not valid Unicode", param=param, code="invalid_unicode") from None
    return text


_NOTHING = object()
_KEEPALIVE = object()                   # RunningRequest's queue: nothing came for a while


def _mergeable(first: Delta, then) -> bool:
    return (isinstance(then, Delta) and then.index == first.index
            and (first.logprobs is None) == (then.logprobs is None))


def _merged(first: Delta, then: Delta) -> Delta:
    """`first` and `then`, one choice's consecutive deltas, as one."""
    logprobs = None if first.logprobs is None else first.logprobs + then.logprobs
    return Delta(first.text + then.text, first.token_ids + then.token_ids, then.finish_reason, logprobs,
                 first.index)


class RunningRequest:
    """A request's generation (all its prompts and choices) running as tasks, one per
    prompt; deltas arrive on one bounded queue, numbered prompt x n + choice, so a client
    that stops reading holds the generation back instead of growing a buffer."""

    def __init__(self, cluster: Cluster, admission: Admission, prompts: list[tuple[Ticket, list[Generation]]],
                 timeout: float, texts: list[list[ChoiceText]] | None = None) -> None:
        self.gens = [g for _, gens in prompts for g in gens]
        self.gen = self.gens[0]
        self.prompts = [gens for _, gens in prompts]
        self.timeout = timeout
        self.admission = admission
        self.queue: asyncio.Queue[Delta | APIError | None] = asyncio.Queue(maxsize=STREAM_BUFFER)
        self._taken = time.monotonic()          # when the reader last took something off the queue
        self._deadlines: list[asyncio.Timeout] = []
        self._draining: float | None = None     # the loop time it must end by (the router is stopping)
        offsets = itertools.accumulate((len(gens) for _, gens in prompts), initial=0)
        self.tasks = [asyncio.create_task(self._run(cluster, ticket, gens, offset, texts and texts[p]))
                      for p, ((ticket, gens), offset) in enumerate(zip(prompts, offsets))]

    async def _run(self, cluster: Cluster, ticket: Ticket, gens: list[Generation], offset: int,
                   texts: list[ChoiceText] | None) -> None:
        try:
            async with asyncio.timeout(self.timeout) as deadline:
                self._deadlines.append(deadline)
                try:
                    if self._draining is not None:
                        deadline.reschedule(min(deadline.when(), self._draining))
                    await self._generate(cluster, ticket, gens, offset, texts)
                finally:
                    # An ended deadline cannot be rescheduled: a drain must not meet it. The
                    # request itself may outlive its end (in a reference cycle, until the
                    # garbage collector runs), in the drain's set of running requests.
                    self._deadlines.remove(deadline)
        except TimeoutError:
            if self._draining is not None:
                log.warning("request %s ended: the router is shutting down", gens[0].request_id)
                self._fail(APIError(503, "the router is shutting down and the request did not finish within its "
                                         "--drain-timeout; send it again", type_="service_unavailable",
                                    grpc_code="UNAVAILABLE"))
                return
            log.warning("request %s did not finish within %g s", gens[0].request_id, self.timeout)
            self._fail(APIError(504, f"the request did not finish within {self.timeout:g} s",
                                type_="timeout", code="request_timeout", grpc_code="DEADLINE_EXCEEDED"))

    def _fail(self, error: APIError) -> None:
        """`error` to the reader, at once: a reader that stopped reading may have filled
        the queue, and a task waiting for room would never end. The deltas it has not
        taken are dropped then; the error ends the response."""
        while self.queue.full():
            self.queue.get_nowait()
        self.queue.put_nowait(error)

    def end_by(self, when: float) -> None:
        """End by loop time `when` at the latest (the router is shutting down), with a 503."""
        self._draining = when
        for deadline in self._deadlines:
            if deadline.when() is None or deadline.when() > when:
                deadline.reschedule(when)

    async def _generate(self, cluster: Cluster, ticket: Ticket, gens: list[Generation], offset: int,
                        texts: list[ChoiceText] | None) -> None:
        metrics = cluster.metrics
        gen = gens[0]
        last: dict[int, float] = {}             # per choice: when its previous delta came
        ended = None
        try:
            await self.admission.wait(ticket)               # the router's queue, in fair order
            gen.priority = ticket.priority
            # closed as the task ends, cancelled or not: its workers' calls end with it, not
            # when the garbage collector finds the generator
            async with aclosing(cluster.generate(gens)) as stream:
                async for delta in stream:
                    now = time.monotonic()
                    if not last:
                        self.admission.first_token(ticket)
                        metrics.first_token(now - gen.started)
                        if gen.decision == "remote":       # prefilled by the prefill pool
                            cluster.latency.observe_ttft(gen.prefill_epoch, now - gen.started)
                    previous = last.get(delta.index)
                    if previous is None:
                        gens[delta.index].first_token_at = now
                    else:
                        metrics.token_gap(now - previous)
                        if delta.token_ids:                      # a closing chunk without tokens is no gap
                            cluster.latency.observe_itl(gen.decode_epoch, now - previous)
                    last[delta.index] = now
                    if texts is not None or offset:             # the request's own text, its own numbering
                        text = texts[delta.index].feed(delta.token_ids, delta.finish_reason) if texts else delta.text
                        delta = dataclasses.replace(delta, text=text, index=delta.index + offset)
                    await self.queue.put(delta)
            ended = gen.finish_reason
            await self.queue.put(None)
        except APIError as exc:
            self._fail(exc)
        except Exception:                             # CancelledError (client gone) passes through
            log.exception("request %s failed", gen.request_id)
            self._fail(APIError(500, "internal error", type_="server_error", grpc_code="INTERNAL"))
        finally:
            self.admission.done(ticket)
            metrics.request_ended(time.monotonic() - gen.started, len(gen.prompt_ids),
                                  sum(g.completion_tokens for g in gens), ended)

    async def deltas(self, keepalive: float = 0.0) -> AsyncIterator[Delta | None]:
        """Every choice's deltas; None whenever nothing came for `keepalive` seconds
        (0: never). Raises the request's APIError if it failed. Deltas of a choice that
        queued up while the caller was busy writing the last one go out as one (as
        vLLM's output collector merges them): a router that falls behind writes fewer,
        larger events instead of falling further behind."""
        running = len(self.tasks)
        held = _NOTHING                 # taken from the queue while merging, not handled yet
        self._taken = time.monotonic()
        ticker = asyncio.create_task(self._keepalives(keepalive)) if keepalive else None
        try:
            while running:
                if held is not _NOTHING:
                    item, held = held, _NOTHING
                else:
                    item = await self.queue.get()
                    self._taken = time.monotonic()
                if item is _KEEPALIVE:
                    yield None
                    continue
                if item is None:
                    running -= 1
                    continue
                if isinstance(item, APIError):
                    raise item
                while not item.finish_reason and not self.queue.empty():
                    following = self.queue.get_nowait()
                    if not _mergeable(item, following):
                        held = following
                        break
                    item = _merged(item, following)
                yield item
        finally:
            if ticker is not None:
                ticker.cancel()
            self.cancel()

    async def _keepalives(self, every: float) -> None:
        """A keep-alive on the queue whenever its reader has taken nothing for `every`
        seconds: one timer a period, where a timeout on each wait cost one a token (a
        tenth of the router's CPU per streamed token)."""
        while True:
            idle = time.monotonic() - self._taken
            if idle < every:
                await asyncio.sleep(every - idle)
                continue
            if self.queue.empty():              # not full, then: a reader stuck writing needs none
                self.queue.put_nowait(_KEEPALIVE)
            self._taken = time.monotonic()

    def cancel(self) -> None:
        """Stop whatever still runs (a client gone, or another prompt failed)."""
        for task in self.tasks:
            if not task.done():
                task.cancel()

    async def collect(self) -> list["Collected"]:
        """Each choice whole."""
        out = [Collected("", [], []) for _ in self.gens]
        async for d in self.deltas():
            c = out[d.index]
            c.text += d.text
            c.token_ids.extend(d.token_ids)
            c.logprobs.extend(d.logprobs or ())
        return out


@dataclass
class Collected:
    """A whole choice, for a response that is not streamed."""
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob]
