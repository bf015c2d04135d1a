"""OpenAI's Responses API (`POST /v1/responses`), served through the chat pipeline.

A request becomes a chat completion request: `instructions` a system message, `input`
(text, or a list of messages, function calls and their outputs) the conversation,
function tools and `tool_choice` the chat's (tools.py), `text.format` the chat's
`response_format`. What comes back is written as a Response: a message item for the
text and a function_call item per call, or, streamed, the Responses events in the
order the official client's `responses.stream()` folds them.

The router keeps no responses: `previous_response_id` and the other fields that need
server-side state or tools pdserve does not run are refused by name. `store: true`,
OpenAI's default, is answered unstored (the response says `store: false`), as vLLM does
without a store.
"""
from __future__ import annotations

import time
import uuid
from typing import Annotated, AsyncIterator, ClassVar, Literal, Union

from pydantic import (BaseModel, Discriminator, Field, StrictBool, StrictInt, StrictStr, Tag, field_validator,
                      model_validator)
from pydantic_core import PydanticCustomError

from services.router.generation import Generation
from services.router.frontend import Collected, RunningRequest
from services.router.http_input import parse
from services.router.protocol import (STRICT, APIError, CacheSalt, ChatCompletionRequest, FunctionName, Number,
                                      ReasoningEffort, Unimplemented, bad_request, has_its_text, part_text,
                                      text_parts_only, unsupported)
from services.router.choices import SSE_KEEPALIVE, sse_json
from services.router.output_items import ItemStream, Step, steps_of, whole_items
from services.router.reasoning import Thinking
from services.router.tools import ToolPlan

# The chat request's fields as this API names them, for errors raised on the chat path.
_PARAMS = {"messages": "input", "max_tokens": "max_output_tokens", "response_format": "text.format",
           "response_format.json_schema": "text.format", "response_format.json_schema.schema": "text.format.schema",
           "reasoning_effort": "reasoning.effort"}


class ContentText(BaseModel):
    """Text in an input message: the caller's (input_text) or an earlier output's sent
    back (output_text, with the annotations and logprobs it came with, or a refusal,
    whose text is the refusal)."""
    model_config = STRICT
    type: Literal["input_text", "output_text", "refusal"]
    text: StrictStr | None = None
    refusal: StrictStr | None = None
    annotations: list | None = None
    logprobs: list | None = None

    _its_text = model_validator(mode="after")(has_its_text)


def _text(content: list[ContentText]) -> str:
    return "\n".join(part_text(p) for p in content)      # as chat's parts (vLLM's join)


def _as_parts(value):
    """A string where a list of text parts may stand, as that list: errors then name the
    part at fault, not each shape the field could take."""
    return [{"type": "input_text", "text": value}] if isinstance(value, str) else \
        text_parts_only(value, ("input_text", "output_text", "refusal"))


class MessageItem(BaseModel):
    model_config = STRICT
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: list[ContentText]
    id: StrictStr | None = None                     # an earlier output's, sent back
    status: StrictStr | None = None

    _parts = field_validator("content", mode="before")(_as_parts)


class FunctionCallItem(BaseModel):
    """A call the model made earlier, sent back with the conversation."""
    model_config = STRICT
    type: Literal["function_call"]
    call_id: StrictStr
    name: StrictStr
    arguments: StrictStr
    id: StrictStr | None = None
    status: StrictStr | None = None


class FunctionCallOutputItem(BaseModel):
    """The caller's result of a call."""
    model_config = STRICT
    type: Literal["function_call_output"]
    call_id: StrictStr
    output: list[ContentText]
    id: StrictStr | None = None
    status: StrictStr | None = None

    _parts = field_validator("output", mode="before")(_as_parts)


class ReasoningItem(BaseModel):
    """An earlier answer's reasoning, sent back with the conversation: kept out of the
    prompt, as reasoning models' templates drop an earlier turn's thinking."""
    model_config = STRICT
    type: Literal["reasoning"]
    id: StrictStr | None = None
    summary: list = []
    content: list | None = None
    encrypted_content: StrictStr | None = None
    status: StrictStr | None = None


def _item_type(item) -> str | None:
    if isinstance(item, dict):
        return item.get("type", "message")          # an easy input message may leave out its type
    return getattr(item, "type", None)


InputItem = Annotated[Union[Annotated[MessageItem, Tag("message")],
                            Annotated[FunctionCallItem, Tag("function_call")],
                            Annotated[FunctionCallOutputItem, Tag("function_call_output")],
                            Annotated[ReasoningItem, Tag("reasoning")]],
                      Discriminator(_item_type)]


class FunctionTool(BaseModel):
    model_config = STRICT
    type: Literal["function"]
    name: FunctionName
    description: StrictStr | None = None
    parameters: dict | None = None
    strict: StrictBool | None = None


