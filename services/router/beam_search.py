"""Beam search, as vLLM serves it (`use_beam_search: true`, `n` beams, `length_penalty`),
chat and completions, not streamed.

Like vLLM's (vllm/entrypoints/generate/beam_search), it runs at the front end, over the
cluster's own requests: each step asks one token of every live beam, the beam's whole
text as its prompt (the prefix cache holds all but its last block), with the 2n likeliest
tokens' log probabilities; every beam grows by each of them, and the n best sums go on.
A beam that would take the end-of-sequence token is set aside as finished, unless
`ignore_eos`. After `max_tokens` steps (or when no beam is left, or none still running
could rank among the n best finished: `_settled`) the n best of the
finished and the live ones by `cumulative logprob / length ** length_penalty` (the length
counting the prompt, without a final EOS) are the choices, best first.

Where it differs: every step expands each beam by its likeliest tokens alone, on the raw
log probabilities, so the search is deterministic; vLLM also adds each beam's token
sampled at the request's temperature as one more candidate (the same thing at
temperature 0).
"""
from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass, field

from fastapi.responses import Response

from services.engine.core.sampling import MAX_TOP_LOGPROBS, SamplingParams, TokenLogprob
from services.router.access import attach, unattached
from services.router.choices import Shape, base_of, whole_answer
from services.router.frontend import Collected, FrontEnd
from services.router.generation import Generation
from services.router.http_input import error_response
from services.router.protocol import APIError, CommonRequest, bad_request
from services.router.reasoning import Thinking

MAX_BEAMS = MAX_TOP_LOGPROBS // 2       # each step asks 2n alternatives of every beam


@dataclass
class Beam:
    tokens: list[int]                   # the prompt's and the beam's own
    cum_logprob: float = 0.0
    logprobs: list[TokenLogprob] = field(default_factory=list)     # one per token of its own
    finish_reason: str | None = None
    stop_reason: int | None = None

    def score(self, eos: int | None, length_penalty: float) -> float:
        """vLLM's (transformers'): cumulative logprob / length ** length_penalty, the length
        counting the prompt and not a final EOS; the power bounded, so an absurd penalty
        orders beams instead of overflowing."""
        length = max(len(self.tokens) - (eos is not None and self.tokens[-1] == eos), 1)
        return self.cum_logprob * math.exp(max(min(-length_penalty * math.log(length), 700.0), -700.0))


