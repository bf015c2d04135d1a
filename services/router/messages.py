"""Anthropic's Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`), served
through the chat pipeline, as vLLM and SGLang serve it: the `anthropic` SDK and the
agents built on it (Claude Code among them) pointed at pdserve.

A request becomes a chat completion request: `system` a system message, the messages
the conversation (an assistant's tool_use blocks its tool calls, a user's tool_result
blocks tool messages), custom tools and `tool_choice` the chat's (tools.py). What comes
back is a Message: a text block and a tool_use block per call, or, streamed, the
Messages events in the order the SDK's `messages.stream()` folds them. Errors on these
routes are Anthropic's error objects. Images, documents, Anthropic's own tools, MCP
servers and conversations kept on the server are refused by name; `thinking`,
`cache_control` and `context_management` are taken and change nothing (the prefix cache
needs no marks, no reasoning is parsed out of a model's output, and the conversation is
taken as sent)."""
from __future__ import annotations

import json
import uuid
from typing import Annotated, AsyncIterator, ClassVar, Literal, Union

from pydantic import BaseModel, Discriminator, Field, StrictBool, StrictInt, StrictStr, Tag, field_validator
from pydantic_core import PydanticCustomError

from services.router.choices import sse_json
from services.router.frontend import Collected, RunningRequest
from services.router.generation import Generation
from services.router.http_input import anthropic_error, parse
from services.router.output_items import ItemStream, Step, steps_of, whole_items
from services.router.protocol import (STRICT, APIError, ChatCompletionRequest, ContextLengthError, FunctionName,
                                      Number, Unimplemented, bad_request, text_parts_only)
from services.router.reasoning import Thinking
from services.router.tools import ToolPlan

# The chat request's fields as this API names them, for errors raised on the chat path.
_PARAMS = {"stop": "stop_sequences", "response_format": "output_config.format",
           "response_format.json_schema": "output_config.format",
           "response_format.json_schema.schema": "output_config.format.schema",
           "reasoning_effort": "output_config.effort"}

_TEXT_KINDS = ("text", "tool_use", "tool_result", "thinking", "redacted_thinking")


class TextBlock(BaseModel):
    model_config = STRICT
    type: Literal["text"]
    text: StrictStr
    cache_control: dict | None = None
    citations: list | None = None


class ToolUseBlock(BaseModel):
    """A call the model made earlier, sent back with the conversation."""
    model_config = STRICT
    type: Literal["tool_use"]
    id: StrictStr
    name: StrictStr
    input: dict
    cache_control: dict | None = None
    caller: dict | None = None
    toolset_name: StrictStr | None = None


def _text_blocks_only(value):
    return text_parts_only(value, ("text",), noun="block")


class ToolResultBlock(BaseModel):
    """The caller's result of a call."""
    model_config = STRICT
    type: Literal["tool_result"]
    tool_use_id: StrictStr
    content: StrictStr | list[TextBlock] | None = None
    is_error: StrictBool | None = None
    cache_control: dict | None = None
    toolset_name: StrictStr | None = None

    _parts = field_validator("content", mode="before")(_text_blocks_only)

    def text(self) -> str:
        text = _text(self.content)
        return f"Error: {text}" if self.is_error else text


class ThinkingBlock(BaseModel):
    """An earlier turn's reasoning, sent back: not part of the prompt."""
    model_config = STRICT
    type: Literal["thinking"]
    thinking: StrictStr
    signature: StrictStr | None = None


class RedactedThinkingBlock(BaseModel):
    model_config = STRICT
    type: Literal["redacted_thinking"]
    data: StrictStr


def _block_type(block) -> str | None:
    return block.get("type") if isinstance(block, dict) else getattr(block, "type", None)


Block = Annotated[Union[Annotated[TextBlock, Tag("text")], Annotated[ToolUseBlock, Tag("tool_use")],
                        Annotated[ToolResultBlock, Tag("tool_result")], Annotated[ThinkingBlock, Tag("thinking")],
                        Annotated[RedactedThinkingBlock, Tag("redacted_thinking")]],
                  Discriminator(_block_type)]


def _text(content) -> str:
    if content is None:
        return ""
    return content if isinstance(content, str) else "\n".join(b.text for b in content)     # as chat's parts


class Message(BaseModel):
    """A turn of the conversation; a system message among them (Anthropic's beta
    mid-conversation system message, which Claude Code sends) is the chat's system message
    at that place."""
    model_config = STRICT
    role: Literal["user", "assistant", "system"]
    content: StrictStr | list[Block]

    @field_validator("content", mode="before")
    @classmethod
    def _readable(cls, v):
        return text_parts_only(v, _TEXT_KINDS, noun="block")       # an image, a document: refused by place


