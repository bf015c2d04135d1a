"""Tool calling in the chat API, as OpenAI defines it and vLLM serves it.

The tools go to the model through its chat template (Hugging Face's `tools` argument);
a template that never reads them cannot show them to the model, so such a request is
refused instead of answered as if no tools were given. What the model writes back:
  - a named `tool_choice`: the output is that function's arguments, constrained by its
    `parameters` schema (structured output on the decode worker);
  - "required": a JSON array of {"name", "arguments"} calls, constrained likewise;
  - "auto": free text, in which calls are found the way Hermes-style templates ask for
    them: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.
With a `response_format` as well (an agent with tools and a structured final answer),
a named or required choice is constrained by its calls, as above, and the format is
checked but applies to no text; with "auto" the output is either the format or calls
(structured.py `with_calls`), as OpenAI has it, where vLLM lets the format alone
constrain it: an agent can call its tools and still answer in its format. A regex,
grammar or choice beside "auto" constrains the whole output: no call can be written.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from services.engine.text.tokenizer import held_tail
from services.router.protocol import ChatCompletionRequest, NamedToolChoice, bad_request, unsupported

_HERMES_CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.DOTALL)


@dataclass(frozen=True)
class ToolPlan:
    tools: list[dict]                   # as the chat template receives them
    mode: str                           # "named", "required" or "auto"
    schema: str = ""                    # what constrains the output ("" for auto)
    name: str = ""                      # the forced function, when named

    @property
    def streams_arguments(self) -> bool:
        """Named calls stream their arguments as they come; the others are known at the end."""
        return self.mode == "named"


def plan_tools(req: ChatCompletionRequest, template_supports_tools: bool) -> ToolPlan | None:
    choice = req.tool_choice
    if not req.tools:
        if choice not in (None, "none"):
            raise bad_request("tool_choice needs tools", param="tool_choice")
        return None
    if choice == "none":
        return None
    if not template_supports_tools:
        raise unsupported("tools", "this model's chat template does not support tools; start the router with "
                                   "--chat-template FILE naming a template that renders them")
    tools = [t.model_dump(exclude_none=True) for t in req.tools]
    functions = {t.function.name: t.function for t in req.tools}
    if isinstance(choice, NamedToolChoice):
        fn = functions.get(choice.function.name)
        if fn is None:
            raise bad_request(f"tool_choice names {choice.function.name!r}, which is not among the tools",
                              param="tool_choice")
        return ToolPlan(tools, "named", json.dumps(fn.parameters), fn.name)
    if choice == "required":
        calls = [{"type": "object", "properties": {"name": {"const": name}, "arguments": fn.parameters},
                  "required": ["name", "arguments"]} for name, fn in functions.items()]
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        if req.parallel_tool_calls is False:
            schema["maxItems"] = 1
        return ToolPlan(tools, "required", json.dumps(schema))
    return ToolPlan(tools, "auto")


def new_call(name: str, arguments: str) -> dict:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


def parse_calls(plan: ToolPlan, text: str) -> tuple[str | None, list[dict]]:
    """(content, tool calls) of a whole output."""
    if plan.mode == "named":
        return None, [new_call(plan.name, text)]
    if plan.mode == "required":
        calls = _whole_items(text)
        if not calls:                           # cut short by max_tokens inside the first call
            return text, []
        return None, [new_call(c["name"], json.dumps(c["arguments"], ensure_ascii=False)) for c in calls]
    calls = []

    def take(match: re.Match) -> str:
        call = _hermes_call(match.group(1))
        if call is None:                        # not a call after all: it stays text
            return match.group(0)
        calls.append(call)
        return ""
    content = _HERMES_CALL.sub(take, text)
    if not calls:
        return text, []
    return content.strip() or None, calls


def split_output(plan: ToolPlan | None, text: str) -> tuple[str, list[dict]]:
    """(text, calls) of a whole output, for the APIs whose answers are items (Responses,
    Messages): a forced choice's output is its calls only, and a forced output cut short
    before its first call was whole is no text either (it is the tools' own syntax)."""
    if plan is None:
        return text, []
    content, calls = parse_calls(plan, text)
    return ((content or "") if plan.mode == "auto" else ""), calls


def _whole_items(text: str) -> list:
    """The items of a JSON array that are whole: all of them, or, when `max_tokens` cut
    the array short, those before the cut (the calls made before it are calls)."""
    decoder, items = json.JSONDecoder(), []
    at = text.find("[") + 1
    while at > 0:
        while at < len(text) and text[at] in " \t\r\n,":
            at += 1
        try:
            item, at = decoder.raw_decode(text, at)
        except json.JSONDecodeError:            # the cut item, or the closing bracket
            break
        items.append(item)
    return items


def _hermes_call(body: str) -> dict | None:
    """A call from the JSON inside <tool_call> tags, or None if it is not one."""
    try:
        call = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    arguments = call.get("arguments", {})
    return new_call(call["name"], arguments if isinstance(arguments, str) else json.dumps(arguments,
                                                                                         ensure_ascii=False))


OPEN, CLOSE = "<tool_call>", "</tool_call>"


class CallStream:
    """Splits an `auto` choice's streamed text into content, which goes out as it comes,
    and Hermes-style calls, each sent whole once its closing tag arrives. Text that may
    be the start of a tag is held until it is known not to be."""

    def __init__(self) -> None:
        self._held = ""
        self._in_call = False
        self.calls = 0

    def feed(self, text: str) -> tuple[str, list[dict]]:
        """(content to send, calls completed) after `text`."""
        pieces = self.pieces(text)
        return "".join(p for p in pieces if isinstance(p, str)), [p for p in pieces if isinstance(p, dict)]

    def pieces(self, text: str) -> list[str | dict]:
        """What `text` completes, in order: content (str) and calls (dict)."""
        self._held += text
        content: list[str | dict] = []
        calls = 0
        while True:
            if self._in_call:
                end = self._held.find(CLOSE)
                if end < 0:
                    break
                call = _hermes_call(self._held[:end].strip())
                if call is not None:
                    content.append(call)
                    calls += 1
                else:                           # not a call after all: it was text
                    content.append(OPEN + self._held[:end + len(CLOSE)])
                self._held = self._held[end + len(CLOSE):]
                self._in_call = False
                continue
            start = self._held.find(OPEN)
            if start >= 0:
                content.append(self._held[:start])
                self._held = self._held[start + len(OPEN):]
                self._in_call = True
                continue
            keep = held_tail(self._held, (OPEN,))
            content.append(self._held[:len(self._held) - keep])
            self._held = self._held[len(self._held) - keep:]
            break
        self.calls += calls
        return [p for p in content if p != ""]

    def close(self) -> str:
        """What is left at the end: text, or an unclosed call given back as text."""
        rest = (OPEN if self._in_call else "") + self._held
        self._held, self._in_call = "", False
        return rest