class NamedFunction(BaseModel):
    model_config = STRICT
    type: Literal["function"]
    name: StrictStr


class TextFormat(BaseModel):
    model_config = STRICT
    type: Literal["text", "json_object", "json_schema"]
    name: StrictStr | None = None
    schema_: dict | StrictBool | None = Field(None, alias="schema")
    description: StrictStr | None = None
    strict: StrictBool | None = None


class TextConfig(BaseModel):
    model_config = STRICT
    format: TextFormat | None = None
    verbosity: StrictStr | None = None


class Reasoning(BaseModel):
    """OpenAI's reasoning options. `effort` reaches the chat template as the chat API's
    reasoning_effort does (vLLM's rule). This server parses no reasoning out of a model's
    output, so no reasoning item or summary is returned: `summary` asks for what there
    is, which is none. `context` and `mode` name OpenAI's own execution modes: null only."""
    model_config = STRICT
    effort: ReasoningEffort | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None     # the deprecated spelling
    context: Unimplemented = None
    mode: Unimplemented = None


class ResponsesRequest(BaseModel):
    model_config = STRICT
    # The input items' kinds, which pydantic names in an error's place after the item's index.
    union_tags: ClassVar[frozenset[str]] = frozenset({"message", "function_call", "function_call_output", "reasoning"})
    model: StrictStr | None = None
    input: list[InputItem]                              # a string is one user message
    instructions: StrictStr | None = None
    max_output_tokens: StrictInt | None = None
    temperature: Number | None = None
    top_p: Number | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: StrictBool | None = None
    text: TextConfig | None = None
    stream: StrictBool | None = False
    metadata: dict[StrictStr, StrictStr] | None = None     # echoed back
    user: StrictStr | None = None                       # the caller's own label: no effect
    # Accepted only where they ask for nothing this server lacks (check()).
    store: StrictBool | None = None
    previous_response_id: StrictStr | None = None
    include: list[StrictStr] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    reasoning: Reasoning | None = None
    # vLLM's sampling extensions, as on the chat API
    ignore_eos: StrictBool = False                      # what `vllm bench serve`'s datasets send
    top_k: StrictInt | None = None
    min_p: Number | None = None
    seed: StrictInt | None = None
    repetition_penalty: Number | None = None
    cache_salt: CacheSalt | None = None

    @field_validator("input", mode="before")
    @classmethod
    def _text_input(cls, v):
        if isinstance(v, str):
            return [{"role": "user", "content": v}]
        if not isinstance(v, list):
            raise PydanticCustomError("input_shape", "must be a string or a list of input items")
        return v

    def check(self) -> None:
        """Refuse by name what needs state or abilities this server does not have."""
        if self.previous_response_id is not None:
            raise unsupported("previous_response_id", "previous_response_id is not supported: pdserve keeps no "
                                                      "responses; send the whole conversation as input")
        if self.include:
            raise unsupported("include", f"include {self.include[0]!r} is not supported")
        if self.truncation == "auto":
            raise unsupported("truncation", "truncation: auto is not supported: a conversation longer than the "
                                            "context is refused")
        if self.text is not None and self.text.verbosity is not None:
            raise unsupported("text.verbosity", "text.verbosity is not supported")
        if not self.input:
            raise bad_request("input must not be empty", param="input")

    def to_chat(self) -> ChatCompletionRequest:
        """The same request as a chat completion."""
        chat: dict = {"messages": self._messages(), "max_tokens": self.max_output_tokens,
                      "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k, "min_p": self.min_p,
                      "seed": self.seed, "repetition_penalty": self.repetition_penalty, "user": self.user,
                      "parallel_tool_calls": self.parallel_tool_calls, "ignore_eos": self.ignore_eos,
                      "reasoning_effort": self.reasoning and self.reasoning.effort, "cache_salt": self.cache_salt}
        if self.tools:
            chat["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                             for t in self.tools]
        choice = self.tool_choice
        chat["tool_choice"] = {"type": "function", "function": {"name": choice.name}} \
            if isinstance(choice, NamedFunction) else choice
        fmt = self.text and self.text.format
        if fmt is not None and fmt.type != "text":
            chat["response_format"] = {"type": fmt.type}
            if fmt.type == "json_schema":
                if fmt.schema_ is None:
                    raise bad_request("text.format json_schema needs its schema", param="text.format.schema")
                chat["response_format"]["json_schema"] = {
                    "name": fmt.name or "response", "schema": fmt.schema_,
                    **{k: v for k, v in (("description", fmt.description), ("strict", fmt.strict)) if v is not None}}
        # A value this request took that the chat request refuses is the caller's 400, named.
        return parse(ChatCompletionRequest, {k: v for k, v in chat.items() if v is not None})

    def _messages(self) -> list[dict]:
        out: list[dict] = [{"role": "system", "content": self.instructions}] if self.instructions else []
        for item in self.input:
            if isinstance(item, MessageItem):
                out.append({"role": item.role, "content": _text(item.content)})
            elif isinstance(item, FunctionCallItem):
                call = {"id": item.call_id, "type": "function",
                        "function": {"name": item.name, "arguments": item.arguments}}
                last = out[-1] if out else None
                if last is not None and last["role"] == "assistant":     # calls of one turn go together
                    last.setdefault("tool_calls", []).append(call)
                else:
                    out.append({"role": "assistant", "content": None, "tool_calls": [call]})
            elif isinstance(item, FunctionCallOutputItem):
                out.append({"role": "tool", "tool_call_id": item.call_id, "content": _text(item.output)})
        return out


def in_responses_terms(exc: APIError) -> APIError:
    """An error of the chat path, naming this API's fields, in its message too where it
    begins with the field."""
    if exc.param in _PARAMS:
        name = _PARAMS[exc.param]
        if exc.message.startswith((f"{exc.param} ", f"{exc.param}:")):
            exc.message = name + exc.message[len(exc.param):]
        exc.param = name
    return exc


def new_response_id() -> str:
    return f"resp_{uuid.uuid4().hex}"


class ResponseWriter:
    """One request's Response: whole, or as the stream of events that builds it."""

    def __init__(self, req: ResponsesRequest, response_id: str, model: str, tools: ToolPlan | None,
                 gen: Generation) -> None:
        self.req = req
        self.id = response_id
        self.model = model
        self.tools = tools
        self.gen = gen
        self.created = int(time.time())
        self.message_id = f"msg_{uuid.uuid4().hex}"
        self.reasoning_id = f"rs_{uuid.uuid4().hex}"
        self.thinking: Thinking | None = None      # --reasoning-parser's, set by the front end
        self._seq = 0

    # ---- the Response object ----
    def response(self, status: str, output: list[dict], error: dict | None = None) -> dict:
        req = self.req
        fmt = req.text.format.model_dump(by_alias=True, exclude_none=True) if req.text and req.text.format \
            else {"type": "text"}
        choice = req.tool_choice.model_dump() if isinstance(req.tool_choice, NamedFunction) \
            else req.tool_choice or "auto"
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        reasoning = {"effort": req.reasoning.effort, "summary": req.reasoning.summary} if req.reasoning else None
        out = {"id": self.id, "object": "response", "created_at": self.created, "status": status,
               "error": error, "incomplete_details": incomplete, "instructions": req.instructions,
               "max_output_tokens": req.max_output_tokens, "model": self.model, "output": output,
               "parallel_tool_calls": req.parallel_tool_calls is not False, "previous_response_id": None,
               "reasoning": reasoning, "store": False,
               "temperature": 1.0 if req.temperature is None else req.temperature,
               "text": {"format": fmt}, "tool_choice": choice,
               "tools": [t.model_dump(exclude_none=True) for t in req.tools or ()],
               "top_p": 1.0 if req.top_p is None else req.top_p, "truncation": "disabled", "user": req.user,
               "metadata": req.metadata or {}, "usage": None}
        if status in ("completed", "incomplete"):
            out["usage"] = self.usage()
        if status == "completed":
            out["completed_at"] = int(time.time())
        return out

    def usage(self) -> dict:
        gen = self.gen
        thought = gen.thinking.count if gen.thinking is not None else 0
        return {"input_tokens": len(gen.prompt_ids), "input_tokens_details": {"cached_tokens": gen.cached_tokens},
                "output_tokens": gen.completion_tokens, "output_tokens_details": {"reasoning_tokens": thought},
                "total_tokens": len(gen.prompt_ids) + gen.completion_tokens}

    def _status(self) -> str:
        return "incomplete" if self.gen.finish_reason == "length" else "completed"

    def message(self, text: str, status: str) -> dict:
        content = [] if status == "in_progress" else [_output_text(text)]
        return {"id": self.message_id, "type": "message", "role": "assistant", "status": status, "content": content}

    @staticmethod
    def function_call(call: dict, status: str, arguments: str | None = None) -> dict:
        fn = call["function"]
        return {"id": f"fc_{call['id'].removeprefix('call_')}", "type": "function_call", "call_id": call["id"],
                "name": fn["name"], "arguments": fn["arguments"] if arguments is None else arguments,
                "status": status}

    def reasoning(self, text: str, status: str) -> dict:
        content = [] if status == "in_progress" else [{"type": "reasoning_text", "text": text}]
        return {"id": self.reasoning_id, "type": "reasoning", "summary": [], "content": content, "status": status}

    def whole(self, result: Collected) -> dict:
        status = self._status()
        closed = whole_items(ItemStream(self.tools, empty_text=True, thinking=self.thinking), result.text)
        answered = any(s.kind == "close_call" or s.kind == "close_text" and s.delta for s in closed)
        output = []
        for step in closed:
            if step.kind == "close_reasoning":      # ended by the answer, or by the output's end
                output.append(self.reasoning(step.delta, "completed" if answered else status))
            elif step.kind == "close_text":
                output.append(self.message(step.delta, status))
            else:
                output.append(self.function_call(step.call, "completed", step.delta))
        return self.response(status, output)

    # ---- streamed ----
    def _event(self, type_: str, **fields) -> bytes:
        data = {"type": type_, "sequence_number": self._seq, **fields}
        self._seq += 1
        return f"event: {type_}\ndata: {sse_json(data)}\n\n".encode()

    async def events(self, running: RunningRequest, keepalive: float) -> AsyncIterator[bytes]:
        stream = _EventStream(self)
        yield self._event("response.created", response=self.response("in_progress", []))
        yield self._event("response.in_progress", response=self.response("in_progress", []))
        try:
            items = ItemStream(self.tools, empty_text=True, thinking=self.thinking)
            async for step in steps_of(running.deltas(keepalive), items):
                if step is None:
                    yield SSE_KEEPALIVE
                    continue
                for event in stream.events(step):
                    yield event
            status = self._status()
            yield self._event(f"response.{status}", response=self.response(status, stream.output))
        except APIError as exc:
            yield self._event("error", code=exc.code or exc.type, message=exc.message, param=exc.param)
            yield self._event("response.failed", response=self.response(
                "failed", stream.output, {"code": exc.code or exc.type, "message": exc.message}))


def _output_text(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


class _EventStream:
    """The output items of one streamed response (output_items.py), as its events."""

    def __init__(self, writer: ResponseWriter) -> None:
        self.w = writer
        self._done: list[tuple[int, dict]] = []     # (output index, item) of the items done

    @property
    def output(self) -> list[dict]:
        """The items done, in output order."""
        return [item for _, item in sorted(self._done, key=lambda done: done[0])]

    def events(self, step: Step) -> list[bytes]:
        w, index = self.w, step.index
        if step.kind == "open_text":
            return [w._event("response.output_item.added", output_index=index, item=w.message("", "in_progress")),
                    w._event("response.content_part.added", item_id=w.message_id, output_index=index,
                             content_index=0, part=_output_text(""))]
        if step.kind == "text":
            return [w._event("response.output_text.delta", item_id=w.message_id, output_index=index,
                             content_index=0, delta=step.delta, logprobs=[])]
        if step.kind == "close_text":
            item = w.message(step.delta, w._status())
            self._done.append((index, item))
            return [w._event("response.output_text.done", item_id=w.message_id, output_index=index,
                             content_index=0, text=step.delta, logprobs=[]),
                    w._event("response.content_part.done", item_id=w.message_id, output_index=index,
                             content_index=0, part=_output_text(step.delta)),
                    w._event("response.output_item.done", output_index=index, item=item)]
        if step.kind == "open_reasoning":
            return [w._event("response.output_item.added", output_index=index, item=w.reasoning("", "in_progress")),
                    w._event("response.content_part.added", item_id=w.reasoning_id, output_index=index,
                             content_index=0, part={"type": "reasoning_text", "text": ""})]
        if step.kind == "reasoning":
            return [w._event("response.reasoning_text.delta", item_id=w.reasoning_id, output_index=index,
                             content_index=0, delta=step.delta)]
        if step.kind == "close_reasoning":
            item = w.reasoning(step.delta, w._status())            # completed, or cut short with the output
            self._done.append((index, item))
            return [w._event("response.reasoning_text.done", item_id=w.reasoning_id, output_index=index,
                             content_index=0, text=step.delta),
                    w._event("response.content_part.done", item_id=w.reasoning_id, output_index=index,
                             content_index=0, part={"type": "reasoning_text", "text": step.delta}),
                    w._event("response.output_item.done", output_index=index, item=item)]
        if step.kind == "open_call":
            return [w._event("response.output_item.added", output_index=index,
                             item=w.function_call(step.call, "in_progress", ""))]
        if step.kind == "arguments":
            return [w._event("response.function_call_arguments.delta",
                             item_id=w.function_call(step.call, "in_progress")["id"], output_index=index,
                             delta=step.delta)]
        item = w.function_call(step.call, "completed", step.delta)         # close_call
        self._done.append((index, item))
        return [w._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                         name=item["name"], arguments=step.delta),
                w._event("response.output_item.done", output_index=index, item=item)]
