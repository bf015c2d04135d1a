"""How a model writes its tool calls in free text (`tool_choice: auto`), by vLLM's
--tool-call-parser names:

  hermes       `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` anywhere in the
               text (Qwen, Hermes, and deploy/chat-templates/chatml-tools.jinja)
  llama3_json  an output that is JSON calls, `{"name": ..., "parameters": {...}}` (or
               "arguments"), one or more, split by `;`, after an optional <|python_tag|>
               (Llama 3.1-3.3, as their templates ask for calls)
  pythonic     an output that is a Python list of calls with keyword arguments,
               `[get_weather(city="Paris"), ...]` (Llama 3.2 and 4, ToolACE)
  mistral      text, then calls from Mistral's [TOOL_CALLS] token on: a JSON array of
               {"name", "arguments"} (its v3 tokenizers), or `name[ARGS]{...}` after each
               [TOOL_CALLS] (v11 and later); call ids of 9 letters and digits, which
               Mistral's templates require of the next turn's tool results

and the others of SYNTAXES (below), each in docs/api.md. Each gives a whole output's
(content, calls), and a stream that splits the text as it comes: content goes out at
once, and a call goes out whole once it is known to be one. Text that could still begin
a call is held until the next text says what it is. An output that looked like calls but
is not (bad JSON, a call of something else) is text. Calls a grammar holds (HeldCalls)
are known to be calls from their tag on, and stream in parts as they are written.
"""
from __future__ import annotations

import ast
import json
import re
import secrets
import string
import uuid
from dataclasses import dataclass
from typing import Callable

from services.engine.text.tokenizer import held_tail


def new_call(name: str, arguments: str, call_id: str = "") -> dict:
    return {"id": call_id or f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


def split(pieces: list[str | dict]) -> tuple[str, list[dict]]:
    """A stream's pieces as (their text, their calls)."""
    return "".join(p for p in pieces if isinstance(p, str)), [p for p in pieces if isinstance(p, dict)]


def _call(name, arguments, call_id: str = "") -> dict | None:
    """An OpenAI call of a parsed name and arguments, or None if they are not a call's."""
    if not isinstance(name, str) or not name or not isinstance(arguments, (dict, str)):
        return None
    try:                        # arguments are JSON for any client: no NaN or Infinity
        text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False, allow_nan=False)
    except ValueError:
        return None
    return new_call(name, text, call_id)


class Tagged:
    """Calls in OPEN ... CLOSE tags anywhere in the text, the rest content: `calls` reads a
    body that begins with BODY_START and ends with BODY_END. The text keeps special tokens
    (some models' tags are), as vLLM's parsers keep them. The router reads a whole output
    through the stream (tools.parse_calls); `parse`, which finds the bodies by `_CALL`
    on the whole text, is the reading of a whole output that tests hold the stream to."""
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    BODY_START, BODY_END = "", ""
    special_tokens = True
    _CALL: re.Pattern
    # grammar_tags(name, arguments schema): the xgrammar tags of a call, where a grammar
    # can hold this syntax's calls (structured.calls_in_text); None where not
    grammar_tags = None

    def calls(self, body: str) -> list[dict] | None:
        """The calls of one tagged body, or None if it is not calls."""
        raise NotImplementedError

    def parse(self, text: str) -> tuple[str | None, list[dict]]:
        calls = []

        def take(match: re.Match) -> str:
            found = self.calls(match.group(1))
            if found is None:                       # not a call after all: it stays text
                return match.group(0)
            calls.extend(found)
            return ""
        content = self._CALL.sub(take, text)
        if not calls:
            return text, []
        return content.strip() or None, calls

    def stream(self) -> "TaggedCalls":
        return TaggedCalls(self)


