"""A reasoning model's thinking apart from its answer (vLLM's --reasoning-parser): the text
between <think> and </think> goes out as the message's `reasoning` (and
`reasoning_content`, the older name DeepSeek's API gave it), what follows as its
`content`.

The block is open at the output's start when the prompt ends with <think> (a template
that ends its generation prompt so, as DeepSeek-R1's and Qwen3's thinking models' do),
or when the output begins with <think>. An output that ends while the block is open
is all reasoning; one that never opens it is all content (a template told not to think
writes an empty block into the prompt itself)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from services.engine.text.tokenizer import held_tail

# vLLM's parser names; each of these models marks its thinking with the same two tags
PARSERS = {"deepseek_r1": ("<think>", "</think>"), "qwen3": ("<think>", "</think>")}


@dataclass(frozen=True)
class Thinking:
    """A reasoning model's tags, and whether the request's prompt left the block open, or
    closed it (a hybrid model's template told not to think writes an empty block)."""
    start: str
    end: str
    open_at_start: bool = False
    closed_in_prompt: bool = False

    @classmethod
    def for_prompt(cls, parser: str, prompt_text: str) -> Thinking:
        start, end = PARSERS[parser]
        tail = prompt_text.rstrip()
        return cls(start, end, tail.endswith(start), tail.endswith(end))

    def split(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning, content) of a whole output; None where there is none."""
        stream = ThinkingStream(self)
        reasoning, content = stream.feed(text, final=True)
        return (reasoning if stream.opened else None), (content or None)


def thought_and_answer(thinking: Thinking | None, text: str) -> tuple[str | None, str]:
    """A whole output's reasoning (None: no block, or no parser) and its answer's text."""
    if thinking is None:
        return None, text
    reasoning, answer = thinking.split(text)
    return reasoning, answer or ""


class ThinkingStream:
    """One choice's streamed text, split as it comes: each `feed` returns the reasoning
    and content it can tell apart so far. What could still be the start of a tag is held
    back until the next text (or the end) says what it is."""

    def __init__(self, thinking: Thinking) -> None:
        self.t = thinking
        self.state = "reasoning" if thinking.open_at_start else "start"
        self.opened = thinking.open_at_start
        self.held = ""

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        self.held += text
        reasoning = content = ""
        while True:
            if self.state == "start":               # leading whitespace, then <think> or the answer
                rest = self.held.lstrip()
                if rest.startswith(self.t.start):
                    self.held, self.state, self.opened = rest[len(self.t.start):], "reasoning", True
                    continue
                if not final and self.t.start.startswith(rest):
                    return reasoning, content       # maybe the tag, not whole yet
                self.state = "content"
            if self.state == "reasoning":
                at = self.held.find(self.t.end)
                if at >= 0:
                    reasoning += self.held[:at]
                    self.held, self.state = self.held[at + len(self.t.end):], "content"
                    continue
                keep = 0 if final else held_tail(self.held, (self.t.end,))
                reasoning += self.held[:len(self.held) - keep]
                self.held = self.held[len(self.held) - keep:]
                return reasoning, content
            content += self.held
            self.held = ""
            return reasoning, content


class ThinkingTokens:
    """How many of a choice's output tokens are its thinking, counted as they come: those
    inside the block, not its tags (usage's `reasoning_tokens`, as vLLM's
    count_reasoning_tokens counts them, except that a block the prompt opened is counted
    too: vLLM counts only after a start tag in the output, 0 for DeepSeek-R1's). Tags
    are matched in the tokens' text (`text_of`), however the output spelled them: one
    token in reasoning models' vocabularies, several in others', not always as the
    tokenizer would split the tag alone. The block opens as `Thinking` says: at the start,
    or where the output begins with the start tag after whitespace, as ThinkingStream
    reads the text; a token that holds part of a tag counts as the tag's."""

    def __init__(self, start: str, end: str, open_at_start: bool, text_of: Callable[[int], str]) -> None:
        self.start, self.end, self.text_of = start, end, text_of
        self.state = "reasoning" if open_at_start else "start"
        self._text = ""                         # before the block: the output so far, after whitespace
        # in the block: the last tokens' texts the end tag may span, and whether each was counted
        self._tail: list[tuple[str, bool]] = []
        self.count = 0

    def feed(self, token_ids: list[int]) -> None:
        for token in token_ids:
            if self.state == "start":
                self._text = (self._text + self.text_of(token)).lstrip()
                if self._text.startswith(self.start):
                    # the token is the tag's, and so is what follows the tag in it ("></")
                    self.state = "reasoning"
                    self._tail = [(self._text[len(self.start):], False)]
                    self._find_end()
                elif not self.start.startswith(self._text):
                    self.state = "answer"
            elif self.state == "reasoning":
                self.count += 1
                self._tail.append((self.text_of(token), True))
                self._find_end()

    def _find_end(self) -> None:
        """Ends the block where its end tag is whole; the tokens it spans were counted as
        they came, and are taken back."""
        tail = self._tail
        while len(tail) > 1 and sum(len(t) for t, _ in tail[1:]) >= len(self.end) + len(tail[-1][0]) - 1:
            tail.pop(0)                         # a tag first whole now ends in the last token
        text = "".join(t for t, _ in tail)
        at = text.find(self.end)
        if at < 0:
            return
        after = len(text) - at
        for piece, counted in reversed(tail):
            if after <= 0:
                break
            after -= len(piece)
            self.count -= counted
        self.state = "answer"
