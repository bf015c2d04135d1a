"""OpenAI-compatible HTTP front end: /v1/chat/completions, /v1/completions, /v1/responses,
/v1/models, vLLM's /tokenize, /detokenize and /tokenizer_info, plus /health, /ready and
/metrics; Anthropic's /v1/messages and /v1/messages/count_tokens; SageMaker's
/invocations. Requests run as
`RunningRequest` tasks (frontend.py), so a client that disconnects cancels its request on
every worker; choices.py writes the completions' answers.

With API keys, every route but /health, /ping and /ready (and /metrics, unless protected) needs
`Authorization: Bearer <key>`. JSON routes take only `Content-Type: application/json`
bodies: a web page can post a form or text/plain to a server on its visitor's machine
without asking, but not JSON. CORS is off unless origins are allowed."""
from __future__ import annotations

import dataclasses
import logging
import time

from fastapi import FastAPI, Request
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel

from services.common.security import KeyCheck
from services.common.version import VERSION
from services.router.access import AccessLogMiddleware
from services.router.choices import Shape, respond, text_options, token_names
from services.router.frontend import FrontEnd, choices
from services.router.http_input import (HTTP_CODES, error_response, RequireAPIKey, RequestId, read_json, parse,
                                       unless_disconnected)
from services.router.generation import Generation, new_request_id
from services.router.protocol import (APIError, ChatCompletionRequest, CommonRequest, CompletionRequest,
                                      DetokenizeRequest, TokenizeRequest, bad_request, unsupported)
from services.router.messages import (CountTokensRequest, MessagesRequest, MessageWriter, in_messages_terms,
                                      new_message_id)
from services.router.responses import ResponsesRequest, ResponseWriter, in_responses_terms, new_response_id
from services.router import beam_search, structured
from services.router.reasoning import Thinking
from services.router.sampling import resolve_sampling
from services.router.structured import Structure
from services.router.tools import ToolPlan, plan_tools

log = logging.getLogger(__name__)

async def generations(fe: FrontEnd, req: CommonRequest, request_id: str, prompt_ids: list[int],
                      max_tokens: int | None, logprobs: int | None, structure: Structure | None,
                      prompt_logprobs: int | None = None, prompt_param: str = "messages",
                      structure_param: str | None = None) -> list[Generation]:
    """One prompt's generations, one per choice (`n`); `structure_param`: the field that
    asked for `structure`."""
    bad_words = await fe.tokenize_bad_words(req.bad_words) if req.bad_words else ()
    params = resolve_sampling(
        prompt_len=len(prompt_ids), max_model_len=fe.max_model_len, vocab_size=fe.vocab_size,
        max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, seed=req.seed,
        stop=req.stop or (), ignore_eos=req.ignore_eos, min_tokens=req.min_tokens,
        presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
        repetition_penalty=req.repetition_penalty, min_p=req.min_p, logit_bias=req.logit_bias,
        stop_token_ids=req.stop_token_ids or (), logprobs=logprobs, structure=structure,
        prompt_logprobs=prompt_logprobs, allowed_token_ids=req.allowed_token_ids, bad_words=bad_words,
        cache_salt=fe.cache_salt(req.cache_salt), prompt_param=prompt_param, defaults=fe.sampling_defaults,
        structure_start=fe.grammar_start(prompt_ids, structure))
    gens = choices(request_id, prompt_ids, params, req.choices)
    for gen in gens:
        gen.structure_param = structure_param
    return gens


