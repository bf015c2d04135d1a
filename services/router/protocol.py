"""OpenAI-compatible request bodies and error objects.

Unknown fields are ignored (as OpenAI and vLLM do); known fields are type-checked
strictly enough that `"max_tokens": "ten"` or `true` is an error, not a guess. Range
checks that need the prompt length live in `resolve_sampling`.
"""
from __future__ import annotations

from typing import Annotated, Literal

from pydantic import (BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, field_validator,
                      model_validator)

NonNegFloat = Annotated[float, Field(strict=False)]


class APIError(Exception):
    """An error with an HTTP status, an OpenAI error type/code, and a gRPC status name."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 code: str | None = None, param: str | None = None, grpc_code: str = "INVALID_ARGUMENT",
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.code = code
        self.param = param
        self.grpc_code = grpc_code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: StrictStr


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[TextPart] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: StrictBool = False


class CommonRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: StrictStr | None = None
    max_tokens: StrictInt | None = None
    temperature: NonNegFloat | None = None
    top_p: NonNegFloat | None = None
    top_k: StrictInt | None = None
    seed: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = None
    n: StrictInt | None = 1             # explicit nulls mean the default, as in OpenAI's API
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    ignore_eos: StrictBool = False
    min_tokens: StrictInt = 0
    return_token_ids: StrictBool = False
    presence_penalty: NonNegFloat | None = None
    frequency_penalty: NonNegFloat | None = None
    logprobs: StrictBool | StrictInt | None = None
    echo: StrictBool = False

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        if v is None:
            return []
        stops = [v] if isinstance(v, str) else v
        if len(stops) > 16:
            raise ValueError("at most 16 stop sequences")
        return [s for s in stops if s]

    def unsupported(self) -> None:
        """Reject what the engine does not implement instead of silently ignoring it."""
        if self.n not in (None, 1):
            raise bad_request("only n=1 is supported", param="n")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) not in (None, 0, 0.0):
                raise bad_request(f"{name} is not supported", param=name)
        if self.logprobs not in (None, False, 0):
            raise bad_request("logprobs are not supported", param="logprobs")
        if self.echo:
            raise bad_request("echo is not supported", param="echo")


class ChatCompletionRequest(CommonRequest):
    messages: list[ChatMessage]
    max_completion_tokens: StrictInt | None = None

    @field_validator("messages")
    @classmethod
    def _non_empty(cls, v):
        if not v:
            raise ValueError("messages must not be empty")
        return v


class CompletionRequest(CommonRequest):
    prompt: StrictStr | list[StrictInt] | list[StrictStr]

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v):
        if isinstance(v, list):
            if not v:
                raise ValueError("prompt must not be empty")
            if isinstance(v[0], str):
                if len(v) != 1:
                    raise ValueError("only one prompt per request is supported")
                return v[0]
        elif v == "":
            raise ValueError("prompt must not be empty")
        return v


class TokenizeRequest(BaseModel):
    """POST /tokenize, in vLLM's two shapes: `prompt` (tokenized as /v1/completions does)
    or `messages` (through the chat template, as /v1/chat/completions does)."""
    model_config = ConfigDict(extra="ignore")
    model: StrictStr | None = None
    prompt: StrictStr | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: StrictBool = True
    add_special_tokens: StrictBool | None = Field(
        None, description="add the tokenizer's BOS/EOS; default true for a prompt, false for messages (the "
                          "chat template writes its own)")
    continue_final_message: StrictBool = False

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give either prompt or messages")
        if self.messages == []:
            raise ValueError("messages must not be empty")
        return self

    def special_tokens(self) -> bool:
        return self.add_special_tokens if self.add_special_tokens is not None else self.messages is None

    def unsupported(self) -> None:
        if self.continue_final_message:
            raise bad_request("continue_final_message is not supported", param="continue_final_message")


class DetokenizeRequest(BaseModel):
    """POST /detokenize, as vLLM takes it: token ids back to text, special tokens kept."""
    model_config = ConfigDict(extra="ignore")
    model: StrictStr | None = None
    tokens: list[StrictInt]
