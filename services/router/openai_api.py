"""OpenAI-compatible HTTP front end: /v1/chat/completions, /v1/completions, /v1/models,
vLLM's /tokenize and /detokenize, plus /health, /ready and /metrics. Requests run as `RunningRequest` tasks (frontend.py),
so a client that disconnects cancels its request on every worker.

With API keys, every route but /health and /ready (and /metrics, unless protected) needs
`Authorization: Bearer <key>`. JSON routes take only `Content-Type: application/json`
bodies: a web page can post a form or text/plain to a server on its visitor's machine
without asking, but not JSON. CORS is off unless origins are allowed."""
from __future__ import annotations

import json
import logging
import time
import uuid
from typing import AsyncIterator

from fastapi import FastAPI, Request
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError

from services.common.security import KeyCheck
from services.common.version import VERSION
from services.router.cluster import Generation, new_request_id
from services.router.frontend import FrontEnd, RunningRequest
from services.router.protocol import (APIError, ChatCompletionRequest, CommonRequest, CompletionRequest,
                                      DetokenizeRequest, TokenizeRequest, bad_request)
from services.router.sampling import resolve_sampling

log = logging.getLogger(__name__)

_HTTP_CODES = {404: "not_found", 405: "method_not_allowed"}


def error_response(exc: APIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


def route_header(gen: Generation) -> dict[str, str]:
    return {"x-pdserve-route": gen.route()}


def unauthorized(authorization: str | None) -> APIError:
    message = ("You didn't provide an API key: send it as Authorization: Bearer YOUR_KEY." if not authorization
               else "Incorrect API key provided.")
    return APIError(401, message, code="invalid_api_key", grpc_code="UNAUTHENTICATED",
                    headers={"WWW-Authenticate": "Bearer"})


class RequireAPIKey:
    """ASGI middleware: refuses requests without an accepted key, but for open paths.
    Plain ASGI (not BaseHTTPMiddleware): streamed responses and disconnects pass through
    untouched."""

    def __init__(self, app, keys: KeyCheck, open_paths: frozenset[str]) -> None:
        self.app = app
        self.keys = keys
        self.open_paths = open_paths

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in self.open_paths or scope["method"] == "OPTIONS":
            return await self.app(scope, receive, send)
        authorization = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"authorization"), None)
        if self.keys.accepts_header(authorization):
            return await self.app(scope, receive, send)
        await error_response(unauthorized(authorization))(scope, receive, send)


REQUEST_ID_MAX = 128


