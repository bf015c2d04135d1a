"""A choice's text under vLLM's detokenization options, where they differ from the
cluster's own text: `skip_special_tokens: false` (special tokens are written out),
`spaces_between_special_tokens` (read by slow tokenizers only, as in transformers and
vLLM), `include_stop_str_in_output`, and a request's `stop_token_ids` (the cluster's text
keeps a stop token's; vLLM's does not).

The cluster still decides where each choice ends (its stop strings, stop tokens, EOS,
max_tokens); this only writes the text of the tokens it delivers again, with the
request's options, as vLLM's detokenizer does: a stop string ends the text after it
(included) or before it, and a choice ended by a stop token (EOS or one of
`stop_token_ids`) leaves that token out of its text unless `include_stop_str_in_output`.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

from services.engine.text.tokenizer import IncrementalDetokenizer, StopMatcher


@dataclass(frozen=True)
class TextOptions:
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    @property
    def rewrites(self) -> bool:
        """Whether the text differs from the cluster's (which skips special tokens and
        leaves stop strings out)."""
        return not self.skip_special_tokens or self.include_stop_str_in_output


class ChoiceText:
    """One choice's text, written again from its tokens."""

    def __init__(self, tokenizer, prompt_ids: list[int], stops: tuple[str, ...], options: TextOptions,
                 min_tokens: int = 0) -> None:
        self._detok = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens=options.skip_special_tokens,
                                             spaces_between_special_tokens=options.spaces_between_special_tokens)
        self._stops = StopMatcher(stops, include_in_output=options.include_stop_str_in_output)
        self._include = options.include_stop_str_in_output
        self._ended = False
        self._min_tokens = min_tokens
        self._generated = 0

    def feed(self, token_ids: list[int], finish: str | None) -> str:
        """The text of a delta's tokens; `finish` is the delta's finish reason."""
        if self._ended:
            return ""
        self._generated += len(token_ids)
        armed = self._generated >= self._min_tokens         # as the cluster's own matcher (output.py)
        if finish == "stop" and token_ids and not self._include:
            detok, stops = self._detok.fork(), copy.copy(self._stops)
            text, hit = stops.feed(detok.push(token_ids), armed)
            if hit:
                self._ended = True
                return text
            token_ids = token_ids[:-1]          # ended by a stop token: its text stays out
        text, hit = self._stops.feed(self._detok.push(token_ids), armed)
        self._ended = hit or finish is not None
        if hit or finish is None:
            return text
        return text + self._stops.feed(self._detok.flush())[0] + self._stops.flush()
