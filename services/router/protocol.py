"""OpenAI-compatible request bodies and error objects.

A field pdserve does not implement is refused by name (400 `unsupported_parameter`, as
OpenAI refuses an unknown one), never accepted and dropped: a client asking for JSON
must not get free text with a 200. Known fields are type-checked strictly enough that
`"max_tokens": "ten"` or `true` is an error, not a guess. Range checks that need the
prompt length live in `resolve_sampling`.
"""
from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal

from pydantic import (AfterValidator, BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr,
                      ValidationError, field_validator, model_validator)
from pydantic_core import PydanticCustomError

from services.engine.core.sampling import MAX_CHOICES, MAX_STOP, MAX_TOP_LOGPROBS

# An int is a float here, as in JSON; `true` or "0.5" is not (pydantic's lax float takes both).
Number = Annotated[float, Field(strict=True)]


class APIError(Exception):
    """An error with an HTTP status, an OpenAI error type/code, and a gRPC status name."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 code: str | None = None, param: str | None = None, grpc_code: str = "INVALID_ARGUMENT",
                 headers: dict[str, str] | None = None, details: dict | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.code = code
        self.param = param
        self.grpc_code = grpc_code
        self.headers = headers or {}
        self.details = details          # Anthropic's error.details (what a client may act on)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class ContextLengthError(APIError):
    """A request past the model's context, with its numbers (each API words it its own way)."""

    def __init__(self, message: str, param: str, prompt_tokens: int, max_tokens: int | None,
                 max_model_len: int) -> None:
        super().__init__(400, message, code="context_length_exceeded", param=param)
        self.prompt_tokens, self.max_tokens, self.max_model_len = prompt_tokens, max_tokens, max_model_len


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


STRICT = ConfigDict(extra="forbid")


def _absent(value):
    if value in (None, [], {}):
        return None
    raise PydanticCustomError("not_implemented", "is not supported here: only null (or empty) is accepted")


# An OpenAI field this server does not implement: null or empty means what absent does
# (clients send them so: `message.model_dump()` has `audio: null`), anything else is
# refused by name (http_input.parse makes it `unsupported_parameter`).
Unimplemented = Annotated[Any, AfterValidator(_absent)]


def _salt(value: str) -> str:
    if not value:
        raise ValueError("cache_salt must be a non-empty string")
    return value


CacheSalt = Annotated[StrictStr, AfterValidator(_salt)]     # vLLM's: none, or a non-empty string
_TOKEN_ID = re.compile(r"-?[0-9]{1,20}")            # negative or past the vocabulary: refused by name later
# Completions' logprobs: OpenAI allows 5; vLLM (and this) as many as chat's top_logprobs.
MAX_LOGPROBS = MAX_TOP_LOGPROBS


def part_text(part) -> str:
    """A text part's text: a refusal's is in `refusal`, any other's in `text`."""
    return part.refusal if part.type == "refusal" else part.text


def has_its_text(part):
    """A text part as it is, if it carries its text (`part_text`'s field)."""
    if part_text(part) is None:
        raise ValueError(f"a {part.type} part needs its {'refusal' if part.type == 'refusal' else 'text'}")
    return part


class TextPart(BaseModel):
    """A part of a message's text: OpenAI's `text`; the Responses API's `input_text` and
    `output_text`, which clients also send in chat messages; an assistant's earlier
    `refusal`, whose text is the refusal. vLLM reads each as text."""
    model_config = STRICT
    type: Literal["text", "input_text", "output_text", "refusal"]
    text: StrictStr | None = None
    refusal: StrictStr | None = None
    annotations: list | None = None         # an output_text sent back carries these
    logprobs: list | None = None

    _its_text = model_validator(mode="after")(has_its_text)

    @property
    def value(self) -> str:
        return part_text(self)


TEXT_PARTS = ("text", "input_text", "output_text", "refusal")