class Hermes(Tagged):
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Qwen2.5/3, Hermes)."""
    BODY_START, BODY_END = "{", "}"
    _CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.DOTALL)

    def calls(self, body: str) -> list[dict] | None:
        """The call of the JSON inside the tags, or None if it is not one."""
        try:
            call = json.loads(body)
        # ValueError: not JSON, or an integer past Python's digit limit; RecursionError:
        # nested past Python's stack
        except (ValueError, RecursionError):
            return None
        return _one(_call(call.get("name"), call.get("arguments", {})) if isinstance(call, dict) else None)

    def grammar_tags(self, name: str, arguments: dict) -> list[dict]:
        """`OPEN{"name": "NAME", "arguments": {...}}CLOSE`, a newline inside the tags or
        none, as vLLM's hermes tags have it. A tool's name is letters, digits and `_.:-`
        (protocol.FunctionName): no JSON escapes."""
        return [{"type": "tag", "begin": f'{self.OPEN}{nl}{{"name": "{name}", "arguments": ',
                 "content": {"type": "json_schema", "json_schema": arguments}, "end": f"}}{nl}{self.CLOSE}"}
                for nl in ("\n", "")]


class LongCat(Hermes):
    """Hermes' calls in `<longcat_tool_call>` tags (LongCat-Flash)."""
    OPEN, CLOSE = "<longcat_tool_call>", "</longcat_tool_call>"
    _CALL = re.compile(r"<longcat_tool_call>\s*(\{.*?\})\s*</longcat_tool_call>", re.DOTALL)


class Qwen3Xml(Tagged):
    """Qwen3-Coder's calls: `<tool_call><function=NAME><parameter=KEY>VALUE</parameter>
    ...</function></tool_call>` blocks anywhere in the text. Each value is its text (one
    wrapping newline trimmed each side), typed as the tool's parameters say, as vLLM
    0.32's qwen3_coder reads it; a parameter left unclosed ends where the next begins."""
    string_values = True                # every value written as text (tools.TypedValues types them)
    BODY_START, BODY_END = "<function=", "</function>"
    _CALL = re.compile(r"<tool_call>\s*(<function=.*?</function>)\s*</tool_call>", re.DOTALL)
    _FUNCTION = re.compile(r"<function=([^>\n]+)>(.*)</function>", re.DOTALL)
    # a value ends at its closing tag, at the next parameter, or at the end of the
    # function's body (the last one left unclosed: vLLM's reads it too)
    _PARAMETER = re.compile(r"<\s*parameter\s*=\s*([^>]*)>(.*?)(?:<\s*/\s*parameter\s*>|(?=<\s*parameter\s*=)|$)",
                            re.DOTALL)

    def calls(self, body: str) -> list[dict] | None:
        found = self._FUNCTION.fullmatch(body)
        if found is None:
            return None
        arguments = {m.group(1).strip(): _trimmed(m.group(2)) for m in self._PARAMETER.finditer(found.group(2))}
        return _one(_call(found.group(1).strip(), arguments))

    def grammar_tags(self, name: str, arguments: dict) -> list[dict]:
        """`<tool_call>\n<function=NAME>\n<parameter=KEY>\nVALUE\n</parameter>...`, as
        xgrammar's qwen_3_coder tags have it."""
        return [_styled_tag(f"<tool_call>\n<function={name}>\n", arguments, "qwen_xml", "\n</function>\n</tool_call>")]


class Glm45(Tagged):
    """GLM-4.5's and 4.7's calls: `<tool_call>NAME<arg_key>KEY</arg_key><arg_value>VALUE
    </arg_value>...</tool_call>` anywhere in the text, a name alone where there are no
    arguments. Each value is its text, typed as the tool's parameters say, as vLLM 0.32's
    glm45 reads it; the body must be a name and pairs alone (whitespace between), or it
    is text."""
    string_values = True                # every value written as text (tools.TypedValues types them)
    _CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
    _HEAD = re.compile(r"\s*([^\s<>]+)\s*(.*)", re.DOTALL)
    _PAIR = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>\s*", re.DOTALL)

    def calls(self, body: str) -> list[dict] | None:
        head = self._HEAD.fullmatch(body)
        if head is None:
            return None
        name, rest = head.groups()
        pairs = list(self._PAIR.finditer(rest))
        if "".join(m.group(0) for m in pairs) != rest:      # something besides the pairs
            return None
        return _one(_call(name, {m.group(1).strip(): m.group(2) for m in pairs}))

    def grammar_tags(self, name: str, arguments: dict) -> list[dict]:
        """`<tool_call>NAME<arg_key>KEY</arg_key><arg_value>VALUE</arg_value>...`, as
        xgrammar's glm_4_7 tags have it."""
        return [_styled_tag(f"<tool_call>{name}", arguments, "glm_xml", "</tool_call>")]


