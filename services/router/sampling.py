"""Turn API sampling fields into engine `SamplingParams`, checking every range once,
for HTTP and gRPC alike."""
from __future__ import annotations

import math
import secrets

from services.engine.sampling import SamplingParams
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


def resolve_sampling(*, prompt_len: int, max_model_len: int, max_tokens: int | None = None,
                     temperature: float | None = None, top_p: float | None = None, top_k: int | None = None,
                     seed: int | None = None, stop: list[str] | tuple[str, ...] = (), ignore_eos: bool = False,
                     min_tokens: int = 0) -> SamplingParams:
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
    return SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                          stop=tuple(stop), ignore_eos=ignore_eos, min_tokens=min_tokens)