class FunctionCall(BaseModel):
    model_config = STRICT
    name: StrictStr
    arguments: StrictStr


class ToolCall(BaseModel):
    model_config = STRICT
    id: StrictStr
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = STRICT
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[TextPart] | None = None
    name: StrictStr | None = None
    tool_calls: list[ToolCall] | None = None            # an assistant's earlier calls
    tool_call_id: StrictStr | None = None               # a tool's answer to one
    refusal: StrictStr | None = None                    # an assistant's earlier refusal: its text
    # What an assistant message read back from a response carries, null here.
    audio: Unimplemented = None
    function_call: Unimplemented = None
    annotations: Unimplemented = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, v):
        return text_parts_only(v, TEXT_PARTS)

    def for_template(self) -> dict:
        """The message as chat templates read it (tool calls' arguments as objects, as
        Hugging Face templates expect)."""
        m: dict = {"role": self.role, "content": self.text()}
        if self.name:
            m["name"] = self.name
        if self.tool_call_id:
            m["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            m["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.function.name, "arguments": _json_or_text(c.function.arguments)}} for c in self.tool_calls]
        return m

    def text(self) -> str:
        if self.content is None:
            return self.refusal or ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(p.value for p in self.content)      # vLLM's join of text parts


def text_parts_only(parts, text_types: tuple[str, ...], noun: str = "part"):
    """Content parts (Anthropic's blocks: `noun`) as they are, unless one is of another kind
    than text (an image, audio, a file): refused by its place and kind, where pydantic
    would name a field of the part under each shape the content could take."""
    if isinstance(parts, list):
        for i, part in enumerate(parts):
            kind = part.get("type") if isinstance(part, dict) else None
            if isinstance(kind, str) and kind not in text_types:
                raise PydanticCustomError("not_implemented", "{noun} {index} is of type '{kind}': this model reads "
                                          "text {noun}s only", {"noun": noun, "index": i, "kind": kind[:40]})
    return parts


