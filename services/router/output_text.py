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
        self._has_stops = bool(stops)
        self._generated = 0

    def feed(self, token_ids: list[int], finish: str | None) -> str:
        """The text of a delta's tokens; `finish` is the delta's finish reason."""
        if self._ended:
            return ""
        made, self._generated = self._generated, self._generated + len(token_ids)
        if finish == "stop" and token_ids and not self._include:
            text, hit = self._read(self._detok.fork(), copy.copy(self._stops), token_ids, made)
            if hit:
                self._ended = True
                return text
            token_ids = token_ids[:-1]          # ended by a stop token: its text stays out
        text, hit = self._read(self._detok, self._stops, token_ids, made)
        self._ended = hit or finish is not None
        if hit or finish is None:
            return text
        return text + self._stops.feed(self._detok.flush())[0] + self._stops.flush()

    def _read(self, detok: IncrementalDetokenizer, stops: StopMatcher, token_ids: list[int],
              made: int) -> tuple[str, bool]:
        """The text of `token_ids`, after `made` tokens, and whether a stop string ended
        it. Several tokens (a verify step's, or outputs joined on their way) are read a
        token at a time where a stop string could end them, each armed once min_tokens
        tokens are out, as the cluster's own matcher reads them (output.py)."""
        if len(token_ids) <= 1 or not self._has_stops:
            return stops.feed(detok.push(token_ids), made + len(token_ids) >= self._min_tokens)
        parts = []
        for token in token_ids:
            made += 1
            text, hit = stops.feed(detok.push([token]), made >= self._min_tokens)
            parts.append(text)
            if hit:
                return "".join(parts), True
        return "".join(parts), False