async def chat_generations(fe: FrontEnd, req: ChatCompletionRequest,
                           request_id: str) -> tuple[list[Generation], ToolPlan | None, Thinking | None]:
    """A chat request's generations, its tool plan (None: no tools), and how its answers'
    thinking is told from their content (None: no --reasoning-parser)."""
    req.check()
    tools = plan_tools(req, fe.supports_tools, fe.tool_call_parser)
    if tools is not None and tools.mode == "auto" and tools.syntax.special_tokens:
        req.skip_special_tokens = False         # the calls' marks are special tokens (Mistral's), as vLLM keeps them
    asked = structured.asked(req)
    structure, structure_param = await structured.resolve(fe, asked), asked[0][0] if asked else None
    if tools is not None and tools.schema:
        structure, structure_param = ("json_schema", await fe.check_schema(tools.schema, "tools")), "tools"
    elif tools is not None and tools.grammar_calls and structure is not None and structure[0] == "json_schema":
        structure = structured.with_calls(structure, tools.tools, tools.syntax, one_call=tools.one_call)
        tools = dataclasses.replace(tools, held=tools.json_calls)
    elif tools is not None and tools.grammar_calls and structure is None and tools.grammar_for_calls(fe.tool_strict_level):
        structure = structured.calls_in_text(tools.tools, tools.syntax, fe.tool_strict_level == "parameter",
                                             tools.one_call)
        tools, structure_param = dataclasses.replace(tools, held=tools.json_calls), "tools"
    prompt_ids = req.truncate(await chat_prompt(fe, req, tools), fe.max_model_len)
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    gens = await generations(fe, req, request_id, prompt_ids, max_tokens, req.top_logprobs_count(), structure,
                             req.prompt_logprobs, structure_param=structure_param)
    thinking = fe.thinking_of(prompt_ids)
    if thinking is not None:
        for gen in gens:
            gen.thinking = fe.thinking_tokens(thinking)
    return gens, tools, thinking


async def chat_prompt(fe: FrontEnd, req: ChatCompletionRequest, tools: ToolPlan | None) -> list[int]:
    """The chat request's prompt ids, through the chat template with its tools and options."""
    return await fe.tokenize_chat([m.for_template() for m in req.messages], tools and tools.tools,
                                  add_generation_prompt=req.add_generation_prompt,
                                  add_special_tokens=req.add_special_tokens,
                                  continue_final_message=req.continue_final_message,
                                  template_kwargs=req.template_kwargs())