class Tool(BaseModel):
    """A custom tool. Anthropic's own tools (web search and code execution, run on its
    servers; bash, text editor and computer use, which it defines for its clients) are
    refused by their type. `strict` holds the tool's calls to its schema (tools.py); the
    options for how Anthropic loads and streams tools change nothing here."""
    model_config = STRICT
    type: Literal["custom"] | None = None
    name: FunctionName
    description: StrictStr | None = None
    input_schema: dict
    cache_control: dict | None = None
    strict: StrictBool | None = None
    allowed_callers: list | None = None
    defer_loading: StrictBool | None = None
    eager_input_streaming: StrictBool | None = None
    input_examples: list[dict] | None = None

    @field_validator("type", mode="before")
    @classmethod
    def _custom(cls, v):
        if v not in (None, "custom"):
            raise PydanticCustomError("not_implemented", "tool type '{kind}' is one of Anthropic's own tools (run "
                                      "by Anthropic's servers, or defined by Anthropic for its clients): pdserve "
                                      "takes custom tools only", {"kind": str(v)[:40]})
        return v


class ToolChoice(BaseModel):
    model_config = STRICT
    type: Literal["auto", "any", "tool", "none"]
    name: StrictStr | None = None
    disable_parallel_tool_use: StrictBool | None = None


class Thinking(BaseModel):
    model_config = STRICT
    type: Literal["enabled", "disabled", "adaptive", "between_tools"]
    budget_tokens: StrictInt | None = None
    display: Literal["summarized", "omitted"] | None = None


class OutputFormat(BaseModel):
    model_config = STRICT
    type: Literal["json_schema"]
    schema_: dict = Field(alias="schema")


class OutputConfig(BaseModel):
    """Anthropic's structured output (`format`: the chat's json_schema response_format)
    and effort (the chat template's reasoning_effort, as vLLM passes it)."""
    model_config = STRICT
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: OutputFormat | None = None


class Metadata(BaseModel):
    model_config = STRICT
    user_id: StrictStr | None = None


