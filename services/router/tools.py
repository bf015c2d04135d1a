"""Tool calling in the chat API, as OpenAI defines it and vLLM serves it.

The tools go to the model through its chat template (Hugging Face's `tools` argument);
a template that never reads them cannot show them to the model, so such a request is
refused instead of answered as if no tools were given. What the model writes back:
  - a named `tool_choice`: the output is that function's arguments, constrained by its
    `parameters` schema (structured output on the decode worker);
  - "required": a JSON array of {"name", "arguments"} calls, constrained likewise, each
    call's arguments streamed as they come (tool_syntax.RequiredCalls);
  - "auto": free text, in which calls are found as the model writes them (the router's
    --tool-call-parser, tool_syntax.py; Hermes-style by default:
    `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`).
With a `response_format` as well (an agent with tools and a structured final answer),
a named or required choice is constrained by its calls, as above, and the format is
checked but applies to no text; with "auto" the output is either the format or calls
(structured.py `with_calls`, with a syntax whose calls a grammar can hold), as OpenAI has
it, where vLLM lets the format alone constrain it: an agent can call its tools and still
answer in its format (with another parser, the format alone constrains it, as in vLLM). A regex,
grammar or choice beside "auto" constrains the whole output: no call can be written.
With neither, "auto" calls are held by a grammar where a tool is `strict` (OpenAI's),
parallel_tool_calls is false, or the router's --tool-strict-level says so (vLLM's): text
is free, and from a call's tag on it is a call of one of the tools (structured.py
`calls_in_text`), streamed in parts as it is written where it is JSON.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from services.router.protocol import ChatCompletionRequest, NamedToolChoice, bad_request, unsupported
from services.router.tool_syntax import SYNTAXES, CallPart, HeldCalls, Hermes, RequiredCalls, new_call
from services.router.tool_values import typed_arguments


@dataclass(frozen=True)
class ToolPlan:
    tools: list[dict]                   # as the chat template receives them
    mode: str                           # "named", "required" or "auto"
    schema: str = ""                    # what constrains the output ("" for auto)
    name: str = ""                      # the forced function, when named
    syntax: object = SYNTAXES["hermes"]     # how "auto" output writes its calls (tool_syntax.py)
    one_call: bool = False              # parallel_tool_calls false: "auto" gives its first call only
    held: bool = False                  # a grammar holds "auto" calls: their arguments stream as they come

    @property
    def grammar_calls(self) -> bool:
        """Whether a grammar can hold "auto" calls as the syntax writes them (its
        grammar_tags: hermes', qwen3_json's, longcat's, qwen3_coder's, glm45's)."""
        return grammar_holds(self.syntax)

    @property
    def json_calls(self) -> bool:
        """Whether "auto" calls are JSON in tags, as hermes writes them, whose parts can
        stream as they come once a grammar holds them (tool_syntax.HeldCalls)."""
        return isinstance(self.syntax, Hermes)

    def grammar_for_calls(self, level: str) -> bool:
        """Whether a grammar is to hold "auto" calls: where a tool asks it (OpenAI's
        `strict`), one call only is asked (the grammar ends the output after it), or
        --tool-strict-level (`level`) is function or parameter."""
        return self.mode == "auto" and (level != "auto" or self.one_call or any(
            t["function"].get("strict") is True for t in self.tools))

    def stream(self) -> "TrimmedContent | RequiredCalls":
        """A stream of an "auto" or "required" output's content and calls (tool_syntax.py):
        whole calls, or, where a grammar holds them, the parts of each as it is written;
        for "auto", the first call only where one is asked (where no grammar ended the
        output after it), and the content without whitespace at its ends. parse_calls
        reads a whole output through it, so an answer streamed and whole has the same
        content and calls."""
        if self.mode == "required":
            return RequiredCalls()
        calls = HeldCalls(self.syntax) if self.held else self.syntax.stream()
        if getattr(self.syntax, "string_values", False):
            calls = TypedValues(calls, self.tools)
        return TrimmedContent(FirstCall(calls) if self.one_call else calls)

    @property
    def streams_arguments(self) -> bool:
        """A named call's output is its arguments, streamed as they come; the other modes'
        calls come through stream()."""
        return self.mode == "named"


class FirstCall:
    """An "auto" stream that passes on its first call and drops the others
    (parallel_tool_calls false; where a grammar holds the calls it ends the output after
    the first anyway): the first whole call, or the parts of the first held one."""

    def __init__(self, calls) -> None:
        self._calls = calls
        self._passed = False

    @property
    def calls(self) -> int:
        return min(self._calls.calls, 1)

    def pieces(self, text: str) -> list:
        return self._first(self._calls.pieces(text))

    def close(self) -> list:
        return self._first(self._calls.close())

    def _first(self, pieces: list) -> list:
        out = []
        for piece in pieces:
            if isinstance(piece, CallPart) and piece.index > 0 or isinstance(piece, dict) and self._passed:
                continue
            self._passed |= isinstance(piece, dict)
            out.append(piece)
        return out


class TypedValues:
    """An "auto" stream of a syntax that writes every value as text: each call's values
    read as its tool's parameters type them (tool_values.py), as vLLM's parsers read them."""

    def __init__(self, calls, tools: list[dict]) -> None:
        self._calls = calls
        self._parameters = {t["function"]["name"]: t["function"].get("parameters") for t in tools}

    @property
    def calls(self) -> int:
        return self._calls.calls

    def pieces(self, text: str) -> list:
        return [self._typed(p) for p in self._calls.pieces(text)]

    def close(self) -> list:
        return [self._typed(p) for p in self._calls.close()]

    def _typed(self, piece):
        if not isinstance(piece, dict):
            return piece
        function = piece["function"]
        arguments = typed_arguments(json.loads(function["arguments"]), self._parameters.get(function["name"]))
        return {**piece, "function": {**function, "arguments": json.dumps(arguments, ensure_ascii=False)}}


class TrimmedContent:
    """An "auto" stream whose content is the text outside its calls without the
    whitespace at its two ends (the newlines around and between calls, above all): its
    leading whitespace is dropped, and whitespace is held until more text follows it."""

    def __init__(self, calls) -> None:
        self._calls = calls
        self._begun = False
        self._held = ""

    @property
    def calls(self) -> int:
        return self._calls.calls

    def pieces(self, text: str) -> list:
        return self._trimmed(self._calls.pieces(text))

    def close(self) -> list:
        return self._trimmed(self._calls.close())       # whitespace still held is the end's

    def _trimmed(self, pieces: list) -> list:
        out = []
        for piece in pieces:
            if not isinstance(piece, str):
                out.append(piece)
                continue
            if not self._begun:
                piece = piece.lstrip()
                self._begun = bool(piece)
            body = piece.rstrip()
            if body:
                out.append(self._held + body)
                self._held = piece[len(body):]
            else:
                self._held += piece
        return out


def plan_tools(req: ChatCompletionRequest, template_supports_tools: bool,
               parser: str | None = "hermes") -> ToolPlan | None:
    """How a request's tools are served; `parser`: how "auto" output writes its calls (the
    router's --tool-call-parser; None: "auto" is not served)."""
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
        defs: dict[str, dict] = {}
        calls = [{"type": "object", "properties": {"name": {"const": name}, "arguments": _hoisted(fn.parameters, name,
                                                                                                   defs)},
                  "required": ["name", "arguments"]} for name, fn in functions.items()]
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls}, **defs}
        if req.parallel_tool_calls is False:
            schema["maxItems"] = 1
        return ToolPlan(tools, "required", json.dumps(schema))
    if parser is None:
        raise unsupported("tool_choice", "tool_choice auto (the default with tools) is off on this server "
                                         "(--no-enable-auto-tool-choice): ask for required, none or a named function")
    return ToolPlan(tools, "auto", syntax=SYNTAXES[parser], one_call=req.parallel_tool_calls is False)