class MiniMaxM2(Tagged):
    """MiniMax-M2's calls: `<minimax:tool_call>`, one or more `<invoke name="NAME">
    <parameter name="KEY">VALUE</parameter>...</invoke>`, `</minimax:tool_call>`, anywhere
    in the text. Each value is its text (one wrapping newline trimmed each side), typed as
    the tool's parameters say, as vLLM 0.32's minimax_m2 reads it; names may be quoted "",
    '' or not at all."""
    string_values = True                # every value written as text (tools.TypedValues types them)
    OPEN, CLOSE = "<minimax:tool_call>", "</minimax:tool_call>"
    BODY_START, BODY_END = "<invoke", "</invoke>"
    _CALL = re.compile(r"<minimax:tool_call>\s*(<invoke.*?</invoke>)\s*</minimax:tool_call>", re.DOTALL)
    _NAME = r"""(?:"([^"]*)"|'([^']*)'|([^>\s"']+))"""
    _INVOKE = re.compile(r"<invoke\s+name\s*=\s*" + _NAME + r"\s*>(.*?)</invoke>\s*", re.DOTALL)
    _PARAMETER = re.compile(r"<\s*parameter\s+name\s*=\s*" + _NAME + r"\s*>(.*?)"
                            r"(?:<\s*/\s*parameter\s*>|(?=<\s*parameter\s+name\s*=)|$)", re.DOTALL)

    def calls(self, body: str) -> list[dict] | None:
        invokes = list(self._INVOKE.finditer(body))
        if not invokes or "".join(m.group(0) for m in invokes).strip() != body.strip():
            return None
        calls = [_call(_quoted(m), {_quoted(p).strip(): _trimmed(p.group(4))
                                    for p in self._PARAMETER.finditer(m.group(4))}) for m in invokes]
        return None if None in calls else calls


def _styled_tag(begin: str, arguments: dict, style: str, end: str) -> dict:
    """An xgrammar tag of a call whose arguments, held to the JSON schema `arguments`, are
    written in one of xgrammar's styles (qwen_xml, glm_xml: its XML of them)."""
    return {"type": "tag", "begin": begin, "content": {"type": "json_schema", "json_schema": arguments, "style": style},
            "end": end}


def _quoted(match: re.Match) -> str:
    """A name written "quoted", 'quoted' or bare (MiniMax-M2's): its text."""
    return next(g for g in match.groups()[:3] if g is not None)


def _trimmed(value: str) -> str:
    """An XML-style value's text: one wrapping newline trimmed each side."""
    return value.removeprefix("\n").removesuffix("\n")


def _one(call: dict | None) -> list[dict] | None:
    return None if call is None else [call]


class TaggedCalls:
    """A stream of a `Tagged` syntax's calls: each is sent whole once its closing tag
    arrives."""

    def __init__(self, syntax: Tagged) -> None:
        self.syntax = syntax
        self._held = ""
        self._in_call = False
        self.calls = 0

    def pieces(self, text: str) -> list[str | dict]:
        """What `text` completes, in order: content (str) and calls (dict)."""
        self._held += text
        out: list[str | dict] = []
        while True:
            syntax = self.syntax
            if self._in_call:
                body = self._held.lstrip()
                if body and not (body.startswith(syntax.BODY_START) or syntax.BODY_START.startswith(body)):
                    out.append(syntax.OPEN)             # no call's body after the tag: it was text
                    self._in_call = False
                    continue
                end = self._close()
                if end < 0:
                    break
                found = syntax.calls(self._held[:end].strip())
                if found is not None:
                    out += found
                    self.calls += len(found)
                else:                           # not a call after all: it was text
                    out.append(syntax.OPEN + self._held[:end + len(syntax.CLOSE)])
                self._held = self._held[end + len(syntax.CLOSE):]
                self._in_call = False
                continue
            text, self._held, self._in_call = _until_tag(self._held, syntax.OPEN)
            out.append(text)
            if not self._in_call:
                break
        return [p for p in out if p != ""]

    def _close(self) -> int:
        """Where the call held ends: the first closing tag right after the body's end (a
        `}`), as the syntax's pattern reads a whole output (an argument may hold the tag
        itself); -1 while none has come."""
        syntax = self.syntax
        end = self._held.find(syntax.CLOSE)
        while end >= 0 and not self._held[:end].rstrip().endswith(syntax.BODY_END):
            end = self._held.find(syntax.CLOSE, end + 1)
        return end

    def close(self) -> list[str | dict]:
        """What is left at the end: text, or an unclosed call given back as text."""
        rest = (self.syntax.OPEN if self._in_call else "") + self._held
        self._held, self._in_call = "", False
        return [rest] if rest else []