class MessagesRequest(BaseModel):
    model_config = STRICT
    union_tags: ClassVar[frozenset[str]] = frozenset(_TEXT_KINDS)
    model: StrictStr
    max_tokens: StrictInt
    messages: list[Message]
    system: StrictStr | list[TextBlock] | None = None
    stop_sequences: list[StrictStr] | None = None
    stream: StrictBool = False
    temperature: Number | None = None
    top_p: Number | None = None
    top_k: StrictInt | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    metadata: Metadata | None = None
    output_config: OutputConfig | None = None
    thinking: Thinking | None = None                    # taken; no reasoning is parsed out
    ignore_eos: StrictBool = False      # vLLM's, as benchmark clients send it (aiperf's extra inputs)
    # Anthropic's context editing (beta): clears earlier thinking or tool results from the
    # context past a threshold; no thinking comes back here, and the conversation is
    # taken as sent (taken, no effect)
    context_management: dict | None = None
    # Anthropic's conversations kept on its servers (beta): refused in check(), in the
    # form its SDK's tool runner recognises, so that it sends the whole history instead
    thread: dict | None = None
    # Anthropic's account and routing options: taken, no effect here
    cache_control: dict | None = None                   # the prefix cache needs no marks
    diagnostics: dict | None = None
    inference_geo: StrictStr | None = None
    service_tier: Literal["auto", "standard_only"] | None = None
    speed: Literal["standard", "fast"] | None = None
    user_profile_id: StrictStr | None = None
    workspace_id: StrictStr | None = None
    # Anthropic's own server-side features: null only
    container: Unimplemented = None
    mcp_servers: Unimplemented = None

    _system = field_validator("system", mode="before")(_text_blocks_only)

    def check(self) -> None:
        self._check_messages()
        if self.thread is not None:
            raise APIError(400, "thread: pdserve keeps no conversations: send the whole history", param="thread",
                           code="unsupported_parameter",
                           details={"error_code": "thread_unsupported_request", "unsupported": ["thread"]})
        if self.max_tokens < 1:
            raise bad_request("max_tokens: must be at least 1", param="max_tokens")
        choice = self.tool_choice
        if choice is not None and choice.type == "tool" and not choice.name:
            raise bad_request("tool_choice: type 'tool' needs the tool's name", param="tool_choice.name")

    def _check_messages(self) -> None:
        if not self.messages:
            raise bad_request("messages: at least one message is required", param="messages")

    def to_chat(self) -> ChatCompletionRequest:
        """The same request as a chat completion."""
        config = self.output_config
        messages = self.chat_messages()
        chat: dict = {"messages": messages, "max_tokens": self.max_tokens,
                      "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
                      "stop": self.stop_sequences or None, "user": self.metadata and self.metadata.user_id,
                      "reasoning_effort": config and config.effort, "ignore_eos": self.ignore_eos}
        if config is not None and config.format is not None:
            chat["response_format"] = {"type": "json_schema", "json_schema": {"name": "output",
                                                                              "schema": config.format.schema_}}
        chat.update(self.chat_tools())
        # A last message of the assistant's with text and no call is the start of the
        # answer, which the model continues (Anthropic's prefill); the answer holds only
        # what follows.
        last = messages[-1] if messages else {}
        if self.messages and self.messages[-1].role == "assistant" and last.get("role") == "assistant" \
                and last.get("content") and not last.get("tool_calls"):
            chat.update(add_generation_prompt=False, continue_final_message=True)
        return parse(ChatCompletionRequest, {k: v for k, v in chat.items() if v is not None})

    def chat_tools(self) -> dict:
        """The chat request's tools and tool_choice."""
        out: dict = {}
        if self.tools:
            out["tools"] = [{"type": "function", "function": {
                "name": t.name, "parameters": t.input_schema,
                **{k: v for k, v in (("description", t.description), ("strict", t.strict)) if v is not None}}}
                for t in self.tools]
        choice = self.tool_choice
        if choice is not None:
            out["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}.get(choice.type) or \
                {"type": "function", "function": {"name": choice.name}}
            if choice.disable_parallel_tool_use:
                out["parallel_tool_calls"] = False
        return out

    def chat_messages(self) -> list[dict]:
        out: list[dict] = [{"role": "system", "content": _text(self.system)}] if self.system else []
        for message in self.messages:
            if isinstance(message.content, str):
                out.append({"role": message.role, "content": message.content})
                continue
            text, calls = [], []
            for block in message.content:
                if isinstance(block, TextBlock):
                    text.append(block.text)
                elif isinstance(block, ToolUseBlock):
                    calls.append({"id": block.id, "type": "function", "function": {
                        "name": block.name, "arguments": json.dumps(block.input, ensure_ascii=False)}})
                elif isinstance(block, ToolResultBlock):     # a tool message each, in order
                    if text:
                        out.append({"role": message.role, "content": "\n".join(text)})
                        text = []
                    out.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": block.text()})
            if text or calls or not message.content:
                m = {"role": message.role, "content": "\n".join(text) if text or not calls else None}
                if calls:
                    m["tool_calls"] = calls
                out.append(m)
        return out


class CountTokensRequest(MessagesRequest):
    """What /v1/messages/count_tokens reads: a Messages request, but for what only
    generating needs."""
    max_tokens: StrictInt | None = None
    stream: StrictBool = False

    def check(self) -> None:
        self._check_messages()


def in_messages_terms(exc: APIError) -> APIError:
    """An error of the chat path, naming this API's fields; one past the context in
    Anthropic's words (a client that compacts its conversation looks for them)."""
    if isinstance(exc, ContextLengthError):
        if exc.max_tokens is None or exc.prompt_tokens >= exc.max_model_len:
            exc.message = f"prompt is too long: {exc.prompt_tokens} tokens > {exc.max_model_len} maximum"
        else:
            exc.message = (f"input length and `max_tokens` exceed context limit: {exc.prompt_tokens} + "
                           f"{exc.max_tokens} > {exc.max_model_len}, decrease input length or `max_tokens` and "
                           "try again")
    elif exc.code == "context_length_exceeded":
        exc.message = f"prompt is too long: {exc.message}"
    if exc.param in _PARAMS:
        old, exc.param = exc.param, _PARAMS[exc.param]
        if exc.message.startswith(f"{old}:"):
            exc.message = exc.param + exc.message[len(old):]
    return exc


def new_message_id() -> str:
    return f"msg_{uuid.uuid4().hex}"


def _tool_use_id(call: dict) -> str:
    return f"toolu_{call['id'].removeprefix('call_')}"


def _input(arguments: str) -> dict | None:
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        return None
    return value if isinstance(value, dict) else None


class MessageWriter:
    """One request's Message: whole, or as the stream of events that builds it."""

    def __init__(self, req: MessagesRequest, message_id: str, model: str, tools: ToolPlan | None,
                 gen: Generation) -> None:
        self.req = req
        self.id = message_id
        self.model = model
        self.tools = tools
        self.gen = gen
        self.thinking: Thinking | None = None      # --reasoning-parser's, set by the front end

    def message(self, content: list[dict], done: bool) -> dict:
        stop_reason, stop_sequence = self.stop_reason(content) if done else (None, None)
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content,
                "stop_reason": stop_reason, "stop_sequence": stop_sequence, "usage": self.usage()}

    def usage(self) -> dict:
        """Anthropic counts the prompt's tokens read from its cache apart from the rest."""
        gen = self.gen
        return {"input_tokens": len(gen.prompt_ids) - gen.cached_tokens, "output_tokens": gen.completion_tokens,
                "cache_creation_input_tokens": 0, "cache_read_input_tokens": gen.cached_tokens}

    def stop_reason(self, content: list[dict]) -> tuple[str, str | None]:
        gen = self.gen
        if gen.finish_reason == "length":
            return "max_tokens", None
        if any(block["type"] == "tool_use" for block in content):
            return "tool_use", None
        if isinstance(gen.stop_reason, str):
            return "stop_sequence", gen.stop_reason
        return "end_turn", None

    def whole(self, result: Collected) -> dict:
        content = []
        for step in whole_items(ItemStream(self.tools, one_text=False, thinking=self.thinking), result.text):
            if step.kind == "close_reasoning":
                content.append({"type": "thinking", "thinking": step.delta, "signature": ""})
            elif step.kind == "close_text":
                content.append({"type": "text", "text": step.delta})
            elif (arguments := _input(step.delta)) is not None:     # else cut short by max_tokens: no call made
                content.append({"type": "tool_use", "id": _tool_use_id(step.call),
                                "name": step.call["function"]["name"], "input": arguments})
        return self.message(content, done=True)

    # ---- streamed ----
    @staticmethod
    def event(type_: str, **fields) -> bytes:
        return f"event: {type_}\ndata: {sse_json({'type': type_, **fields})}\n\n".encode()

    async def events(self, running: RunningRequest, keepalive: float) -> AsyncIterator[bytes]:
        """message_start goes out with the first token (or the first keep-alive before it),
        whatever it makes: the prompt's cached tokens are known by then, and its usage is
        the final one's."""
        stream = _EventStream(self)
        started = False
        try:
            items = ItemStream(self.tools, one_text=False, thinking=self.thinking)
            async for step in steps_of(running.deltas(keepalive), items, begin=True):
                if not started:
                    started = True
                    yield self.event("message_start", message=self.message([], done=False))
                if step is not None and step.kind == "begin":
                    continue
                if step is None:
                    yield self.event("ping")
                    continue
                for event in stream.events(step):
                    yield event
            if not started:
                yield self.event("message_start", message=self.message([], done=False))
            stop_reason, stop_sequence = self.stop_reason(stream.content)
            yield self.event("message_delta", delta={"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                             usage=self.usage())
            yield self.event("message_stop")
        except APIError as exc:
            yield self.event("error", error=anthropic_error(exc)["error"])


class _EventStream:
    """The content blocks of one streamed message (output_items.py), as its events."""

    def __init__(self, writer: MessageWriter) -> None:
        self.w = writer
        self.content: list[dict] = []       # the blocks begun, in order

    def events(self, step: Step) -> list[bytes]:
        event, index = self.w.event, step.index
        if step.kind == "open_text":
            self.content.append({"type": "text"})
            return [event("content_block_start", index=index, content_block={"type": "text", "text": ""})]
        if step.kind == "text":
            return [event("content_block_delta", index=index, delta={"type": "text_delta", "text": step.delta})]
        if step.kind == "open_reasoning":
            self.content.append({"type": "thinking"})
            return [event("content_block_start", index=index,
                          content_block={"type": "thinking", "thinking": "", "signature": ""})]
        if step.kind == "reasoning":
            return [event("content_block_delta", index=index, delta={"type": "thinking_delta", "thinking": step.delta})]
        if step.kind == "open_call":
            self.content.append({"type": "tool_use"})
            block = {"type": "tool_use", "id": _tool_use_id(step.call), "name": step.call["function"]["name"],
                     "input": {}}
            return [event("content_block_start", index=index, content_block=block)]
        if step.kind == "arguments":
            return [event("content_block_delta", index=index,
                          delta={"type": "input_json_delta", "partial_json": step.delta})]
        return [event("content_block_stop", index=index)]           # close_text, close_call, close_reasoning
