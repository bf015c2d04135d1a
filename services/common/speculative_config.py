"""`--speculative-config`: what a decode worker drafts with (services/engine/core/
speculation.py), parsed and checked once, where the settings are."""
from __future__ import annotations

import json
from dataclasses import dataclass, fields

METHODS = ("ngram", "suffix", "draft")
# Each drafted position is a series of vllm:spec_decode_num_accepted_tokens_per_pos.
MOST_TOKENS = 32
# vLLM's names for the same methods
ALIASES = {"draft_model": "draft"}
QUANTIZATIONS = ("none", "int8")


@dataclass(frozen=True)
class SpeculativeConfig:
    """`--speculative-config`, a JSON object as vLLM's flag takes it."""
    method: str = "ngram"
    # most tokens drafted for a sequence per step; 0: the method's default, as vLLM's
    # (suffix: suffix_decoding_max_tree_depth, the others 4)
    num_speculative_tokens: int = 0
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    suffix_decoding_max_tree_depth: int = 24    # longest context matched, tokens
    suffix_decoding_max_cached_requests: int = 1000
    suffix_decoding_min_token_prob: float = 0.1
    suffix_decoding_max_spec_factor: float = 1.0     # at most this many drafted tokens per matched one
    adaptive: bool = True                       # False: draft whatever the proposer finds
    model: str = ""                             # draft: the draft model (a folder or a Hub id), same tokenizer
    quantization: str = "none"                  # draft: int8 for the draft model's matmuls (CPU)

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative method must be one of {', '.join(METHODS)}, not {self.method!r}")
        if self.num_speculative_tokens == 0:
            default = self.suffix_decoding_max_tree_depth if self.method == "suffix" else 4
            object.__setattr__(self, "num_speculative_tokens", min(default, MOST_TOKENS))
        if not 1 <= self.num_speculative_tokens <= MOST_TOKENS:
            raise ValueError(f"num_speculative_tokens must be 1 to {MOST_TOKENS}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("prompt_lookup_min must be at least 1 and at most prompt_lookup_max")
        if self.suffix_decoding_max_tree_depth < 1 or self.suffix_decoding_max_cached_requests < 0:
            raise ValueError("suffix_decoding_max_tree_depth must be at least 1, max_cached_requests 0 or more")
        if not 0.0 <= self.suffix_decoding_min_token_prob <= 1.0:
            raise ValueError("suffix_decoding_min_token_prob must be in [0, 1]")
        if not self.suffix_decoding_max_spec_factor >= 0.0:
            raise ValueError("suffix_decoding_max_spec_factor must be 0 or more")
        if (self.method == "draft") != bool(self.model):
            raise ValueError("the draft method takes a draft model (\"model\"), and only it does")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}")

    @classmethod
    def parse(cls, text: str) -> SpeculativeConfig:
        """The flag's JSON; ValueError naming what is wrong with it."""
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--speculative-config is not JSON: {exc}") from None
        if not isinstance(raw, dict):
            raise ValueError("--speculative-config must be a JSON object")
        known = {f.name: f.type for f in fields(cls)}
        unknown = sorted(set(raw) - set(known))
        if unknown:
            raise ValueError(f"--speculative-config: unknown keys {', '.join(unknown)} (known: {', '.join(known)})")
        for key, value in raw.items():
            want = {"int": int, "float": (int, float), "bool": bool, "str": str}[known[key]]
            if isinstance(value, bool) is not (known[key] == "bool") or not isinstance(value, want):
                raise ValueError(f"--speculative-config: {key} must be a {known[key]}, not {value!r}")
        if raw.get("num_speculative_tokens", 1) == 0:      # 0 is the dataclass's "the method's default"
            raise ValueError(f"num_speculative_tokens must be 1 to {MOST_TOKENS}")
        if "method" not in raw and raw.get("model"):
            raw["method"] = "draft"                     # vLLM infers a draft model from "model"
        raw["method"] = ALIASES.get(raw.get("method"), raw.get("method", "ngram"))
        return cls(**raw)