def _until_tag(held: str, tag: str) -> tuple[str, str, bool]:
    """`held` split at `tag`: (the text before it, what follows it, True); with no tag
    whole in it, (the text that cannot begin one, the tail that may, False)."""
    start = held.find(tag)
    if start >= 0:
        return held[:start], held[start + len(tag):], True
    keep = len(held) - held_tail(held, (tag,))
    return held[:keep], held[keep:], False


@dataclass(frozen=True)
class CallPart:
    """A piece of a call whose arguments stream as they are written (HeldCalls): `kind`
    "open" (the call as new_call makes it, its arguments ""), "arguments" (more of them,
    `text`) or "close" (the call with all its arguments). `index`: the call's place among
    the stream's calls."""
    kind: str
    index: int
    call: dict
    text: str = ""


class HeldCalls:
    """A stream of calls written as JSON in tags (a `Hermes` syntax's) that a grammar
    holds from their tag on to `OPEN{"name": "NAME", "arguments": VALUE}CLOSE`, a newline
    inside each tag or none (Hermes.grammar_tags): a call opens once its name is
    written and its arguments stream as they come, as vLLM streams them. Only a cut
    (max_tokens) ends one short, with the arguments written so far."""
    _HEAD = re.compile(r'\n?\{"name": "([^"\\]*)", "arguments": ')
    _HEAD_LONGEST = 200                 # past this, text after a tag that is no head is text

    def __init__(self, syntax: Tagged) -> None:
        self.syntax = syntax
        self._held = ""
        self._state = "text"            # text, head, arguments or end (of the call, after its arguments)
        self._call: dict | None = None
        self._arguments = ""
        self._value = JsonValueEnd()
        self.calls = 0

    def pieces(self, text: str) -> list[str | CallPart]:
        self._held += text
        out: list[str | CallPart] = []
        opened, closed = self.syntax.OPEN, self.syntax.CLOSE
        while True:
            if self._state == "text":
                text, self._held, found = _until_tag(self._held, opened)
                out.append(text)
                if not found:
                    break
                self._state = "head"
            elif self._state == "head":
                head = self._HEAD.match(self._held)
                if head is None:
                    if '"arguments": ' not in self._held and len(self._held) < self._HEAD_LONGEST:
                        break                   # more is to come
                    out.append(opened)          # no grammar held this one: it is text
                    self._state = "text"
                    continue
                self._call, self._arguments, self._value = new_call(head.group(1), ""), "", JsonValueEnd()
                out.append(CallPart("open", self.calls, self._call))
                self.calls += 1
                self._held, self._state = self._held[head.end():], "arguments"
            elif self._state == "arguments":
                taken = self._value.feed(self._held)
                if taken:
                    self._arguments += self._held[:taken]
                    out.append(CallPart("arguments", self.calls - 1, self._call, self._held[:taken]))
                    self._held = self._held[taken:]
                if not self._value.ended:
                    break
                self._state = "end"
            else:                               # "}", a newline or none, the closing tag
                ending = self._held.lstrip("}\n")
                if closed.startswith(ending) and len(ending) < len(closed):
                    break
                if ending.startswith(closed):
                    self._held = ending[len(closed):]
                out.append(self._closed())
        return [p for p in out if p != ""]

    def _closed(self) -> CallPart:
        call = {**self._call, "function": {**self._call["function"], "arguments": self._arguments}}
        self._state, self._call = "text", None
        return CallPart("close", self.calls - 1, call)

    def close(self) -> list[str | CallPart]:
        """What is left at the end: text, the tag of a call that never began, or the end
        of a call cut short. After a call, a tag or its beginning at the end is the next
        call cut short (max_tokens), no text: the grammar let nothing else begin it."""
        out: list[str | CallPart] = []
        after_call = self.calls > 0
        if self._state == "head" and not after_call:
            out.append(self.syntax.OPEN + self._held)
        elif self._state in ("arguments", "end"):
            out.append(self._closed())
        elif self._state == "text" and self._held and not after_call:    # held: what may begin a tag
            out.append(self._held)
        self._held, self._state = "", "text"
        return out