async def search(fe: FrontEnd, template: Generation, width: int, length_penalty: float, include_stop: bool,
                 tenant: str, top: int | None = None, seconds: float | None = None) -> list[Beam]:
    """The `width` best beams after `template`'s prompt, up to its params' max_tokens
    (and its ignore_eos; `include_stop`: a finished beam keeps its EOS token); `top`:
    each token's alternatives to keep for the answer's logprobs (at least 2 x width are
    computed). Each step's requests are `tenant`'s, admitted as any other; the whole
    search must end within `seconds` (the router's request timeout at most), else 504."""
    params, prompt_len = template.params, len(template.prompt_ids)
    eos = getattr(fe.tokenizer, "eos_token_id", None)
    one_token = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, logprobs=max(2 * width, top or 0),
                               cache_salt=params.cache_salt)
    budget = fe.request_timeout if seconds is None else min(seconds, fe.request_timeout)
    deadline = time.monotonic() + budget
    live, finished = [Beam(list(template.prompt_ids))], []
    for step in range(params.max_tokens):
        left = deadline - time.monotonic()
        if left <= 0:
            raise APIError(504, f"the beam search did not finish within {budget:g} s", type_="timeout",
                           code="request_timeout", grpc_code="DEADLINE_EXCEEDED")
        gens = [Generation(f"{template.request_id}-step{step}-beam{i}", beam.tokens, one_token)
                for i, beam in enumerate(live)]
        # each beam a prompt of its own (one prompt's choices would share its KV)
        with unattached():
            running = fe.start_prompts([[g] for g in gens], deadline=left, tenant=tenant)
        results = await running.collect()
        grown = []                          # (sum, token, beam, its logprob entry): only the best become beams
        for beam, result in zip(live, results):
            if not result.logprobs:         # a step of one token, EOS ignored: always one
                raise APIError(500, "a beam search step came back without its token", type_="internal_error",
                               grpc_code="INTERNAL")
            lp = result.logprobs[0]
            for token, logprob in _alternatives(lp, 2 * width):
                total = beam.cum_logprob + logprob
                entry = TokenLogprob(token, logprob, lp.top_ids[:top or 0], lp.top_logprobs[:top or 0])
                if token == eos and not params.ignore_eos:
                    kept = ([token], [entry]) if include_stop else ([], [])
                    finished.append(Beam(beam.tokens + kept[0], total, beam.logprobs + kept[1], "stop", token))
                else:
                    grown.append((total, token, beam, entry))
        # a finished beam's score is final: only the best `width` of them can be chosen
        finished = _best(finished, eos, length_penalty, width)
        grown.sort(key=lambda g: g[0], reverse=True)
        live = [Beam(beam.tokens + [token], total, beam.logprobs + [entry])
                for total, token, beam, entry in grown[:width]]
        if not live or _settled(finished, live, width, eos, length_penalty, prompt_len + params.max_tokens):
            break
    for beam in live:
        beam.finish_reason = "length"
    beams = _best(finished + live, eos, length_penalty, width)
    for beam in beams:
        del beam.tokens[:prompt_len]
    return beams


def _settled(finished: list[Beam], live: list[Beam], width: int, eos: int | None, length_penalty: float,
             longest: int) -> bool:
    """Whether no live beam can still rank among the `width` best: `width` have finished
    and the worst of them scores at least what any live beam could reach. Its sum only
    falls, so with a positive length penalty the most it can reach is its sum over the
    longest length (`longest` tokens), else its score now. The answer is then the one
    running to max_tokens gives (vLLM's runs them all)."""
    if len(finished) < width:
        return False
    worst = min(b.score(eos, length_penalty) for b in finished)
    if length_penalty > 0:
        return all(b.cum_logprob / longest ** length_penalty <= worst for b in live)
    return all(b.score(eos, length_penalty) <= worst for b in live)


def _alternatives(lp: TokenLogprob, count: int) -> list[tuple[int, float]]:
    """A step's candidates: its `count` likeliest tokens, and the one taken if not among
    them."""
    found = dict(zip(lp.top_ids[:count], lp.top_logprobs[:count]))
    found.setdefault(lp.token_id, lp.logprob)
    return [(t, v) for t, v in found.items() if math.isfinite(v)]


def _best(beams: list[Beam], eos: int | None, length_penalty: float, width: int) -> list[Beam]:
    return sorted(beams, key=lambda b: b.score(eos, length_penalty), reverse=True)[:width]


def as_choices(fe: FrontEnd, template: Generation, beams: list[Beam], skip_special_tokens: bool,
               thinking: Thinking | None = None) -> tuple[list[Generation], list[Collected]]:
    """The beams as a prompt's choices (generations and their whole results), for the
    answer the other requests' choices make (choices.whole_choice); `thinking`: how a
    chat's thinking is told (--reasoning-parser), for usage's reasoning tokens."""
    gens, results = [], []
    eos = getattr(fe.tokenizer, "eos_token_id", None)
    for i, beam in enumerate(beams):
        gen = Generation(f"{template.request_id}-{i}", template.prompt_ids, template.params)
        gen.finish_reason, gen.stop_reason, gen.completion_tokens = beam.finish_reason, beam.stop_reason, \
            len(beam.tokens)
        gen.decision = "beam_search"
        if thinking is not None:                # --reasoning-parser: the beam's thinking tokens, for usage
            gen.thinking = fe.thinking_tokens(thinking)
            gen.thinking.feed(beam.tokens)
        attach(gen)
        text_ids = beam.tokens[:-1] if beam.tokens and beam.tokens[-1] == eos and beam.finish_reason == "stop" \
            else beam.tokens
        text = fe.tokenizer.decode(text_ids, skip_special_tokens=skip_special_tokens)
        gens.append(gen)
        results.append(Collected(text, list(beam.tokens), beam.logprobs))
    return gens, results