def _json_or_text(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


class StreamOptions(BaseModel):
    model_config = STRICT
    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False


class JSONSchemaFormat(BaseModel):
    model_config = STRICT
    name: StrictStr = "response"
    description: StrictStr | None = None
    schema_: dict | StrictBool = Field(default_factory=dict, alias="schema")
    strict: StrictBool | None = None


class StructuralTagItem(BaseModel):
    """vLLM's first structural tag form: text between `begin` and `end` in `schema`."""
    model_config = STRICT
    begin: StrictStr
    schema_: dict | StrictBool = Field(alias="schema")
    end: StrictStr


class ResponseFormat(BaseModel):
    model_config = STRICT
    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JSONSchemaFormat | None = None
    # vLLM's structural_tag: xgrammar's `format`, or the first form's structures and triggers
    format: dict | None = None
    structures: list[StructuralTagItem] | None = None
    triggers: list[StrictStr] | None = None


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs`: one kind of constraint on the output (the router's
    structured.py resolves it). The workers' xgrammar always writes JSON with fixed
    whitespace and reads a schema's objects as closed, so `disable_any_whitespace` and
    `disable_additional_properties` ask for what is done anyway, and there is no other
    backend to fall back from or to disable."""
    model_config = STRICT
    json_: dict | StrictStr | None = Field(None, alias="json")
    regex: StrictStr | None = None
    choice: list[StrictStr] | None = None
    grammar: StrictStr | None = None
    json_object: StrictBool | None = None
    structural_tag: StrictStr | None = None
    disable_fallback: StrictBool = False
    disable_any_whitespace: StrictBool = False
    disable_additional_properties: StrictBool = False
    whitespace_pattern: Unimplemented = None


# A function (tool) name, as OpenAI allows it.
FunctionName = Annotated[str, Field(strict=True, pattern=r"^[A-Za-z0-9_.:-]{1,64}$")]


class FunctionDef(BaseModel):
    model_config = STRICT
    name: FunctionName
    description: StrictStr | None = None
    parameters: dict = Field(default_factory=lambda: {"type": "object", "properties": {}})
    strict: StrictBool | None = None


class Tool(BaseModel):
    model_config = STRICT
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(BaseModel):
    model_config = STRICT
    name: StrictStr


class NamedToolChoice(BaseModel):
    model_config = STRICT
    type: Literal["function"]
    function: NamedFunction


class CommonRequest(BaseModel):
    model_config = STRICT
    model: StrictStr | None = None
    max_tokens: StrictInt | None = None
    temperature: Number | None = None
    top_p: Number | None = None
    top_k: StrictInt | None = None
    seed: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = None
    n: StrictInt | None = 1             # explicit nulls mean the default, as in OpenAI's API
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    ignore_eos: StrictBool = False
    min_tokens: StrictInt = 0
    return_token_ids: StrictBool = False
    presence_penalty: Number | None = None
    frequency_penalty: Number | None = None
    repetition_penalty: Number | None = None
    min_p: Number | None = None
    logit_bias: dict[str, Number] | None = None
    stop_token_ids: list[StrictInt] | None = None
    user: StrictStr | None = None                       # the caller's own label: logged, no effect
    best_of: StrictInt | None = None
    # vLLM's extensions (docs/api.md says what each does here)
    use_beam_search: StrictBool = False             # n beams (router/beam_search.py)
    length_penalty: Number = 1.0                    # beam search's: score = sum of logprobs / length ** it
    skip_special_tokens: StrictBool = True
    spaces_between_special_tokens: StrictBool = True
    include_stop_str_in_output: StrictBool = False
    truncate_prompt_tokens: StrictInt | None = None
    prompt_logprobs: StrictInt | None = None
    allowed_token_ids: list[StrictInt] | None = None
    bad_words: list[StrictStr] | None = None
    return_tokens_as_token_ids: StrictBool = False
    priority: StrictInt = 0
    structured_outputs: StructuredOutputs | None = None
    cache_salt: CacheSalt | None = None                 # vLLM's: only prompts of the same salt share cached blocks
    # vLLM's earlier spellings of structured_outputs (guided_decoding_backend: the workers'
    # xgrammar compiles every kind, whichever is named)
    guided_json: dict | StrictStr | None = None
    guided_regex: StrictStr | None = None
    guided_choice: list[StrictStr] | None = None
    guided_grammar: StrictStr | None = None
    guided_decoding_backend: StrictStr | None = None
    guided_whitespace_pattern: Unimplemented = None

    @field_validator("priority")
    @classmethod
    def _priority(cls, v):
        # vLLM's field; its default (first-come-first-served) scheduling refuses all but 0
        if v != 0:
            raise ValueError("priority scheduling is not enabled: only 0 is accepted (the order among API keys "
                             "is the router's fair share)")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v):
        if v is None:
            return None
        # int() alone would take " 5", "1_0" and other scripts' digits too.
        if not all(_TOKEN_ID.fullmatch(k) for k in v):
            raise ValueError("logit_bias keys must be token ids in decimal digits")
        return {int(k): b for k, b in v.items()}

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        if v is None:
            return []
        stops = [v] if isinstance(v, str) else v
        if len(stops) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop sequences")
        return [s for s in stops if s]

    @property
    def choices(self) -> int:
        return 1 if self.n is None else self.n

    def check(self) -> None:
        """What no field's type says: n and best_of in range, prompt_logprobs not streamed."""
        if not 1 <= self.choices <= MAX_CHOICES:
            raise bad_request(f"n must be between 1 and {MAX_CHOICES}, got {self.n}", param="n")
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed when stream is true", param="stream_options")
        if self.best_of not in (None, self.choices):
            raise unsupported("best_of", "best_of other than n is not supported")
        if self.use_beam_search and self.stream:
            raise bad_request("Streaming is not currently supported with beam search", param="stream")
        if self.prompt_logprobs is not None:
            if not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
                raise bad_request(f"prompt_logprobs must be between 0 and {MAX_LOGPROBS}", param="prompt_logprobs")
            if self.stream:
                raise bad_request("prompt_logprobs is not available when stream is true (as in vLLM)",
                                  param="prompt_logprobs")
        if self.truncate_prompt_tokens is not None and self.truncate_prompt_tokens < 1 \
                and self.truncate_prompt_tokens != -1:
            raise bad_request("truncate_prompt_tokens must be at least 1, or -1 for the model's context length",
                              param="truncate_prompt_tokens")

    def truncate(self, prompt_ids: list[int], max_model_len: int) -> list[int]:
        """The prompt's last `truncate_prompt_tokens` tokens (vLLM's left truncation)."""
        keep = self.truncate_prompt_tokens
        if keep is None:
            return prompt_ids
        if keep == -1:
            keep = max_model_len
        elif keep > max_model_len:
            raise bad_request(f"truncate_prompt_tokens ({keep}) is greater than the model's context length "
                              f"({max_model_len})", param="truncate_prompt_tokens")
        return prompt_ids[-keep:]


def unsupported(param: str, message: str | None = None) -> APIError:
    return bad_request(message or f"Unrecognized request argument supplied: {param}", param=param,
                       code="unsupported_parameter")


# OpenAI's reasoning effort levels (its SDK's ReasoningEffort); the chat template decides
# what each means, a model without reasoning ignores it.
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]


class ChatCompletionRequest(CommonRequest):
    messages: list[ChatMessage]
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool | None = False
    top_logprobs: StrictInt | None = None
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool | None = None
    # OpenAI's options that ask nothing of a text model here: accepted, no effect
    metadata: dict[StrictStr, StrictStr] | None = None  # tags of a stored completion: none is stored
    store: StrictBool | None = None                     # true refused in check(): nothing is stored
    modalities: list[Literal["text"]] | None = None
    service_tier: Literal["auto", "default"] | None = None
    prompt_cache_key: StrictStr | None = None           # prefix-aware routing caches without a key
    safety_identifier: StrictStr | None = None          # a label, as `user`
    # OpenAI's options this server does not implement: null only
    audio: Unimplemented = None
    prediction: Unimplemented = None
    web_search_options: Unimplemented = None
    verbosity: Unimplemented = None
    functions: Unimplemented = None                     # the deprecated spelling of tools
    function_call: Unimplemented = None
    # vLLM's: a variable of the chat template (a reasoning model's reads it; others: no effect)
    reasoning_effort: ReasoningEffort | None = None
    # vLLM's chat template options
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    chat_template_kwargs: dict | None = None
    add_special_tokens: StrictBool = False      # vLLM's: the tokenizer's BOS and such over the template's
    include_reasoning: StrictBool = True        # vLLM's: false drops a reasoning model's thinking
    # vLLM's: the answer begins with the last message's text when that is the assistant's
    # (with continue_final_message, the whole message so far)
    echo: StrictBool = False

    def echoed(self) -> str:
        """The text `echo` puts before the answer's."""
        last = self.messages[-1]
        return (last.text() or "") if self.echo and last.role == "assistant" else ""

    def template_kwargs(self) -> dict | None:
        """chat_template_kwargs, with reasoning_effort among them as vLLM passes it (the
        kwargs' own value first)."""
        if self.reasoning_effort is None:
            return self.chat_template_kwargs
        return {"reasoning_effort": self.reasoning_effort, **(self.chat_template_kwargs or {})}

    def top_logprobs_count(self) -> int | None:
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= MAX_LOGPROBS:
            raise bad_request(f"top_logprobs must be between 0 and {MAX_LOGPROBS}", param="top_logprobs")
        if not self.logprobs:
            if self.top_logprobs:
                raise bad_request("top_logprobs needs logprobs: true", param="top_logprobs")
            return None
        return self.top_logprobs or 0

    @field_validator("messages")
    @classmethod
    def _non_empty(cls, v):
        if not v:
            raise ValueError("must not be empty")
        return v

    def check(self) -> None:
        super().check()
        if self.store:
            raise unsupported("store", "store: true is not supported: pdserve keeps no completions (send store: "
                                       "false, or leave it out)")


Prompt = StrictStr | list[StrictInt] | list[StrictStr] | list[list[StrictInt]]
PROMPT_SHAPES = "a string, a list of strings, a list of token ids, or a list of token-id lists"


class CompletionRequest(CommonRequest):
    # OpenAI's four shapes: a list of strings or of token-id lists is several prompts.
    prompt: Prompt
    # OpenAI's default for completions, as vLLM's and SGLang's; an explicit null takes the
    # model's max_new_tokens, else what the context leaves (chat's default)
    max_tokens: StrictInt | None = 16
    logprobs: StrictInt | None = None
    echo: StrictBool = False
    add_special_tokens: StrictBool = True       # vLLM's: false leaves out the tokenizer's BOS and such
    suffix: Unimplemented = None
    response_format: ResponseFormat | None = None       # vLLM's, as chat's

    def top_logprobs_count(self) -> int | None:
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise bad_request(f"logprobs must be between 0 and {MAX_LOGPROBS}", param="logprobs")
        return self.logprobs

    def check(self) -> None:
        super().check()
        if self.use_beam_search and self.max_tokens == 0:
            raise bad_request("beam search makes at least one token: max_tokens must be at least 1",
                              param="max_tokens")
        if self.use_beam_search and self.echo and self.logprobs is not None:
            raise bad_request("`echo` with `logprobs` is not supported with beam search because beam search does "
                              "not compute prompt logprobs", param="echo")

    @field_validator("prompt", mode="wrap")
    @classmethod
    def _shape(cls, v, handler):
        try:
            v = handler(v)
        except ValidationError:
            raise PydanticCustomError("prompt_shape", f"must be {PROMPT_SHAPES}") from None
        if v == "" or v == []:
            raise PydanticCustomError("prompt_empty", "must not be empty")
        if isinstance(v, list) and isinstance(v[0], (str, list)):
            empty = next((i for i, p in enumerate(v) if not p), None)
            if empty is not None:
                raise PydanticCustomError("prompt_empty", f"the list's prompt {empty} is empty")
        return v

    @property
    def prompts(self) -> list[str | list[int]]:
        """Each prompt: a string or its token ids."""
        p = self.prompt
        return [p] if isinstance(p, str) or isinstance(p[0], int) else list(p)


class TokenizeRequest(BaseModel):
    """POST /tokenize, in vLLM's two shapes: `prompt` (tokenized as /v1/completions does)
    or `messages` (through the chat template, as /v1/chat/completions does)."""
    model_config = STRICT
    model: StrictStr | None = None
    prompt: StrictStr | None = None
    messages: list[ChatMessage] | None = None
    tools: list[Tool] | None = None
    return_token_strs: StrictBool = False
    add_generation_prompt: StrictBool = True
    add_special_tokens: StrictBool | None = Field(
        None, description="add the tokenizer's BOS/EOS; default true for a prompt, false for messages (the "
                          "chat template writes its own)")
    continue_final_message: StrictBool = False
    chat_template_kwargs: dict | None = None

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give either prompt or messages")
        if self.messages == []:
            raise ValueError("must not be empty")
        return self

    def special_tokens(self) -> bool:
        return self.add_special_tokens if self.add_special_tokens is not None else self.messages is None


class DetokenizeRequest(BaseModel):
    """POST /detokenize, as vLLM takes it: token ids back to text, special tokens kept."""
    model_config = STRICT
    model: StrictStr | None = None
    tokens: list[StrictInt]