class JsonValueEnd:
    """Finds where one JSON value ends as its text comes: an object, an array or a
    string at its closing mark, another value (a number, true, false, null) before the
    first character that is not its own."""

    def __init__(self) -> None:
        self.ended = False
        self._depth = 0
        self._started = False
        self._string = False
        self._escaped = False
        self._scalar = False

    def feed(self, text: str) -> int:
        """How many of `text`'s characters belong to the value (all of them, or up to
        its end)."""
        for at, ch in enumerate(text):
            if self.ended:
                return at
            if not self._started:
                if ch in " \t\r\n":
                    continue
                self._started = True
                self._scalar = ch not in "{[\""
            if self._scalar:
                if ch in ",}] \t\r\n":
                    self.ended = True
                    return at
                continue
            if self._string:
                if self._escaped:
                    self._escaped = False
                elif ch == "\\":
                    self._escaped = True
                elif ch == '"':
                    self._string = False
                    self.ended = self._depth == 0
            elif ch == '"':
                self._string = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                self.ended = self._depth == 0
        return len(text)


class RequiredCalls:
    """The calls of a `tool_choice: "required"` output as they are written: a JSON array of
    {"name": NAME, "arguments": VALUE} objects (the schema tools.plan_tools gives its
    grammar). A call opens once its name is whole and its arguments have begun, and its
    arguments stream as they come, the text the model wrote, as vLLM streams them. Only a
    cut (max_tokens) ends one short, with the arguments written so far; an output cut
    before any call opened is text, given at its close. Text after the array is none."""

    def __init__(self) -> None:
        self.calls = 0
        self._text = ""                 # all of it, for an output cut before any call
        self._state = "start"           # start, items, key, colon, value, after, end
        self._reading: str | None = None    # a JSON value being read: key, name, arguments, or skip (another's)
        self._value = JsonValueEnd()
        self._string = ""               # a key or the name, read so far
        self._key = ""
        self._name: str | None = None
        self._arguments: str | None = None      # None: not begun
        self._call: dict | None = None

    def pieces(self, text: str) -> list[CallPart]:
        self._text += text
        out: list[CallPart] = []
        at = 0
        while at < len(text) and self._state != "end":
            if self._reading is not None:
                taken = self._value.feed(text[at:])
                part, at = text[at:at + taken], at + taken
                if self._reading == "arguments":
                    self._arguments += part
                    out += self._open_or_more(part)
                else:
                    self._string += part
                if self._value.ended:
                    self._read()
                continue
            ch, state = text[at], self._state
            at += 1
            if ch in " \t\r\n":
                continue
            if state == "start":
                self._state = "items" if ch == "[" else "end"
            elif state == "items":
                if ch == "{":
                    self._state, self._name, self._arguments, self._call = "key", None, None, None
                elif ch == "]":
                    self._state = "end"
            elif state in ("key", "after") and ch == "}":
                out += self._ended_call()
            elif state == "key" and ch == '"':
                self._begin("key")
                at -= 1                         # the quote is the key's own
            elif state == "value":
                self._begin(self._key if self._key in ("name", "arguments") else "skip")
                at -= 1                         # the value's first character is its own
            elif state == "colon" and ch == ":":
                self._state = "value"
            elif state == "after" and ch == ",":
                self._state = "key"
        return out

    def _begin(self, what: str) -> None:
        self._reading, self._value, self._string = what, JsonValueEnd(), ""
        if what == "arguments":
            self._arguments = ""

    def _read(self) -> None:
        """A value is read whole: a key, the call's name, its arguments or another's."""
        what, self._reading = self._reading, None
        if what in ("key", "name"):
            try:
                value = json.loads(self._string)
            except ValueError:
                value = None
            value = value if isinstance(value, str) else None
            if what == "key":
                self._key, self._state = value or "", "colon"
                return
            self._name = value
        self._key, self._state = "", "after"

    def _open_or_more(self, text: str) -> list[CallPart]:
        """The parts that `text`, more of the call's arguments, makes known."""
        if self._name is None:
            return []                   # held until the name is known
        if self._call is None:
            self._call = new_call(self._name, "")
            self.calls += 1
            opened = CallPart("open", self.calls - 1, self._call)
            return [opened, CallPart("arguments", self.calls - 1, self._call, self._arguments)] \
                if self._arguments else [opened]
        return [CallPart("arguments", self.calls - 1, self._call, text)] if text else []

    def _ended_call(self) -> list[CallPart]:
        self._state = "items"
        out = self._open_or_more("") if self._call is None and self._arguments is not None else []
        if self._call is None:
            return out
        call = {**self._call, "function": {**self._call["function"], "arguments": self._arguments}}
        self._call = None
        return out + [CallPart("close", self.calls - 1, call)]

    def close(self) -> list[str | CallPart]:
        """What is left at the end: the end of a call cut short, or, where no call began,
        the whole output as text."""
        if self._call is not None:
            return self._ended_call()
        return [] if self.calls else [self._text] if self._text else []


