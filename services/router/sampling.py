"""Turn API sampling fields into engine `SamplingParams`, for HTTP and gRPC alike: what
needs the prompt or the vocabulary is checked here, every range by SamplingParams."""
from __future__ import annotations

import secrets

from services.engine.core.sampling import SEED_MASK, InvalidSampling, SamplingParams
from services.router.protocol import ContextLengthError, bad_request


def context_error(prompt_len: int, max_model_len: int, max_tokens: int | None = None,
                  param: str = "messages") -> ContextLengthError:
    """OpenAI's error for a request past the context, naming the prompt's field (chat:
    `messages`, as OpenAI does; completions: `prompt`, or `prompt.3` in a list)."""
    if max_tokens is None:
        msg = (f"This model's maximum context length is {max_model_len} tokens. However, your prompt has "
               f"{prompt_len} tokens, which leaves no room for output.")
    else:
        msg = (f"This model's maximum context length is {max_model_len} tokens. However, you requested "
               f"{prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} for the completion).")
    return ContextLengthError(msg, param, prompt_len, max_tokens, max_model_len)


def resolve_sampling(*, prompt_len: int, max_model_len: int, vocab_size: int, max_tokens: int | None = None,
                     temperature: float | None = None, top_p: float | None = None, top_k: int | None = None,
                     seed: int | None = None, stop: list[str] | tuple[str, ...] = (), ignore_eos: bool = False,
                     min_tokens: int = 0, presence_penalty: float | None = None,
                     frequency_penalty: float | None = None, repetition_penalty: float | None = None,
                     min_p: float | None = None, logit_bias: dict[int, float] | None = None,
                     stop_token_ids: list[int] | tuple[int, ...] = (), logprobs: int | None = None,
                     structure: tuple[str, str] | None = None, prompt_logprobs: int | None = None,
                     allowed_token_ids: list[int] | None = None,
                     bad_words: list[list[int]] | tuple[tuple[int, ...], ...] = (), cache_salt: str = "",
                     prompt_param: str = "messages") -> SamplingParams:
    if prompt_len < 1:
        raise bad_request("the prompt is empty", param="prompt")
    if prompt_len >= max_model_len:
        raise context_error(prompt_len, max_model_len, param=prompt_param)
    if max_tokens is None:
        max_tokens = max_model_len - prompt_len
    elif max_tokens < 1:
        raise bad_request(f"max_tokens must be at least 1, got {max_tokens}", param="max_tokens")
    elif prompt_len + max_tokens > max_model_len:
        raise context_error(prompt_len, max_model_len, max_tokens, param=prompt_param)
    # Ranges are SamplingParams' to check (the workers check them again); what needs the
    # vocabulary is checked here.
    bias = sorted((logit_bias or {}).items())
    outside = next((t for t, _ in bias if not 0 <= t < vocab_size), None)
    if outside is not None:
        raise bad_request(f"logit_bias names token {outside}, outside the vocabulary [0, {vocab_size})",
                          param="logit_bias")
    if any(not 0 <= t < vocab_size for t in stop_token_ids):
        raise bad_request(f"stop_token_ids must be in [0, {vocab_size})", param="stop_token_ids")
    if allowed_token_ids is not None:
        if not allowed_token_ids:
            raise bad_request("allowed_token_ids must not be empty", param="allowed_token_ids")
        if any(not 0 <= t < vocab_size for t in allowed_token_ids):
            raise bad_request(f"allowed_token_ids must be in [0, {vocab_size})", param="allowed_token_ids")
    if any(not 0 <= t < vocab_size for word in bad_words for t in word):
        raise bad_request(f"bad_words token ids must be in [0, {vocab_size})", param="bad_words")
    try:
        return SamplingParams(
            max_tokens=max_tokens, temperature=1.0 if temperature is None else float(temperature),
            top_p=1.0 if top_p is None else float(top_p), top_k=0 if top_k in (None, -1) else top_k,
            seed=secrets.randbits(63) if seed is None else seed & SEED_MASK, stop=tuple(stop), ignore_eos=ignore_eos,
            min_tokens=min_tokens, presence_penalty=float(presence_penalty or 0.0),
            frequency_penalty=float(frequency_penalty or 0.0),
            repetition_penalty=1.0 if repetition_penalty is None else float(repetition_penalty),
            min_p=0.0 if min_p is None else float(min_p), logit_bias=tuple((t, float(b)) for t, b in bias),
            stop_token_ids=tuple(stop_token_ids), logprobs=logprobs,
            **({structure[0]: structure[1]} if structure else {}),
            prompt_logprobs=prompt_logprobs, allowed_token_ids=tuple(sorted(set(allowed_token_ids or ()))),
            bad_words=tuple(tuple(w) for w in bad_words), cache_salt=cache_salt)
    except InvalidSampling as exc:
        raise bad_request(str(exc), param=exc.param) from None
