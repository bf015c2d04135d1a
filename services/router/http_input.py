"""HTTP requests on their way in: API keys, request ids, and bodies read and checked
as JSON (size, content type, numbers past Python's digit limit, lone surrogates) before a
route's model parses them; every refusal an OpenAI error body."""
from __future__ import annotations

import functools
import json
import re
import uuid
from typing import Awaitable, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect

from services.common.aio import Interrupted, unless
from services.common.security import KeyCheck
from services.router.admission import TENANT
from services.router.protocol import APIError, bad_request, unsupported


HTTP_CODES = {404: "not_found", 405: "method_not_allowed"}
T = TypeVar("T")


# Anthropic's error types by HTTP status; others by class (4xx, 5xx).
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
                    503: "overloaded_error", 529: "overloaded_error"}


def anthropic_error(exc: APIError) -> dict:
    """The error object of Anthropic's API (its Messages routes)."""
    kind = _ANTHROPIC_TYPES.get(exc.status, "invalid_request_error" if exc.status < 500 else "api_error")
    error = {"type": kind, "message": exc.message}
    if exc.details:
        error["details"] = exc.details
    return {"type": "error", "error": error}


def error_response(exc: APIError, path: str = "") -> JSONResponse:
    """The error as the API at `path` writes errors: Anthropic's on its Messages routes,
    OpenAI's elsewhere."""
    body = anthropic_error(exc) if path.startswith("/v1/messages") else exc.body()
    return JSONResponse(body, status_code=exc.status, headers=exc.headers)


def unauthorized(authorization: str | None) -> APIError:
    message = ("You didn't provide an API key: send it as Authorization: Bearer YOUR_KEY (or x-api-key: YOUR_KEY)."
               if not authorization else "Incorrect API key provided.")
    return APIError(401, message, code="invalid_api_key", grpc_code="UNAUTHENTICATED",
                    headers={"WWW-Authenticate": "Bearer"})


class RequireAPIKey:
    """ASGI middleware: refuses requests without an accepted key, but for open paths. The
    key comes as OpenAI's clients send it (`Authorization: Bearer`) or Anthropic's
    (`x-api-key`). Plain ASGI (not BaseHTTPMiddleware): streamed responses and
    disconnects pass through untouched."""

    def __init__(self, app, keys: KeyCheck, open_paths: frozenset[str]) -> None:
        self.app = app
        self.keys = keys
        self.open_paths = open_paths

    async def __call__(self, scope, receive, send):
        # (a CORS preflight, which carries no key, is answered outside: CORSMiddleware)
        if scope["type"] != "http" or scope["path"] in self.open_paths:
            return await self.app(scope, receive, send)
        authorization = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"authorization"), None)
        if authorization is None:
            key = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"x-api-key"), None)
            authorization = key and f"Bearer {key}"
        tenant = self.keys.tenant_of_header(authorization)
        if tenant:
            scope.setdefault("state", {})["tenant"] = tenant        # request.state.tenant: the router's queue
            TENANT.set(tenant)                                       # and the tokenizer's turns
            return await self.app(scope, receive, send)
        await error_response(unauthorized(authorization), scope["path"])(scope, receive, send)


REQUEST_ID_MAX = 128


def usable_request_id(given: bytes) -> bool:
    """Whether a caller's request id may be sent back as it is (a header, gRPC metadata):
    visible ASCII, at most REQUEST_ID_MAX characters."""
    return 0 < len(given) <= REQUEST_ID_MAX and all(0x21 <= c <= 0x7E for c in given)