class WholeOutput:
    """A syntax whose calls are the whole output, told by how it begins (`MARKS`, after
    leading whitespace): such an output is held to its end and read whole; any other
    streams as content."""
    MARKS: tuple[str, ...] = ()
    special_tokens = False

    def begins(self, text: str) -> bool | None:
        """Whether an output beginning with `text` is calls; None while it cannot tell."""
        head = text.lstrip()
        if any(head.startswith(mark) for mark in self.MARKS):
            return True
        return None if any(mark.startswith(head) for mark in self.MARKS) else False

    def calls(self, text: str) -> list[dict] | None:
        raise NotImplementedError

    def parse(self, text: str) -> tuple[str | None, list[dict]]:
        calls = self.calls(text.strip()) if self.begins(text) else None
        return (None, calls) if calls else (text, [])

    def stream(self) -> "WholeOutputCalls":
        return WholeOutputCalls(self)


class WholeOutputCalls:
    """A stream of a `WholeOutput` syntax: content as it comes once the output's start
    says it is not calls; calls, held, at the end."""

    def __init__(self, syntax: WholeOutput) -> None:
        self.syntax = syntax
        self._text = ""
        self._calls: bool | None = None
        self.calls = 0

    def pieces(self, text: str) -> list[str | dict]:
        if self._calls is False:
            return [text] if text else []
        self._text += text
        if self._calls is None:                 # told once, by how the output begins
            self._calls = self.syntax.begins(self._text)
        if self._calls is False:
            out, self._text = self._text, ""
            return [out] if out else []
        return []

    def close(self) -> list[str | dict]:
        text, self._text = self._text, ""
        content, calls = self.syntax.parse(text) if self._calls else (text, [])
        self.calls += len(calls)
        return [*([content] if content else []), *calls]


class Llama3Json(WholeOutput):
    TAG = "<|python_tag|>"
    MARKS = (TAG, "{")
    _decoder = json.JSONDecoder()

    def calls(self, text: str) -> list[dict] | None:
        text = text.removeprefix(self.TAG)
        calls, at = [], 0
        while at < len(text):
            while at < len(text) and text[at] in " \t\r\n;":
                at += 1
            if at == len(text):
                break
            try:
                obj, at = self._decoder.raw_decode(text, at)
            except (ValueError, RecursionError):
                return None
            call = _call(obj.get("name"), obj["arguments"] if "arguments" in obj else obj.get("parameters")) \
                if isinstance(obj, dict) else None
            if call is None:
                return None
            calls.append(call)
        return calls or None


class Pythonic(WholeOutput):
    MARKS = ("[",)
    # what JSON-minded models write for Python's constants
    _NAMES = {"true": True, "false": False, "null": None}

    def calls(self, text: str) -> list[dict] | None:
        try:
            tree = ast.parse(text, mode="eval").body
        except (SyntaxError, ValueError, RecursionError):
            return None
        if not isinstance(tree, ast.List) or not tree.elts:
            return None
        calls = []
        for node in tree.elts:
            if not isinstance(node, ast.Call) or node.args or any(k.arg is None for k in node.keywords):
                return None
            try:
                call = _call(self._name(node.func), {k.arg: self._value(k.value) for k in node.keywords})
            except (ValueError, TypeError, RecursionError):
                return None
            if call is None:
                return None
            calls.append(call)
        return calls

    def _name(self, func: ast.expr) -> str | None:
        """`f` or a dotted `a.b.f`."""
        if isinstance(func, ast.Name):
            return func.id
        if isinstance(func, ast.Attribute):
            owner = self._name(func.value)
            return owner and f"{owner}.{func.attr}"
        return None

    def _value(self, node: ast.expr):
        """A literal argument's value (ValueError for anything else: a call, a variable)."""
        if isinstance(node, ast.Name) and node.id in self._NAMES:
            return self._NAMES[node.id]
        if isinstance(node, ast.List):
            return [self._value(e) for e in node.elts]
        if isinstance(node, ast.Dict):
            if any(not isinstance(k, ast.Constant) or not isinstance(k.value, str) for k in node.keys):
                raise ValueError("a dict's keys must be strings")
            return {k.value: self._value(v) for k, v in zip(node.keys, node.values)}
        value = ast.literal_eval(node)
        if value is not None and not isinstance(value, (str, int, float, bool)):
            raise ValueError("not a JSON value")
        return value


