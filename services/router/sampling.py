"""Turn API sampling fields into engine `SamplingParams`, for HTTP and gRPC alike: what
needs the prompt or the vocabulary is checked here, every range by SamplingParams."""
from __future__ import annotations

import json
import secrets
from collections.abc import Mapping
from pathlib import Path

from services.engine.core.sampling import SEED_MASK, InvalidSampling, SamplingParams
from services.router.protocol import APIError, ContextLengthError, bad_request

# The fields of a generation_config.json a request that leaves them out takes, as vLLM's
# `--generation-config auto` reads them; max_new_tokens is the default max_tokens.
DEFAULT_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                  "frequency_penalty", "max_new_tokens")
GENERATION_CONFIG = "generation_config.json"


def sampling_defaults(model_dir: Path, source: str = "auto",
                      override: Mapping[str, float | int] | None = None) -> dict[str, float | int]:
    """What a request's absent sampling fields take (absent here: OpenAI's own, temperature
    1 and no cut-off). `source`: auto, the model folder's generation_config.json; vllm
    (or none), nothing from a file; else a folder holding one. `override` goes over
    it. A value no request could take is a ValueError naming where it came from."""
    folder = None if source in ("vllm", "none") else Path(model_dir if source == "auto" else source)
    found: dict = {}
    if folder is not None and (folder / GENERATION_CONFIG).is_file():
        try:
            found = json.loads((folder / GENERATION_CONFIG).read_text())
        except ValueError as exc:
            raise ValueError(f"{folder / GENERATION_CONFIG} is not JSON: {exc}") from None
        if not isinstance(found, dict):
            raise ValueError(f"{folder / GENERATION_CONFIG} is not a JSON object")
    where = {k: str(folder / GENERATION_CONFIG) for k in found}
    found = {**found, **(override or {})}
    where.update({k: "--override-generation-config" for k in override or {}})
    defaults: dict[str, float | int] = {}
    for key in DEFAULT_FIELDS:
        value = found.get(key)
        if value is None:
            continue
        name = "max_tokens" if key == "max_new_tokens" else key
        whole = key in ("top_k", "max_new_tokens")
        if isinstance(value, bool) or not isinstance(value, int if whole else (int, float)):
            raise ValueError(f"{where[key]}: {key} must be {'an integer' if whole else 'a number'}, not {value!r}")
        defaults[name] = value
    try:
        resolve_sampling(prompt_len=1, max_model_len=2 ** 31, vocab_size=1, defaults=defaults)
    except APIError as exc:
        key, message = exc.param, exc.message
        if key == "max_tokens":
            key, message = "max_new_tokens", message.replace("max_tokens", "max_new_tokens")
        raise ValueError(f"{where.get(key, 'the sampling defaults')}: {message}") from None
    return defaults


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
                     prompt_param: str = "messages", defaults: Mapping[str, float | int] | None = None,
                     structure_start: tuple[tuple[int, ...], tuple[int, ...]] = ((), ())) -> SamplingParams:
    """The request's SamplingParams; a field it leaves out (None) takes `defaults`'
    value (sampling_defaults), else OpenAI's."""
    defaults = defaults or {}
    if defaults:
        temperature = defaults.get("temperature") if temperature is None else temperature
        top_p = defaults.get("top_p") if top_p is None else top_p
        top_k = defaults.get("top_k") if top_k is None else top_k
        min_p = defaults.get("min_p") if min_p is None else min_p
        repetition_penalty = defaults.get("repetition_penalty") if repetition_penalty is None else repetition_penalty
        presence_penalty = defaults.get("presence_penalty") if presence_penalty is None else presence_penalty
        frequency_penalty = defaults.get("frequency_penalty") if frequency_penalty is None else frequency_penalty
    if prompt_len < 1:
        raise bad_request("the prompt is empty", param="prompt")
    if prompt_len >= max_model_len:
        raise context_error(prompt_len, max_model_len, param=prompt_param)
    if max_tokens is None:
        max_tokens = min(max_model_len - prompt_len, defaults.get("max_tokens", max_model_len))
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
    if seed is not None and not -(1 << 63) <= seed < 1 << 64:    # past 64 bits two seeds would be one
        raise bad_request("seed must be a 64-bit integer, signed or not", param="seed")
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
            bad_words=tuple(tuple(w) for w in bad_words), cache_salt=cache_salt,
            structure_after=structure_start[0], structure_opens=structure_start[1])
    except InvalidSampling as exc:
        raise bad_request(str(exc), param=exc.param) from None
