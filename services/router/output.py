"""From the workers' token stream to the caller's text: one request's choices, each
detokenized incrementally (UTF-8 safe), cut at its stop strings, and, when it is bound
by a JSON schema, checked against it at its end (schema_guard.py)."""
from __future__ import annotations

from typing import Callable

from services.engine.core.sampling import TokenLogprob
from services.engine.text.tokenizer import IncrementalDetokenizer, StopMatcher
from services.router.generation import Delta, Generation
from services.router.schema_guard import SchemaGuard


class _Choice:
    def __init__(self, tokenizer, gen: Generation, index: int) -> None:
        self.detok = IncrementalDetokenizer(tokenizer, gen.prompt_ids)
        self.stops = StopMatcher(gen.params.stop)
        after = tokenizer.decode(gen.params.structure_after) if gen.params.structure_after else ""
        self.guard = SchemaGuard(gen.request_id, index, gen.params, after) if gen.params.json_schema else None


class OutputProcessor:
    """Every choice's deltas (`gens`: one per choice, the first leading: the others take
    its route). A stop string ends a choice here; while other choices still run,
    `end_choice(index)` ends it on its worker too."""

    def __init__(self, tokenizer, gens: list[Generation], end_choice: Callable[[int], None]) -> None:
        self.gens = gens
        self.choices = [_Choice(tokenizer, g, i) for i, g in enumerate(gens)]
        self.running = set(range(len(gens)))
        self.end_choice = end_choice

    @property
    def finished(self) -> bool:
        return not self.running

    async def feed(self, index: int, token_ids: list[int], finish: str,
                   logprobs: list[TokenLogprob] | None) -> Delta | None:
        """The delta for one message of the workers' stream; None for a choice already
        ended here. Raises APIError when a choice's output breaks its schema."""
        if index not in self.running:            # ended here by a stop string already
            return None
        gen, choice, leader = self.gens[index], self.choices[index], self.gens[0]
        if gen is not leader:
            gen.same_route_as(leader)
        text, hit, used = self._text(gen, choice, token_ids)
        if used < len(token_ids):               # a stop string inside a delta of several tokens
            token_ids, logprobs = token_ids[:used], logprobs[:used] if logprobs else logprobs
        if gen.thinking is not None:
            gen.thinking.feed(token_ids)
        if hit:
            finish = "stop"
            gen.stop_reason = choice.stops.matched
            if len(self.running) > 1:            # the others go on: end this one on its worker
                self.end_choice(index)
        elif finish:
            text += choice.stops.feed(choice.detok.flush())[0] + choice.stops.flush()
            if finish == "stop" and token_ids and token_ids[-1] in gen.params.stop_token_ids:
                gen.stop_reason = token_ids[-1]
        if choice.guard is not None:
            await choice.guard.feed(text, token_ids, finish, hit)
        if finish:
            gen.finish_reason = finish
            self.running.discard(index)
        return Delta(text, token_ids, finish or None, logprobs, index)

    @staticmethod
    def _text(gen: Generation, choice: _Choice, token_ids: list[int]) -> tuple[str, bool, int]:
        """The text `token_ids` add, whether a stop string ended it, and how many of the
        tokens it took. A delta of several tokens (speculative decoding) is read a token
        at a time, as it was made, when a stop string could end it inside: the choice
        then ends on the token that completed the stop string, as it would without."""
        if len(token_ids) == 1 or not gen.params.stop:
            gen.completion_tokens += len(token_ids)
            # vLLM looks for stop strings only once min_tokens tokens are out
            armed = gen.completion_tokens >= gen.params.min_tokens
            text, hit = choice.stops.feed(choice.detok.push(token_ids), armed)
            return text, hit, len(token_ids)
        parts = []
        for used, token in enumerate(token_ids, 1):
            gen.completion_tokens += 1
            text, hit = choice.stops.feed(choice.detok.push([token]), gen.completion_tokens >= gen.params.min_tokens)
            parts.append(text)
            if hit:
                return "".join(parts), True, used
        return "".join(parts), False, len(token_ids)