class Marked:
    """A syntax whose calls follow a mark: the text before it is content, and from the
    mark on the output is calls whole (`calls`), else all of it is content."""
    MARK = ""
    special_tokens = False

    def parse(self, text: str) -> tuple[str | None, list[dict]]:
        at = text.find(self.MARK)
        calls = self.calls(text[at:]) if at >= 0 else None
        return (text[:at].strip() or None, calls) if calls else (text, [])

    def calls(self, text: str) -> list[dict] | None:
        """The calls of `text`, which begins with the mark; None unless it is calls whole."""
        raise NotImplementedError

    def stream(self) -> "MarkedCalls":
        return MarkedCalls(self)


class MarkedList(Marked):
    """One JSON array of `{"name", "arguments"}` (or "parameters") calls after a mark
    (or one such object, where not `array`), and before an end mark where the syntax has
    one: Jamba's `<tool_calls>[...]</tool_calls>` (special tokens), Phi-4-mini's
    `functools[...]`, InternLM2's `<|action_start|><|plugin|>{...}<|action_end|>`."""
    _decoder = json.JSONDecoder()

    def __init__(self, mark: str, end: str = "", special_tokens: bool = False, array: bool = True) -> None:
        self.MARK, self.END, self.special_tokens, self.array = mark, end, special_tokens, array

    def calls(self, text: str) -> list[dict] | None:
        body = text[len(self.MARK):].strip()
        if self.END:
            if not body.endswith(self.END):
                return None
            body = body[:-len(self.END)].strip()
        try:
            items, end = self._decoder.raw_decode(body)
        except (ValueError, RecursionError):
            return None
        if not self.array:
            items = [items]
        if body[end:].strip() or not isinstance(items, list) or not items:
            return None
        calls = [_call(i.get("name"), i["arguments"] if "arguments" in i else i.get("parameters"))
                 if isinstance(i, dict) else None for i in items]
        return None if None in calls else calls


class SectionCalls(Marked):
    """Calls in a model's special tokens: a section's mark, then each call as `BEGIN head
    SEP arguments CALL_END` (the head names the function: `header` reads it), then the
    section's end. DeepSeek V3.1's head is the name; V3's is `function`, with the name and
    the arguments (`fenced`) in a ```json block after SEP; Kimi K2's is its call id,
    `functions.NAME:N`, kept as the call's id."""
    special_tokens = True

    def __init__(self, mark: str, end: str, begin: str, sep: str, call_end: str,
                 header: Callable[[str], tuple[str, str] | None] = lambda head: (head.strip(), ""),
                 fenced: bool = False) -> None:
        self.MARK, self.END, self.BEGIN, self.SEP, self.CALL_END = mark, end, begin, sep, call_end
        self.header, self.fenced = header, fenced

    def calls(self, text: str) -> list[dict] | None:
        body, calls = text[len(self.MARK):].strip().removesuffix(self.END).strip(), []
        while body:
            end = body.find(self.CALL_END)
            if not body.startswith(self.BEGIN) or end < 0:
                return None
            head, sep, rest = body[len(self.BEGIN):end].partition(self.SEP)
            body = body[end + len(self.CALL_END):].strip()
            named = self._fenced(head, rest) if self.fenced else self._headed(head, rest)
            if not sep or named is None:
                return None
            name, call_id, arguments = named
            try:
                call = _call(name, json.loads(arguments), call_id)
            except (ValueError, RecursionError):
                return None
            if call is None:
                return None
            calls.append(call)
        return calls or None

    def _headed(self, head: str, rest: str) -> tuple[str, str, str] | None:
        """(name, id, arguments) where the head names the call and the arguments follow SEP."""
        named = self.header(head)
        return None if named is None else (*named, rest)

    @staticmethod
    def _fenced(head: str, rest: str) -> tuple[str, str, str] | None:
        """DeepSeek V3's `function<｜tool▁sep｜>NAME\n```json\n{...}\n````: (name, id, arguments)."""
        name, fence, arguments = rest.partition("\n```json\n")
        if head.strip() != "function" or not fence or not arguments.endswith("\n```"):
            return None
        return name.strip(), "", arguments[:-len("\n```")]