async def searched(fe: FrontEnd, prompts: list[list[Generation]], width: int, length_penalty: float, tenant: str,
                   include_stop: bool = False, skip_special_tokens: bool = True, seconds: float | None = None,
                   thinking: Thinking | None = None) -> tuple[list[Generation], list[Collected]]:
    """Each prompt's beam search of `width` beams (its choices' first generation the
    template), side by side, within `seconds`; the choices of all prompts in order. What
    beam search cannot do is refused first (refuse_what_it_cannot); one prompt's failure
    stops the others'."""
    template = prompts[0][0].params
    refuse_what_it_cannot(template, width, length_penalty)
    searches = [asyncio.ensure_future(search(fe, gens[0], width, length_penalty, include_stop, tenant,
                                             template.logprobs, seconds)) for gens in prompts]
    try:
        found = await asyncio.gather(*searches)
    except BaseException:
        for task in searches:
            task.cancel()
        await asyncio.gather(*searches, return_exceptions=True)
        raise
    gens: list[Generation] = []
    results: list[Collected] = []
    for prompt, beams in zip(prompts, found):
        g, r = as_choices(fe, prompt[0], beams, skip_special_tokens, thinking)
        gens += g
        results += r
    return gens, results


def refuse_what_it_cannot(params: SamplingParams, width: int, length_penalty: float) -> None:
    """What beam search cannot do for a request of `width` beams, refused by name: more
    beams than a step's alternatives allow, prompt logprobs, an infinite penalty; and a
    grammar (structured outputs), stop strings and tokens, min_tokens and the token
    constraints, which vLLM's would leave unapplied."""
    if width > MAX_BEAMS:
        raise bad_request(f"n is the beam width with use_beam_search: at most {MAX_BEAMS} (each step asks for 2n "
                          f"alternatives, {MAX_TOP_LOGPROBS} at most)", param="n")
    if params.prompt_logprobs is not None:
        raise bad_request("beam search computes no prompt logprobs", param="prompt_logprobs")
    if not math.isfinite(length_penalty):
        raise bad_request("length_penalty must be a finite number", param="length_penalty")
    if params.structure is not None:
        raise bad_request("structured outputs (response_format, structured_outputs, guided_*) are not applied "
                          "with use_beam_search", param="use_beam_search")
    # what each step's one-token requests would need to carry and the search to apply
    # (vLLM's leaves them unapplied, silently)
    for param, asked in (("stop", params.stop), ("stop_token_ids", params.stop_token_ids),
                         ("min_tokens", params.min_tokens), ("logit_bias", params.logit_bias),
                         ("allowed_token_ids", params.allowed_token_ids), ("bad_words", params.bad_words)):
        if asked:
            raise bad_request(f"{param} is not applied with use_beam_search", param=param)


async def respond(fe: FrontEnd, req: CommonRequest, request_id: str, prompts: list[list[Generation]], shape: Shape,
                  tenant: str) -> Response:
    """choices.respond's answer, its choices found by beam search (`prompts`: each
    prompt's generations as the request asked them, n a prompt)."""
    if shape.tools is not None:
        raise bad_request("tools are not parsed with use_beam_search", param="tools")
    try:
        gens, results = await searched(fe, prompts, req.choices, req.length_penalty, tenant,
                                       req.include_stop_str_in_output, req.skip_special_tokens,
                                       thinking=shape.thinking)
    except APIError as exc:
        return error_response(exc)
    return whole_answer(base_of(fe, request_id, shape), gens, results, req, shape, len(prompts))