def tokenizer_info(fe: FrontEnd) -> dict:
    """vLLM's /tokenizer_info: the tokenizer's configuration (tokenizer_config.json's
    fields), its class and the chat template in use. File paths stay on the server; the
    model's maximum length is the one served."""
    def plain(value):
        if hasattr(value, "content"):                       # an AddedToken
            return value.content
        if isinstance(value, dict):
            return {str(k): plain(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [plain(v) for v in value]
        return value if value is None or isinstance(value, (str, int, float, bool)) else str(value)
    tok = fe.tokenizer
    config = {k: plain(v) for k, v in (getattr(tok, "init_kwargs", None) or {}).items()
              if not k.endswith("_file") and k not in ("name_or_path", "is_local", "local_files_only")}
    config.update(tokenizer_class=type(tok).__name__, name_or_path=fe.served_model_name,
                  model_max_length=fe.max_model_len)
    if isinstance(tok.chat_template, str):
        config["chat_template"] = tok.chat_template
    return config


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
        open_paths = {"/health", "/ping", "/ready"} | (set() if protect_metrics else {"/metrics"})
        app.add_middleware(RequireAPIKey, keys=keys, open_paths=frozenset(open_paths))
    if allowed_origins:                         # outside the key check: preflights carry no key
        app.add_middleware(CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=["GET", "POST"],
                           allow_headers=["authorization", "content-type", "x-request-id", "x-api-key",
                                          "anthropic-version", "anthropic-beta"],
                           expose_headers=["x-pdserve-route", "x-request-id"], max_age=600)
    app.add_middleware(RequestId)
    app.add_middleware(AccessLogMiddleware, metrics=fe.cluster.metrics)     # outside RequestId: sees its header
    _describe_bodies(app, {"/v1/chat/completions": ChatCompletionRequest, "/v1/completions": CompletionRequest,
                           "/v1/responses": ResponsesRequest, "/v1/messages": MessagesRequest,
                           "/v1/messages/count_tokens": CountTokensRequest, "/tokenize": TokenizeRequest,
                           "/detokenize": DetokenizeRequest})

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return error_response(exc, request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        """Unknown paths, wrong methods: the same error object as the rest (OpenAI's;
        Anthropic's on its routes)."""
        return error_response(APIError(exc.status_code, str(exc.detail), code=HTTP_CODES.get(exc.status_code),
                                       headers=dict(exc.headers or {})), request.url.path)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        log.exception("unhandled error on %s", request.url.path)
        return error_response(APIError(500, f"internal error: {type(exc).__name__}", type_="server_error"),
                              request.url.path)

    @app.get("/health")
    @app.head("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/ping")                                      # vLLM's (SageMaker's) liveness route
    @app.post("/ping")
    async def ping():
        return {"status": "ok"}

    @app.get("/ready")
    async def ready():
        """200 once requests can be placed; either way, the healthy workers by role."""
        workers = fe.cluster.pool_sizes()
        if fe.cluster.ready():
            return {"status": "ready", "workers": workers}
        return JSONResponse({"status": "not ready", "detail": f"waiting for {fe.cluster.awaited()}",
                             "workers": workers}, status_code=503)

    @app.get("/metrics")
    @app.head("/metrics")                                   # load generators probe it with HEAD first
    async def metrics():
        return PlainTextResponse(render_metrics(), media_type="text/plain; version=0.0.4")

    @app.get("/version")
    async def version():
        return {"version": VERSION}

    def model_card(name: str) -> dict:
        return {"id": name, "object": "model", "created": started, "owned_by": "pdserve",
                "max_model_len": fe.max_model_len}

    @app.get("/v1/models")
    @app.head("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card(name) for name in fe.model_names]}

    @app.get("/v1/models/{model:path}")                    # the openai client's models.retrieve()
    async def model(model: str):
        fe.check_model(model)
        return model_card(model)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await chat_of(request, await read_json(request, fe.max_body_bytes))

    async def chat_of(request: Request, body: dict):
        req = parse(ChatCompletionRequest, body)
        fe.check_model(req.model)
        request_id = new_request_id("chatcmpl")
        gens, tools, thinking = await chat_generations(fe, req, request_id)
        shape = Shape(chat=True, tools=tools, n=req.choices, prompt_logprobs=req.prompt_logprobs,
                      names=token_names(fe, req.return_tokens_as_token_ids),
                      echo=(req.echoed(),) if req.echoed() else (), thinking=thinking)
        answer = beam_search.respond if req.use_beam_search else respond
        return await unless_disconnected(request, answer(fe, req, request_id, [gens], shape, tenant_of(request)))

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await completion_of(request, await read_json(request, fe.max_body_bytes))

    async def completion_of(request: Request, body: dict):
        req = parse(CompletionRequest, body)
        fe.check_model(req.model)
        req.check()
        logprobs = req.top_logprobs_count()
        # echo with max_tokens 0 (how evaluation harnesses score a text): one token is
        # generated, for the prompt's logprobs, and not returned.
        echo_only = req.echo and req.max_tokens == 0
        scored = [k for k in (logprobs if req.echo else None, req.prompt_logprobs) if k is not None]
        request_id = new_request_id("cmpl")
        asked = structured.asked(req)
        structure = await structured.resolve(fe, asked)
        many = len(req.prompts) > 1
        prompts, echoes = [], []
        for p, prompt in enumerate(req.prompts):
            param = f"prompt.{p}" if many else "prompt"
            ids = await fe.tokenize_prompt(prompt, add_special_tokens=req.add_special_tokens, param=param)
            truncated = req.truncate(ids, fe.max_model_len)
            prompts.append(await generations(fe, req, f"{request_id}-{p}" if many else request_id, truncated,
                                             1 if echo_only else req.max_tokens, logprobs, structure,
                                             prompt_logprobs=max(scored, default=None), prompt_param=param,
                                             structure_param=asked[0][0] if asked else None))
            if req.echo:
                echoes.append(prompt if isinstance(prompt, str) and truncated is ids else
                              fe.tokenizer.decode(truncated, skip_special_tokens=False))
        shape = Shape(chat=False, echo=tuple(echoes), echo_only=echo_only, n=req.choices,
                      prompt_logprobs=req.prompt_logprobs, names=token_names(fe, req.return_tokens_as_token_ids))
        answer = beam_search.respond if req.use_beam_search else respond
        return await unless_disconnected(request, answer(fe, req, request_id, prompts, shape, tenant_of(request)))

    @app.post("/invocations")
    async def invocations(request: Request):
        """SageMaker's inference route, as vLLM serves it: a chat request (`messages`) or a
        completion (`prompt`), told apart by its body. Unlike vLLM's, it needs the API key
        as every other route does."""
        body = await read_json(request, fe.max_body_bytes)
        if "messages" in body:
            return await chat_of(request, body)
        if "prompt" in body:
            return await completion_of(request, body)
        raise bad_request("/invocations takes a chat request (with messages) or a completion (with prompt)",
                          param="messages", code="invalid_invocation")

    async def through_chat(request: Request, req, answer_id: str, writer_of, in_own_terms):
        """A request of another API (Responses, Messages) served as one chat choice: its own
        writer makes the answer, whole or streamed, and errors name its own fields."""
        fe.check_model(req.model)
        req.check()
        try:
            chat_req = req.to_chat()
            (gen,), tools, thinking = await chat_generations(fe, chat_req, answer_id)
            running = fe.start([gen], tenant=tenant_of(request), text=text_options(chat_req))
        except APIError as exc:
            raise in_own_terms(exc) from None
        writer = writer_of(req, answer_id, fe.served_model_name, tools, gen)
        writer.thinking = thinking
        if req.stream:
            return StreamingResponse(writer.events(running, fe.sse_keepalive), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        try:
            (result,) = await unless_disconnected(request, running.collect())
        except APIError as exc:
            return error_response(exc, request.url.path)
        return JSONResponse(writer.whole(result), headers={"x-pdserve-route": gen.route()})

    @app.post("/v1/responses")
    async def responses(request: Request):
        req = parse(ResponsesRequest, await read_json(request, fe.max_body_bytes))
        return await through_chat(request, req, new_response_id(), ResponseWriter, in_responses_terms)

    @app.post("/v1/messages")
    async def messages(request: Request):
        req = parse(MessagesRequest, await read_json(request, fe.max_body_bytes))
        return await through_chat(request, req, new_message_id(), MessageWriter, in_messages_terms)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request):
        """The prompt's tokens as /v1/messages would count them: nothing generated."""
        req = parse(CountTokensRequest, await read_json(request, fe.max_body_bytes))
        fe.check_model(req.model)
        req.check()
        try:
            chat = req.to_chat()
            ids = await chat_prompt(fe, chat, plan_tools(chat, fe.supports_tools, fe.tool_call_parser))
        except APIError as exc:
            raise in_messages_terms(exc) from None
        return {"input_tokens": len(ids)}

    @app.get("/tokenizer_info")
    async def get_tokenizer_info():
        return tokenizer_info(fe)

    # vLLM's tokenizer routes: the ids the completion routes would compute, nothing generated.
    @app.post("/tokenize")
    async def tokenize(request: Request):
        req = parse(TokenizeRequest, await read_json(request, fe.max_body_bytes))
        fe.check_model(req.model)
        if req.messages is None:
            ids = await fe.tokenize_prompt(req.prompt, add_special_tokens=req.special_tokens())
        else:
            tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
            if tools and not fe.supports_tools:
                raise unsupported("tools", "this model's chat template does not support tools")
            ids = await fe.tokenize_chat([m.for_template() for m in req.messages], tools,
                                         add_generation_prompt=req.add_generation_prompt,
                                         add_special_tokens=req.special_tokens(),
                                         continue_final_message=req.continue_final_message,
                                         template_kwargs=req.chat_template_kwargs)
        out = {"count": len(ids), "max_model_len": fe.max_model_len, "tokens": ids}
        if req.return_token_strs:
            out["token_strs"] = fe.tokenizer.convert_ids_to_tokens(ids)
        return out

    @app.post("/detokenize")
    async def detokenize(request: Request):
        req = parse(DetokenizeRequest, await read_json(request, fe.max_body_bytes))
        fe.check_model(req.model)
        return {"prompt": await fe.detokenize(req.tokens)}

    return app


def tenant_of(request: Request) -> str:
    """The tenant RequireAPIKey found for the request's key ("" where no key is required)."""
    return request.scope.get("state", {}).get("tenant", "")