def _kimi_head(head: str) -> tuple[str, str] | None:
    """Kimi K2's call id, `functions.NAME:N`: its name (the last part before `:N`) and the id."""
    call_id = head.strip()
    match = re.fullmatch(r"(.+):\d+", call_id)
    return (match.group(1).rsplit(".", 1)[-1], call_id) if match else None


class Mistral(Marked):
    MARK, ARGS = "[TOOL_CALLS]", "[ARGS]"
    special_tokens = True
    _decoder = json.JSONDecoder()
    _ALNUM = string.ascii_letters + string.digits

    def calls(self, text: str) -> list[dict] | None:
        """The calls of `text`, which begins with the mark; None unless it is calls whole."""
        calls = []
        for part in text.split(self.MARK)[1:]:
            try:
                found = self._part(part.strip())
            except (ValueError, RecursionError):
                return None
            if not found or None in found:
                return None
            calls += found
        return calls or None

    def _part(self, part: str) -> list[dict | None] | None:
        """The calls after one mark: a JSON array of them (v3), or one `name[ARGS]{...}`
        or `name{...}` (v11 and later); None if text follows them."""
        if part.startswith("["):
            items, end = self._decoder.raw_decode(part)
            found = [_call(i.get("name"), i.get("arguments"), self._id()) if isinstance(i, dict) else None
                     for i in (items if isinstance(items, list) else [None])]
            return found if not part[end:].strip() else None
        name, args, body = part.partition(self.ARGS)
        if not args:
            brace = part.find("{")
            name, body = (part[:brace], part[brace:]) if brace > 0 else ("", "")
        body = body.strip()
        arguments, end = self._decoder.raw_decode(body)
        return [_call(name.strip(), arguments, self._id())] if not body[end:].strip() else None

    def _id(self) -> str:
        return "".join(secrets.choice(self._ALNUM) for _ in range(9))


class MarkedCalls:
    """A stream whose calls follow a mark: text before it goes out as it comes, and from
    the mark on the text is held and read whole at the end (the calls, or text if it
    holds none)."""

    def __init__(self, syntax: Marked) -> None:
        self.syntax = syntax
        self._held = ""
        self._marked = False
        self.calls = 0

    def pieces(self, text: str) -> list[str | dict]:
        self._held += text
        if self._marked:
            return []
        out, rest, self._marked = _until_tag(self._held, self.syntax.MARK)
        self._held = self.syntax.MARK + rest if self._marked else rest     # the calls are read from the mark on
        return [out] if out else []

    def close(self) -> list[str | dict]:
        held, self._held = self._held, ""
        calls = self.syntax.calls(held) if self._marked else None
        if not calls:
            return [held] if held else []
        self.calls += len(calls)
        return calls


# DeepSeek's section and call marks, its separator, a call's end
DEEPSEEK = ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>",
            "<｜tool▁call▁end｜>")
SYNTAXES = {"hermes": Hermes(), "qwen3_json": Hermes(), "longcat": LongCat(),
            "qwen3_coder": Qwen3Xml(), "qwen3_xml": Qwen3Xml(), "glm45": Glm45(), "glm47": Glm45(),
            "minimax_m2": MiniMaxM2(),
            "llama3_json": Llama3Json(), "llama4_json": Llama3Json(), "pythonic": Pythonic(), "mistral": Mistral(),
            "jamba": MarkedList("<tool_calls>", "</tool_calls>", special_tokens=True),
            "phi4_mini_json": MarkedList("functools"),
            "internlm": MarkedList("<|action_start|><|plugin|>", "<|action_end|>", special_tokens=True, array=False),
            "deepseek_v3": SectionCalls(*DEEPSEEK, fenced=True), "deepseek_v31": SectionCalls(*DEEPSEEK),
            "kimi_k2": SectionCalls("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>",
                                    "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>",
                                    header=_kimi_head)}
