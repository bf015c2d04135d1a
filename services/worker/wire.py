"""Conversions between wire messages and engine dataclasses, in one place."""
from __future__ import annotations

from services.engine.core.sampling import SamplingParams, TokenLogprob
from services.rpc import generate_pb2


def sampling_to_proto(p: SamplingParams) -> generate_pb2.SamplingParams:
    return generate_pb2.SamplingParams(
        max_tokens=p.max_tokens, temperature=p.temperature, top_p=p.top_p, top_k=p.top_k,
        seed=p.seed, stop=list(p.stop), ignore_eos=p.ignore_eos, min_tokens=p.min_tokens,
        presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty,
        repetition_penalty=p.repetition_penalty, min_p=p.min_p, logit_bias=dict(p.logit_bias),
        stop_token_ids=list(p.stop_token_ids), logprobs=p.logprobs, json_schema=p.json_schema, regex=p.regex,
        grammar=p.grammar, structural_tag=p.structural_tag, prompt_logprobs=p.prompt_logprobs, allowed_token_ids=list(p.allowed_token_ids),
        bad_words=[generate_pb2.TokenIds(ids=w) for w in p.bad_words], cache_salt=p.cache_salt,
        structure_after=list(p.structure_after), structure_opens=list(p.structure_opens))


def sampling_from_proto(m: generate_pb2.SamplingParams) -> SamplingParams:
    """For messages the router built (every field resolved)."""
    return SamplingParams(
        max_tokens=m.max_tokens, temperature=m.temperature, top_p=m.top_p, top_k=m.top_k,
        seed=m.seed, stop=tuple(m.stop), ignore_eos=m.ignore_eos, min_tokens=m.min_tokens,
        presence_penalty=m.presence_penalty, frequency_penalty=m.frequency_penalty,
        repetition_penalty=m.repetition_penalty if m.HasField("repetition_penalty") else 1.0, min_p=m.min_p,
        logit_bias=tuple(sorted(m.logit_bias.items())), stop_token_ids=tuple(m.stop_token_ids),
        logprobs=m.logprobs if m.HasField("logprobs") else None, json_schema=m.json_schema, regex=m.regex,
        grammar=m.grammar, structural_tag=m.structural_tag,
        prompt_logprobs=m.prompt_logprobs if m.HasField("prompt_logprobs") else None,
        allowed_token_ids=tuple(m.allowed_token_ids), bad_words=tuple(tuple(w.ids) for w in m.bad_words),
        cache_salt=m.cache_salt, structure_after=tuple(m.structure_after),
        structure_opens=tuple(m.structure_opens))


def logprob_to_proto(lp: TokenLogprob) -> generate_pb2.TokenLogprob:
    return generate_pb2.TokenLogprob(token_id=lp.token_id, logprob=lp.logprob, top_ids=lp.top_ids,
                                     top_logprobs=lp.top_logprobs)


def prompt_logprobs_to_proto(logprobs: list[TokenLogprob | None] | None) -> list[generate_pb2.TokenLogprob]:
    """Prompt tokens 1.. (the first has none)."""
    return [logprob_to_proto(lp) for lp in (logprobs or [None])[1:]]


def logprob_from_proto(m: generate_pb2.TokenLogprob) -> TokenLogprob:
    return TokenLogprob(m.token_id, m.logprob, list(m.top_ids), list(m.top_logprobs))


def check_tokens(token_ids, vocab_size: int, what: str = "prompt", allow_empty: bool = False) -> list[int]:
    """Token ids from the wire as a list, each one the model can embed; ValueError otherwise
    (an id past the embedding table would fail the whole batch's forward pass)."""
    ids = list(token_ids)
    if not ids and not allow_empty:
        raise ValueError(f"the {what} is empty")
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ValueError(f"{what} token id {bad} is outside the model's vocabulary [0, {vocab_size})")
    return ids


def check_request_id(request_id: str) -> str:
    if not request_id or len(request_id) > MAX_REQUEST_ID:
        raise ValueError(f"request_id must be 1 to {MAX_REQUEST_ID} characters")
    return request_id


MAX_REQUEST_ID = 256
# Trailing metadata of a refusal: the OpenAI error code the router answers with (e.g.
# "invalid_json_schema"), where the worker knows a more precise one than a 400's default.
ERROR_CODE_KEY = "pdserve-error-code"
# ... and the request parameter to blame, where the worker knows it (a sampling value).
ERROR_PARAM_KEY = "pdserve-error-param"
# ERROR_CODE_KEY's value where a worker refused a call before starting any of it (a draining prefill
# worker): the router knows no write into a reservation can follow.
REFUSED_UNSTARTED = "refused_unstarted"
