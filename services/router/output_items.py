"""One streamed answer as output items, for the APIs that stream items rather than chat
deltas (OpenAI's Responses, Anthropic's Messages): a reasoning model's thinking
(--reasoning-parser) goes first, to a reasoning item of its own; text goes to one text
item, opened when the first text comes; each tool call is an item of its own. A named or
"required" call's arguments stream as they come, as do those of an "auto" call a grammar
holds; any other "auto" call is known once its closing tag arrives (tools.py). Each API
writes the steps below as its events."""
from __future__ import annotations

from dataclasses import dataclass
from typing import AsyncIterator

from services.router.reasoning import Thinking, ThinkingStream
from services.router.tools import ToolPlan, new_call


@dataclass(frozen=True)
class Step:
    """One thing that happened to the output: `kind` is one of
      open_text                 the text item `index` begins
      text      (delta)         more of its text
      close_text (text)         it ends, with all its text
      open_call (call)          call item `index` begins; `call` as new_call makes it
      arguments (delta)         more of its arguments
      close_call (call, text)   it ends, with all its arguments
      open_reasoning            the reasoning item `index` begins
      reasoning (delta)         more of its text
      close_reasoning (text)    it ends, with all its text
      begin                     the first token came (steps_of's `begin`; no item)"""
    kind: str
    index: int
    delta: str = ""
    call: dict | None = None


class ItemStream:
    """Splits one choice's streamed text into output items. With `empty_text`, an answer
    with no text and no call still has one (empty) text item, as the Responses API has.
    With `one_text`, all the text is one item, wherever the calls fall (Responses);
    without, a call ends the text item open and text after it begins another, so items
    never overlap (Messages' content blocks). A forced choice's output is its calls
    only: "required" calls cut short before the first began leave no text (their syntax)."""

    def __init__(self, tools: ToolPlan | None, empty_text: bool = False, one_text: bool = True,
                 thinking: Thinking | None = None) -> None:
        self.tools = tools
        self._thinking = ThinkingStream(thinking) if thinking is not None else None
        self._reasoning_index: int | None = None
        self.reasoning = ""
        self.empty_text = empty_text
        self.one_text = one_text
        self._items = 0
        self._text_index: int | None = None
        self.text = ""
        # "auto" and "required": text and calls, whole or in parts (ToolPlan.stream)
        self._calls = tools.stream() if tools is not None and not tools.streams_arguments else None
        self._named: tuple[int, dict] | None = None     # (output index, call) of a named call
        self._held_calls: dict[int, int] = {}   # a call whose parts stream (tool_syntax.CallPart): its output index
        self._arguments = ""

    def _next_index(self) -> int:
        self._items += 1
        return self._items - 1

    def feed(self, text: str, final: bool = False) -> list[Step]:
        if self._thinking is None:
            return self._answer(text)
        reasoning, text = self._thinking.feed(text, final)
        steps = []
        if reasoning:
            if self._reasoning_index is None:
                self._reasoning_index = self._next_index()
                steps.append(Step("open_reasoning", self._reasoning_index))
            self.reasoning += reasoning
            steps.append(Step("reasoning", self._reasoning_index, reasoning))
        if (text or final) and self._reasoning_index is not None:
            steps.append(Step("close_reasoning", self._reasoning_index, self.reasoning))
            self._thinking = None               # the rest is the answer
        return steps + self._answer(text)

    def _answer(self, text: str) -> list[Step]:
        tools = self.tools
        if tools is None:
            return self._say(text)
        if tools.streams_arguments:
            return self._named_arguments(text)
        return self._pieces(self._calls.pieces(text))

    def _pieces(self, pieces: list) -> list[Step]:
        """The steps of a calls stream's text, whole calls and calls' parts, in order. A
        "required" output's only text is one cut before its first call: its syntax, no
        text."""
        steps = []
        for piece in pieces:
            if isinstance(piece, str):
                steps += self._say(piece) if self.tools.mode == "auto" else []
            elif isinstance(piece, dict):
                steps += self._whole_call(piece)
            elif piece.kind == "open":
                index, opened = self._open_call(piece.call)
                self._held_calls[piece.index] = index
                steps += opened
            else:
                index = self._held_calls[piece.index]
                steps.append(Step("arguments", index, piece.text, piece.call) if piece.kind == "arguments" else
                             Step("close_call", index, piece.call["function"]["arguments"], piece.call))
        return steps

    def close(self) -> list[Step]:
        tools, steps = self.tools, (self.feed("", final=True) if self._thinking is not None else [])
        if self._calls is not None:
            steps += self._pieces(self._calls.close())
        elif self._named is not None:
            index, call = self._named
            steps.append(Step("close_call", index, self._arguments, call))
        if self.empty_text and self._text_index is None and self._items == (self._reasoning_index is not None):
            steps += self._open_text()
        if self._text_index is not None:
            steps.append(Step("close_text", self._text_index, self.text))
        return steps

    def _open_text(self) -> list[Step]:
        self._text_index = self._next_index()
        return [Step("open_text", self._text_index)]

    def _open_call(self, call: dict) -> tuple[int, list[Step]]:
        """(the call's index, the steps that begin it)"""
        steps = []
        if not self.one_text and self._text_index is not None:
            steps.append(Step("close_text", self._text_index, self.text))
            self._text_index, self.text = None, ""
        index = self._next_index()
        return index, steps + [Step("open_call", index, call=call)]

    def _say(self, text: str) -> list[Step]:
        if not text:
            return []
        steps = self._open_text() if self._text_index is None else []
        self.text += text
        return steps + [Step("text", self._text_index, text)]

    def _named_arguments(self, text: str) -> list[Step]:
        steps = []
        if self._named is None:
            call = new_call(self.tools.name, "")
            index, steps = self._open_call(call)
            self._named = index, call
        if text:
            self._arguments += text
            steps.append(Step("arguments", self._named[0], text, self._named[1]))
        return steps

    def _whole_call(self, call: dict) -> list[Step]:
        index, steps = self._open_call(call)
        arguments = call["function"]["arguments"]
        return steps + [Step("arguments", index, arguments, call), Step("close_call", index, arguments, call)]


async def steps_of(deltas: AsyncIterator, items: ItemStream, begin: bool = False) -> AsyncIterator[Step | None]:
    """The steps of one choice's streamed deltas (RunningRequest.deltas), through `items`;
    None where the stream sends a keep-alive; with `begin`, a "begin" step as the first
    token comes, whether or not it makes a step of its own (a call's name not yet whole)."""
    async for d in deltas:
        if d is None:
            yield None
            continue
        if begin:
            begin = False
            yield Step("begin", -1)
        for step in items.feed(d.text):
            yield step
        if d.finish_reason:
            for step in items.close():
                yield step


def whole_items(items: ItemStream, text: str) -> list[Step]:
    """A whole output's items, as the steps that end them in a stream of it, in output
    order: an answer whole has the items its stream has, in the same order."""
    return sorted((s for s in items.feed(text) + items.close() if s.kind.startswith("close_")),
                  key=lambda s: s.index)
