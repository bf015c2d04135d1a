"""Sampling parameters as the engine sees them. The router resolves and checks them for
clients; the engine checks them again, since a worker may be called by anyone who
reaches its port, and one bad value must fail its own request, never a batch."""
from __future__ import annotations

from dataclasses import dataclass, field, replace


class InvalidSampling(ValueError):
    """A sampling parameter out of its range, named (`param`) for the API's error."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def no_token_left(params: SamplingParams, position: int) -> InvalidSampling:
    """The caller's error for a sequence whose constraints left no token at output
    position `position`: named by the parameters that constrain it, allowed_token_ids
    first (the usual cause: ids a grammar or min_tokens also rules out)."""
    named = [name for name, on in (("allowed_token_ids", params.allowed_token_ids), ("bad_words", params.bad_words),
                                   ("min_tokens", position < params.min_tokens),
                                   ("structured outputs", params.structure)) if on]
    return InvalidSampling(named[0] if named else "allowed_token_ids",
                           f"no token satisfies {' and '.join(named) or 'the constraints'} together at output token "
                           f"{position}: every token is ruled out")


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0                      # 0 = off
    seed: int = 0                       # the router assigns one when the client did not
    ignore_eos: bool = False
    min_tokens: int = 0
    stop: tuple[str, ...] = field(default_factory=tuple)
    presence_penalty: float = 0.0       # OpenAI's: subtracted once from every token already output
    frequency_penalty: float = 0.0      # OpenAI's: subtracted per time a token was output
    repetition_penalty: float = 1.0     # CTRL's, as transformers and vLLM: over prompt and output
    min_p: float = 0.0                  # drop tokens below min_p x the top token's probability
    logit_bias: tuple[tuple[int, float], ...] = ()     # (token id, added to its logit)
    stop_token_ids: tuple[int, ...] = ()                # end the output like EOS (kept in it)
    logprobs: int | None = None         # None: none; n: the sampled token's and the n likeliest
    prompt_logprobs: int | None = None  # the same for each prompt token after the first
    # Structured output (structured.py), one kind at most: the output is constrained to
    # this JSON schema, regular expression, EBNF grammar or xgrammar structural tag.
    json_schema: str = ""
    regex: str = ""
    grammar: str = ""
    structural_tag: str = ""
    # Where the constraint starts: after the output has made these tokens in a row (a
    # reasoning model's end of thinking, as the router's --reasoning-parser sends it);
    # empty: from the first token.
    structure_after: tuple[int, ...] = ()
    # With structure_after: the tokens that open the thinking (its start tag), where the
    # prompt has neither opened nor closed it. An output that begins with the first of
    # them, where the grammar refuses that token, thinks first; any other is held from
    # its first token. Empty: the prompt opened the block (or no structure_after).
    structure_opens: tuple[int, ...] = ()
    allowed_token_ids: tuple[int, ...] = ()             # only these may be sampled (empty: any)
    # Token sequences the output may not contain (vLLM's bad_words, tokenized by the
    # router): a sequence's last token is banned wherever the output ends in the rest.
    bad_words: tuple[tuple[int, ...], ...] = ()
    # Not sampling, but the request's as these are: its prompt's prefix-cache salt
    # (prefix_cache.py), the router's for the tenant and the client's cache_salt.
    cache_salt: str = ""

    @property
    def structure(self) -> tuple[str, str] | None:
        """(kind, text) of the output's constraint, or None for free text."""
        for kind in STRUCTURE_KINDS:
            if getattr(self, kind):
                return kind, getattr(self, kind)
        return None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    @property
    def reads_history(self) -> bool:
        """Whether choosing a token needs the tokens before it (penalties, bad words)."""
        return self.penalized or bool(self.bad_words)

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise InvalidSampling("max_tokens", "max_tokens must be at least 1")
        if not 0 <= self.temperature <= MAX_TEMPERATURE:          # NaN fails this too
            raise InvalidSampling("temperature", f"temperature must be in [0, {MAX_TEMPERATURE:g}], "
                                  f"not {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:                  # NaN fails this too
            raise InvalidSampling("top_p", f"top_p must be in (0, 1], not {self.top_p}")
        if not 0 <= self.top_k <= MAX_TOP_K:
            raise InvalidSampling("top_k", f"top_k must be -1 or 0 (off) or at most {MAX_TOP_K}, not {self.top_k}")
        if self.min_tokens < 0 or self.min_tokens > self.max_tokens:
            raise InvalidSampling("min_tokens", f"min_tokens must be between 0 and max_tokens ({self.max_tokens})")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise InvalidSampling(name, f"{name} must be in [-2, 2], not {getattr(self, name)}")
        if not 0.0 < self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise InvalidSampling("repetition_penalty", f"repetition_penalty must be in "
                                  f"(0, {MAX_REPETITION_PENALTY:g}], not {self.repetition_penalty}")
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidSampling("min_p", f"min_p must be in [0, 1], not {self.min_p}")
        if len(self.stop) > MAX_STOP:
            raise InvalidSampling("stop", f"at most {MAX_STOP} stop sequences, not {len(self.stop)}")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise InvalidSampling("logit_bias", f"logit_bias may name at most {MAX_LOGIT_BIAS} tokens")
        for token, bias in self.logit_bias:
            if token < 0 or not -100.0 <= bias <= 100.0:
                raise InvalidSampling("logit_bias", f"logit_bias of token {token} must be in [-100, 100], not {bias}")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS or any(t < 0 for t in self.stop_token_ids):
            raise InvalidSampling("stop_token_ids", f"stop_token_ids takes at most {MAX_STOP_TOKEN_IDS} token ids >= 0")
        if len(self.allowed_token_ids) > MAX_ALLOWED_TOKEN_IDS or any(t < 0 for t in self.allowed_token_ids):
            raise InvalidSampling("allowed_token_ids", f"allowed_token_ids takes at most {MAX_ALLOWED_TOKEN_IDS} "
                                  "token ids >= 0")
        if len(self.bad_words) > MAX_BAD_WORDS or any(not w or any(t < 0 for t in w) for w in self.bad_words):
            raise InvalidSampling("bad_words", f"bad_words takes at most {MAX_BAD_WORDS} non-empty token sequences")
        if len(self.cache_salt) > MAX_CACHE_SALT:
            raise InvalidSampling("cache_salt", f"cache_salt takes at most {MAX_CACHE_SALT} characters")
        for name in ("structure_after", "structure_opens"):
            ids = getattr(self, name)
            if len(ids) > MAX_STRUCTURE_AFTER or any(t < 0 for t in ids):
                raise InvalidSampling(name, f"{name} takes at most {MAX_STRUCTURE_AFTER} token ids >= 0")
        if self.structure_opens and not self.structure_after:
            raise InvalidSampling("structure_opens", "structure_opens needs structure_after: where the thinking ends")
        if sum(bool(getattr(self, kind)) for kind in STRUCTURE_KINDS) > 1:
            raise InvalidSampling("structured_outputs", "at most one kind of structured output: "
                                  + ", ".join(STRUCTURE_KINDS))
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_TOP_LOGPROBS:
                raise InvalidSampling(name, f"{name} must be between 0 and {MAX_TOP_LOGPROBS}, not {value}")

    def for_choice(self, index: int) -> "SamplingParams":
        """Choice `index` of a request asking for several (n): its own seed, the request's
        plus the index (vLLM's rule), so choices differ and a seeded request repeats."""
        return self if index == 0 else replace(self, seed=(self.seed + index) & SEED_MASK)

    def token_ids_named(self) -> list[int]:
        """Every token id these parameters name, for a vocabulary check."""
        return ([t for t, _ in self.logit_bias] + list(self.stop_token_ids) + list(self.allowed_token_ids)
                + [t for word in self.bad_words for t in word] + list(self.structure_after)
                + list(self.structure_opens))


@dataclass(frozen=True)
class TokenLogprob:
    """A sampled token's log probability, and the likeliest tokens' at its place."""
    token_id: int
    logprob: float
    top_ids: list[int] = field(default_factory=list)
    top_logprobs: list[float] = field(default_factory=list)


MAX_TOP_LOGPROBS = 20                   # OpenAI's limit
MAX_CACHE_SALT = 256
STRUCTURE_KINDS = ("json_schema", "regex", "grammar", "structural_tag")
MAX_CHOICES = 16                        # n: choices of one request
SEED_MASK = (1 << 63) - 1
MAX_LOGIT_BIAS = 1024
MAX_STOP_TOKEN_IDS = 64
MAX_ALLOWED_TOKEN_IDS = 1 << 20         # more than any vocabulary: the body limit is the real bound
MAX_BAD_WORDS = 512                     # sequences, each looked for after every token
MAX_STRUCTURE_AFTER = 16                # a tag's tokens (reasoning models make </think> one)
MAX_STOP = 16                           # stop strings: each is looked for after every token
# What the wire (generate.proto) can carry: top_k is an int32, temperature a float32.
MAX_TOP_K = 2**31 - 1
MAX_TEMPERATURE = 3.4028234663852886e38
MAX_REPETITION_PENALTY = 10.0