def _hoisted(parameters, tool: str, defs: dict[str, dict]):
    """A tool's parameters nested in the calls' schema, their local definitions (`$defs`,
    `definitions`: Pydantic's) moved to its root, where their `#/$defs/...` references
    resolve from; a name two tools define differently is refused by the tool's name."""
    if not isinstance(parameters, dict):
        return parameters
    out = dict(parameters)
    for key in ("$defs", "definitions"):
        local = out.pop(key, None)
        if not isinstance(local, dict):
            continue
        shared = defs.setdefault(key, {})
        for name, schema in local.items():
            if shared.get(name, schema) != schema:
                raise bad_request(f"tool {tool!r} defines {key}/{name} unlike another tool, which tool_choice "
                                  "required cannot hold in one schema: rename one", param="tools")
            shared[name] = schema
    return out


def grammar_holds(syntax) -> bool:
    """Whether a grammar can hold the calls `syntax` writes (it gives their tags)."""
    return getattr(syntax, "grammar_tags", None) is not None


def check_strict_level(level: str, parser: str | None) -> None:
    """--tool-strict-level function or parameter holds every "auto" call by a grammar,
    which needs a syntax whose calls a grammar can hold."""
    held = [name for name, syntax in SYNTAXES.items() if grammar_holds(syntax)]
    if level != "auto" and parser not in held:
        raise ValueError(f"--tool-strict-level {level} needs tool_choice auto with a --tool-call-parser whose "
                         f"calls a grammar can hold: {', '.join(held)}")


def parse_calls(plan: ToolPlan, text: str) -> tuple[str | None, list[dict]]:
    """(content, tool calls) of a whole output."""
    if plan.mode == "named":
        return None, [new_call(plan.name, text)]
    stream = plan.stream()
    pieces = stream.pieces(text) + stream.close()
    content = "".join(p for p in pieces if isinstance(p, str))
    calls = [p if isinstance(p, dict) else p.call for p in pieces
             if isinstance(p, dict) or isinstance(p, CallPart) and p.kind == "close"]
    return (content or None, calls) if calls else (content, [])
