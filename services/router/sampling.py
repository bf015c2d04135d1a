"""Turn API sampling fields into engine `SamplingParams`, checking every range once,
for HTTP and gRPC alike."""
from __future__ import annotations

import math
import secrets

from services.engine.sampling import (MAX_LOGIT_BIAS, MAX_REPETITION_PENALTY, MAX_STOP_TOKEN_IDS,
                                      SamplingParams)
from services.router.protocol import APIError, bad_request

_U63 = (1 << 63) - 1


def context_error(prompt_len: int, max_model_len: int, max_tokens: int | None = None) -> APIError:
    if max_tokens is None:
        msg = (f"This model's maximum context length is {max_model_len} tokens. However, your prompt has "
               f"{prompt_len} tokens, which leaves no room for output.")
    else:
        msg = (f"This model's maximum context length is {max_model_len} tokens. However, you requested "
               f"{prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} for the completion).")
    return APIError(400, msg, code="context_length_exceeded", param="messages")


def resolve_sampling(*, prompt_len: int, max_model_len: int, vocab_size: int, max_tokens: int | None = None,
                     temperature: float | None = None, top_p: float | None = None, top_k: int | None = None,
                     seed: int | None = None, stop: list[str] | tuple[str, ...] = (), ignore_eos: bool = False,
                     min_tokens: int = 0, presence_penalty: float | None = None,
                     frequency_penalty: float | None = None, repetition_penalty: float | None = None,
                     min_p: float | None = None, logit_bias: dict[int, float] | None = None,
                     stop_token_ids: list[int] | tuple[int, ...] = (), logprobs: int | None = None,
                     json_schema: str = "", prompt_logprobs: int | None = None) -> SamplingParams:
    if prompt_len < 1:
        raise bad_request("the prompt is empty", param="prompt")
    if prompt_len >= max_model_len:
        raise context_error(prompt_len, max_model_len)
    if max_tokens is None:
        max_tokens = max_model_len - prompt_len
    elif max_tokens < 1:
        raise bad_request(f"max_tokens must be at least 1, got {max_tokens}", param="max_tokens")
    elif prompt_len + max_tokens > max_model_len:
        raise context_error(prompt_len, max_model_len, max_tokens)
    temperature = 1.0 if temperature is None else float(temperature)
    if not math.isfinite(temperature) or temperature < 0:
        raise bad_request(f"temperature must be a finite number >= 0, got {temperature}", param="temperature")
    top_p = 1.0 if top_p is None else float(top_p)
    if not (0.0 < top_p <= 1.0):
        raise bad_request(f"top_p must be in (0, 1], got {top_p}", param="top_p")
    top_k = 0 if top_k in (None, -1) else top_k
    if top_k < 0:
        raise bad_request(f"top_k must be -1, 0 (off) or positive, got {top_k}", param="top_k")
    if not 0 <= min_tokens <= max_tokens:
        raise bad_request(f"min_tokens must be between 0 and max_tokens ({max_tokens})", param="min_tokens")
    seed = secrets.randbits(63) if seed is None else seed & _U63
    for name, value in (("presence_penalty", presence_penalty), ("frequency_penalty", frequency_penalty)):
        if value is not None and not -2.0 <= value <= 2.0:
            raise bad_request(f"{name} must be between -2 and 2, got {value}", param=name)
    repetition_penalty = 1.0 if repetition_penalty is None else float(repetition_penalty)
    if not 0.0 < repetition_penalty <= MAX_REPETITION_PENALTY:
        raise bad_request(f"repetition_penalty must be in (0, {MAX_REPETITION_PENALTY:g}], got {repetition_penalty}",
                          param="repetition_penalty")
    min_p = 0.0 if min_p is None else float(min_p)
    if not 0.0 <= min_p <= 1.0:
        raise bad_request(f"min_p must be in [0, 1], got {min_p}", param="min_p")
    bias = sorted((logit_bias or {}).items())
    if len(bias) > MAX_LOGIT_BIAS:
        raise bad_request(f"logit_bias may name at most {MAX_LOGIT_BIAS} tokens", param="logit_bias")
    for token, value in bias:
        if not 0 <= token < vocab_size:
            raise bad_request(f"logit_bias names token {token}, outside the vocabulary [0, {vocab_size})",
                              param="logit_bias")
        if not -100.0 <= value <= 100.0:
            raise bad_request(f"logit_bias values must be between -100 and 100, got {value} for token {token}",
                              param="logit_bias")
    if len(stop_token_ids) > MAX_STOP_TOKEN_IDS or any(not 0 <= t < vocab_size for t in stop_token_ids):
        raise bad_request(f"stop_token_ids takes at most {MAX_STOP_TOKEN_IDS} ids in [0, {vocab_size})",
                          param="stop_token_ids")
    return SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                          stop=tuple(stop), ignore_eos=ignore_eos, min_tokens=min_tokens,
                          presence_penalty=float(presence_penalty or 0.0),
                          frequency_penalty=float(frequency_penalty or 0.0), repetition_penalty=repetition_penalty,
                          min_p=min_p, logit_bias=tuple((t, float(b)) for t, b in bias),
                          stop_token_ids=tuple(stop_token_ids), logprobs=logprobs, json_schema=json_schema,
                          prompt_logprobs=prompt_logprobs)