class RequestId:
    """ASGI middleware: every response carries `x-request-id`, the caller's own (visible
    ASCII, at most 128 characters) or a new one, errors and streams included."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = next((v for k, v in scope["headers"] if k == b"x-request-id"), b"")
        ok = 0 < len(given) <= REQUEST_ID_MAX and all(0x21 <= c <= 0x7E for c in given)
        rid = given if ok else uuid.uuid4().hex.encode()

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), (b"x-request-id", rid)]
            await send(message)
        await self.app(scope, receive, send_with_id)


def check_json_content_type(request: Request) -> None:
    media = request.headers.get("content-type", "").partition(";")[0].strip().lower()
    if media != "application/json":
        raise APIError(415, f"Content-Type must be application/json, not {media or 'missing'}",
                       code="unsupported_media_type")


async def read_json(request: Request, max_bytes: int) -> dict:
    check_json_content_type(request)
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > max_bytes:
        raise bad_request(f"request body of {declared} bytes exceeds the limit of {max_bytes}", code="body_too_large")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > max_bytes:
            raise bad_request(f"request body exceeds the limit of {max_bytes} bytes", code="body_too_large")
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
    if not isinstance(data, dict):
        raise bad_request("request body must be a JSON object", code="invalid_json")
    return data


def parse(model: type[BaseModel], data: dict):
    try:
        return model.model_validate(data)
    except RecursionError:
        raise bad_request("request body nests arrays or objects too deeply") from None
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = ".".join(str(p) for p in err["loc"])
        raise bad_request(f"{loc}: {err['msg']}" if loc else err["msg"], param=loc or None) from None


def sampling_for(fe: FrontEnd, req: CommonRequest, prompt_len: int, max_tokens: int | None):
    return resolve_sampling(prompt_len=prompt_len, max_model_len=fe.max_model_len, max_tokens=max_tokens,
                            temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, seed=req.seed,
                            stop=req.stop or (), ignore_eos=req.ignore_eos, min_tokens=req.min_tokens)


def sse(obj) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


def usage(gen: Generation) -> dict:
    p, c = len(gen.prompt_ids), gen.completion_tokens
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
            "prompt_tokens_details": {"cached_tokens": gen.cached_tokens}}


def _describe_bodies(app: FastAPI, bodies: dict[str, type[BaseModel]]) -> None:
    """The routes read their JSON themselves (for precise errors), so FastAPI cannot see
    their bodies: put the request models into /openapi.json by hand, for clients and for
    schema-driven fuzzing."""
    default = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = default()
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for path, model in bodies.items():
                body = model.model_json_schema(ref_template="#/components/schemas/{model}")
                components.update(body.pop("$defs", {}))
                components[model.__name__] = body
                schema["paths"][path]["post"]["requestBody"] = {"required": True, "content": {
                    "application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}
            app.openapi_schema = schema
        return app.openapi_schema
    app.openapi = openapi


def create_app(fe: FrontEnd, render_metrics, keys: KeyCheck | None = None, protect_metrics: bool = False,
               allowed_origins: list[str] | tuple[str, ...] = ()) -> FastAPI:
    app = FastAPI(title="pdserve", docs_url=None, redoc_url=None)
    started = int(time.time())
    if keys:
        open_paths = {"/health", "/ready"} | (set() if protect_metrics else {"/metrics"})
        app.add_middleware(RequireAPIKey, keys=keys, open_paths=frozenset(open_paths))
    if allowed_origins:                         # outside the key check: preflights carry no key
        app.add_middleware(CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=["GET", "POST"],
                           allow_headers=["authorization", "content-type", "x-request-id"],
                           expose_headers=["x-pdserve-route", "x-request-id"], max_age=600)
    app.add_middleware(RequestId)
    _describe_bodies(app, {"/v1/chat/completions": ChatCompletionRequest, "/v1/completions": CompletionRequest,
                           "/tokenize": TokenizeRequest, "/detokenize": DetokenizeRequest})

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        """Unknown paths, wrong methods: the same OpenAI-style error object as the rest."""
        return error_response(APIError(exc.status_code, str(exc.detail), code=_HTTP_CODES.get(exc.status_code),
                                       headers=dict(exc.headers or {})))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        log.exception("unhandled error on %s", request.url.path)
        return error_response(APIError(500, f"internal error: {type(exc).__name__}", type_="server_error"))

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/ready")
    async def ready():
        if fe.cluster.ready():
            return {"status": "ready"}
        return JSONResponse({"status": "not ready", "detail": "waiting for a prefill and a decode worker"},
                            status_code=503)

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(render_metrics(), media_type="text/plain; version=0.0.4")

    @app.get("/version")
    async def version():
        return {"version": VERSION}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": fe.served_model_name, "object": "model", "created": started,
                                            "owned_by": "pdserve", "max_model_len": fe.max_model_len}]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        req = parse(ChatCompletionRequest, await read_json(request, fe.max_body_bytes))
        fe.check_model(req.model)
        req.unsupported()
        prompt_ids = await fe.tokenize_chat([{"role": m.role, "content": m.text()} for m in req.messages])
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        params = sampling_for(fe, req, len(prompt_ids), max_tokens)
        gen = Generation(new_request_id("chatcmpl"), prompt_ids, params)
        return await respond(fe, req, gen, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = parse(CompletionRequest, await read_json(request, fe.max_body_bytes))
        fe.check_model(req.model)
        req.unsupported()
        prompt_ids = await fe.tokenize_prompt(req.prompt)
        params = sampling_for(fe, req, len(prompt_ids), req.max_tokens)
        gen = Generation(new_request_id("cmpl"), prompt_ids, params)
        return await respond(fe, req, gen, chat=False)

    # vLLM's tokenizer routes: the ids the completion routes would compute, nothing generated.
    @app.post("/tokenize")
    async def tokenize(request: Request):
        req = parse(TokenizeRequest, await read_json(request, fe.max_body_bytes))
        fe.check_model(req.model)
        req.unsupported()
        if req.messages is None:
            ids = await fe.tokenize_prompt(req.prompt, add_special_tokens=req.special_tokens())
        else:
            ids = await fe.tokenize_chat([{"role": m.role, "content": m.text()} for m in req.messages],
                                         req.add_generation_prompt, req.special_tokens())
        return {"count": len(ids), "max_model_len": fe.max_model_len, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        req = parse(DetokenizeRequest, await read_json(request, fe.max_body_bytes))
        fe.check_model(req.model)
        return {"prompt": await fe.detokenize(req.tokens)}

    return app


async def respond(fe: FrontEnd, req: CommonRequest, gen: Generation, chat: bool) -> Response:
    running = fe.start(gen)
    created = int(time.time())
    base = {"id": gen.request_id, "object": "chat.completion" if chat else "text_completion",
            "created": created, "model": fe.served_model_name}
    if not req.stream:
        try:
            text, ids = await running.collect()
        except APIError as exc:
            return error_response(exc)
        choice = {"index": 0, "logprobs": None, "finish_reason": gen.finish_reason}
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        body = {**base, "choices": [choice], "usage": usage(gen)}
        if req.return_token_ids:
            choice["token_ids"] = ids
            body["prompt_token_ids"] = gen.prompt_ids
        return JSONResponse(body, headers=route_header(gen))
    return StreamingResponse(stream_events(running, req, base, chat), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def stream_events(running: RunningRequest, req: CommonRequest, base: dict, chat: bool) -> AsyncIterator[bytes]:
    gen = running.gen
    base = {**base, "object": "chat.completion.chunk" if chat else "text_completion"}
    with_usage = bool(req.stream_options and req.stream_options.include_usage)
    extra = {"usage": None} if with_usage else {}

    def chunk(text: str | None, finish: str | None, token_ids: list[int] | None = None, role: bool = False) -> bytes:
        choice: dict = {"index": 0, "logprobs": None, "finish_reason": finish}
        if chat:
            delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
            choice["delta"] = delta
        else:
            choice["text"] = text or ""
        if token_ids is not None:
            choice["token_ids"] = token_ids
        return sse({**base, "choices": [choice], **extra})

    try:
        first = True
        async for d in running.deltas():
            ids = d.token_ids if req.return_token_ids else None
            if first:
                # The role chunk goes out with the first token, as vLLM's and OpenAI's do:
                # clients time the first token from the first chunk.
                if ids is not None:
                    yield sse({**base, "choices": [], "prompt_token_ids": gen.prompt_ids, **extra})
                if chat:
                    yield chunk(None, None, role=True)
            first = False
            if d.text or ids:
                yield chunk(d.text, None, ids)
            if d.finish_reason:
                yield chunk(None, d.finish_reason)
        if with_usage:
            yield sse({**base, "choices": [], "usage": usage(gen)})
    except APIError as exc:
        yield sse(exc.body())
    yield b"data: [DONE]\n\n"