class RequestId:
    """ASGI middleware: every response carries `x-request-id`, the caller's own (visible
    ASCII, at most 128 characters) or a new one, errors and streams included; on
    Anthropic's routes as `request-id` too, where its SDK reads it."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = next((v for k, v in scope["headers"] if k == b"x-request-id"), b"")
        rid = given if usable_request_id(given) else uuid.uuid4().hex.encode()

        names = (b"x-request-id", b"request-id") if scope["path"].startswith("/v1/messages") else (b"x-request-id",)

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), *((name, rid) for name in names)]
            await send(message)
        await self.app(scope, receive, send_with_id)


def check_json_content_type(request: Request) -> None:
    media = request.headers.get("content-type", "").partition(";")[0].strip().lower()
    if media != "application/json":
        raise APIError(415, f"Content-Type must be application/json, not {media or 'missing'}",
                       code="unsupported_media_type")


async def read_json(request: Request, max_bytes: int) -> dict:
    check_json_content_type(request)
    coding = request.headers.get("content-encoding", "identity").strip().lower()
    if coding not in ("", "identity"):
        raise APIError(415, f"Content-Encoding {coding[:40]} is not supported: send the body uncompressed",
                       code="unsupported_media_type")
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > max_bytes:
        raise bad_request(f"request body of {declared} bytes exceeds the limit of {max_bytes}", code="body_too_large")
    body = bytearray()
    try:
        async for chunk in request.stream():
            body += chunk
            if len(body) > max_bytes:
                raise bad_request(f"request body exceeds the limit of {max_bytes} bytes", code="body_too_large")
    except ClientDisconnect:            # gone (or cut off at --body-timeout): nobody reads an answer
        raise APIError(499, "the connection closed before the request body arrived",
                       code="client_closed_request") from None
    try:
        text = bytes(body).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise bad_request(f"request body is not valid UTF-8: {exc}", code="invalid_utf8") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise bad_request(f"request body is not valid JSON: {exc}", code="invalid_json") from None
    except RecursionError:
        raise bad_request("request body nests arrays or objects too deeply", code="invalid_json") from None
    except ValueError as exc:               # valid JSON, but an integer past Python's digit limit
        raise huge_integer(text, exc) from None
    if not isinstance(data, dict):
        raise bad_request("request body must be a JSON object", code="invalid_json")
    if _SURROGATE_ESCAPE.search(text):
        refuse_lone_surrogates(data)
    return data


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """`work`'s result, or APIError 499 once the client closes its connection first; the
    work is then cancelled, which ends the request on every worker (as vLLM's
    `with_cancellation`). A streamed answer notices a gone client when a write fails; an
    answer sent whole would otherwise generate to its end for nobody, and a client's
    timeout and retries would leave several such generations running. Called once the
    body is read: what the connection says next can only be that it closed."""
    async def closed() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
    try:
        return await unless(work, closed())
    except Interrupted:
        raise APIError(499, "the client closed the connection before the answer",
                       code="client_closed_request") from None


class _Digits(str):
    """An integer literal int() refuses, kept as its digits to find where it was."""


def huge_integer(text: str, exc: ValueError) -> APIError:
    """The error naming the field that holds an integer too long to parse."""
    def digits(literal: str):
        try:
            return int(literal)
        except ValueError:
            return _Digits(literal)
    try:
        data = json.loads(text, parse_int=digits)
    except RecursionError:
        return bad_request("request body nests arrays or objects too deeply", code="invalid_json")
    if not isinstance(data, dict):
        return bad_request("request body must be a JSON object", code="invalid_json")
    found = next(((where, s) for where, s, _ in _strings(data) if isinstance(s, _Digits)), None)
    if found is None:
        return bad_request(f"request body is not valid JSON: {exc}", code="invalid_json")
    where, literal = found
    return bad_request(f"{where}: an integer of {len(literal.lstrip('-'))} digits is out of range", param=where)


# A JSON escape can spell half of a UTF-16 pair (\ud800): a string Python holds but UTF-8
# cannot, which would fail wherever the field is next written (a log, an error, a wire).
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


def refuse_lone_surrogates(data) -> None:
    for where, s, is_key in _strings(data):
        try:
            s.encode("utf-8")
        except UnicodeEncodeError as exc:
            what = f"a key of {where or 'the request body'}" if is_key else where
            raise bad_request(f"{what} holds an unpaired UTF-16 surrogate (U+{ord(s[exc.start]):04X}) at character "
                              f"{exc.start}: not valid Unicode", param=where or None, code="invalid_unicode") from None


def _strings(data):
    """(where, string, is_key) for every key and string in parsed JSON, `where` a field
    path as errors name it ("messages.0.content"); a key is placed at its object, so a
    bad key is named before any path that spells it."""
    stack = [("", data)]
    while stack:
        where, node = stack.pop()
        if isinstance(node, str):
            yield where, node, False
        elif isinstance(node, dict):
            for k, v in node.items():
                yield where, k, True
                stack.append((f"{where}.{k}" if where else k, v))
        elif isinstance(node, list):
            stack.extend((f"{where}.{i}" if where else str(i), v) for i, v in enumerate(node))


def parse(model: type[BaseModel], data: dict):
    try:
        return model.model_validate(data)
    except RecursionError:
        raise bad_request("request body nests arrays or objects too deeply") from None
    except ValidationError as exc:
        errors = exc.errors()
        # An unknown field is named as OpenAI names it, whatever else is wrong.
        tags = getattr(model, "union_tags", frozenset())
        extra = next((e for e in errors if e["type"] == "extra_forbidden"), None)
        if extra is not None:
            raise unsupported(field_path(extra["loc"], tags)) from None
        known = next((e for e in errors if e["type"] == "not_implemented"), None)
        if known is not None:           # a field or part OpenAI has and this server does not
            loc = field_path(known["loc"], tags)
            raise unsupported(loc, f"{loc}: {known['msg']}") from None
        err = errors[0]
        loc = field_path(err["loc"], tags)
        msg = err["msg"].removeprefix("Value error, ")          # pydantic's, of a validator's ValueError
        raise bad_request(f"{loc}: {msg}" if loc else msg, param=loc or None) from None


def field_path(loc: tuple, tags: frozenset[str] = frozenset()) -> str:
    """A validation error's place as the request spells it ("messages.0.content.0"),
    without pydantic's names for the member of a union it tried ("list[TextPart]",
    "NamedToolChoice", or one of a model's `union_tags` after a list index), which are
    no field of the request."""
    kept = [p for i, p in enumerate(loc)
            if not (isinstance(p, str) and (p in _model_names() or "[" in p
                                            or (p in tags and i > 0 and isinstance(loc[i - 1], int))))]
    return ".".join(str(p) for p in kept)


@functools.cache
def _model_names() -> frozenset[str]:
    names, todo = set(), [BaseModel]
    while todo:
        for sub in todo.pop().__subclasses__():
            names.add(sub.__name__)
            todo.append(sub)
    return frozenset(names)
