"""The public gRPC `Generate` API: same validation, same pipeline as HTTP."""
from __future__ import annotations

import logging

import grpc

from services.common.security import KeyCheck
from services.router.access import AccessLog
from services.router.admission import TENANT
from services.router.frontend import FrontEnd, choices
from services.router.generation import Generation, new_request_id
from services.router.http_input import usable_request_id
from services.engine.core.sampling import MAX_STOP
from services.router.protocol import MAX_CHOICES, APIError, bad_request
from services.router.reasoning import Thinking, ThinkingStream, thought_and_answer
from services.router import beam_search, structured
from services.router.sampling import resolve_sampling
from services.rpc import generate_pb2, generate_pb2_grpc
from services.worker.wire import ERROR_CODE_KEY, logprob_to_proto

log = logging.getLogger(__name__)
_ROLES = {"system", "developer", "user", "assistant", "tool"}
GENERATE = "/pdserve.v1.Generator/Generate"


def _usage(gen: Generation, sent: int | None = None) -> generate_pb2.Usage:
    """A choice's usage so far: its prompt's tokens, its output's (`sent`: those the
    caller has been sent, where more may be queued behind them), and of those its
    thinking."""
    completion = gen.completion_tokens if sent is None else sent
    thinking = min(gen.thinking.count, completion) if gen.thinking is not None else 0
    return generate_pb2.Usage(prompt_tokens=len(gen.prompt_ids), completion_tokens=completion,
                              reasoning_tokens=thinking)


INTERNAL = APIError(500, "internal error", type_="server_error", grpc_code="INTERNAL")


async def _abort(context, exc: APIError, request_id: str) -> None:
    """End the call with `exc`'s status, and in its trailing metadata what HTTP says in
    headers and body: the request id, a refusal's retry-after, the error's code."""
    trailing = [("x-request-id", request_id)]
    trailing += [(k.lower(), v) for k, v in (exc.headers or {}).items() if k.lower() == "retry-after"]
    if exc.code:
        trailing.append((ERROR_CODE_KEY, exc.code))
    context.set_trailing_metadata(tuple(trailing))
    await context.abort(getattr(grpc.StatusCode, exc.grpc_code), exc.message)


class GeneratorService(generate_pb2_grpc.GeneratorServicer):
    def __init__(self, fe: FrontEnd, keys: KeyCheck | None = None) -> None:
        self.fe = fe
        self.keys = keys
        self.access = AccessLog(fe.cluster.metrics)

    async def _prompt(self, request: generate_pb2.GenerateRequest) -> list[int]:
        kind = request.WhichOneof("input")
        if kind == "prompt":
            if not request.prompt:
                raise bad_request("prompt must not be empty", param="prompt")
            return await self.fe.tokenize_prompt(request.prompt)
        if kind == "chat":
            msgs = request.chat.messages
            if not msgs:
                raise bad_request("messages must not be empty", param="messages")
            for m in msgs:
                if m.role not in _ROLES:
                    raise bad_request(f"unknown role {m.role!r}", param="messages")
            return await self.fe.tokenize_chat([{"role": m.role, "content": m.content} for m in msgs])
        if kind == "prompt_token_ids":
            return await self.fe.tokenize_prompt(list(request.prompt_token_ids.ids))
        raise bad_request("one of prompt, chat or prompt_token_ids is required", param="input")

    async def _generations(self, request: generate_pb2.GenerateRequest,
                           request_id: str) -> tuple[list[Generation], Thinking | None]:
        """The request's choices, and where a chat's thinking is told from its answer
        (--reasoning-parser; None: no parser, or not a chat)."""
        self.fe.check_model(request.model)
        prompt_ids = await self._prompt(request)
        s = request.sampling
        opt = lambda name: getattr(s, name) if s.HasField(name) else None  # noqa: E731
        if len(s.stop) > MAX_STOP:                  # empty ones count, as over HTTP
            raise bad_request(f"at most {MAX_STOP} stop sequences", param="sampling.stop")
        structure = await structured.resolve(self.fe, [
            (f"sampling.{name}", kind, value) for name, kind, value in (
                ("json_schema", "json", s.json_schema), ("regex", "regex", s.regex), ("grammar", "grammar", s.grammar),
                ("structural_tag", "structural_tag", s.structural_tag), ("choice", "choice", list(s.choice)))
            if value])
        params = resolve_sampling(
            prompt_len=len(prompt_ids), max_model_len=self.fe.max_model_len, vocab_size=self.fe.vocab_size,
            max_tokens=opt("max_tokens"), temperature=opt("temperature"), top_p=opt("top_p"), top_k=opt("top_k"),
            seed=opt("seed"), stop=[x for x in s.stop if x], ignore_eos=s.ignore_eos, min_tokens=s.min_tokens,
            presence_penalty=opt("presence_penalty"), frequency_penalty=opt("frequency_penalty"),
            repetition_penalty=opt("repetition_penalty"), min_p=opt("min_p"), logit_bias=dict(s.logit_bias),
            stop_token_ids=list(s.stop_token_ids), logprobs=opt("logprobs"), structure=structure,
            prompt_logprobs=opt("prompt_logprobs"),
            allowed_token_ids=list(s.allowed_token_ids) or None, bad_words=[list(w.ids) for w in s.bad_words],
            cache_salt=self.fe.cache_salt(s.cache_salt), prompt_param=request.WhichOneof("input"),
            defaults=self.fe.sampling_defaults, structure_start=self.fe.grammar_start(prompt_ids, structure))
        if not 0 <= request.n <= MAX_CHOICES:
            raise bad_request(f"n must be between 1 and {MAX_CHOICES}, got {request.n}", param="n")
        # The router names the request itself: the caller's id is only echoed back.
        gens = choices(request_id, prompt_ids, params, request.n or 1)
        thinking = self.fe.thinking_of(prompt_ids) if request.WhichOneof("input") == "chat" else None
        for gen in gens:
            gen.client_id = request.request_id
            if thinking is not None:
                gen.thinking = self.fe.thinking_tokens(thinking)
        return gens, thinking

    async def _beams(self, request: generate_pb2.GenerateRequest, gens: list[Generation], thinking: Thinking | None,
                     tenant: str, echoed: str, seconds: float | None) -> list[generate_pb2.GenerateResponse]:
        """A beam search's choices (use_beam_search: `n` beams), one message each, best
        first, once all are found, within `seconds` (the call's deadline)."""
        s = request.sampling
        found, results = await beam_search.searched(
            self.fe, [gens], request.n or 1, s.length_penalty if s.HasField("length_penalty") else 1.0, tenant,
            seconds=seconds, thinking=thinking)
        out = []
        for i, (gen, result) in enumerate(zip(found, results)):
            reasoning, text = thought_and_answer(thinking, result.text)
            out.append(generate_pb2.GenerateResponse(
                request_id=echoed, text=text, reasoning=reasoning or "", token_ids=result.token_ids,
                finish_reason=gen.finish_reason or "", index=i, usage=_usage(gen),
                logprobs=[logprob_to_proto(lp) for lp in result.logprobs] if gen.params.logprobs is not None else []))
        return out

    def _tenant(self, context) -> str:
        """The caller's API key's tenant (RequireBearer has let only accepted keys in)."""
        if not self.keys:
            return ""
        authorization = next((v for k, v in context.invocation_metadata() or () if k == "authorization"), None)
        return self.keys.tenant_of_header(authorization if isinstance(authorization, str) else None)

    async def Generate(self, request, context):
        given = next((v for k, v in context.invocation_metadata() or () if k == "x-request-id"), None)
        own = new_request_id("gen")
        # What the caller reads back: its own id, from the request or the metadata, else
        # the router's for the request (not a choice's: n > 1 names each "<id>-<i>").
        echoed, trailing = request.request_id or given or own, given or request.request_id or own
        if not usable_request_id(trailing.encode("utf-8", "replace")):    # metadata takes visible ASCII alone
            trailing = own
        with self.access.grpc_call(GENERATE, context) as call:
            call.request_id = trailing
            tenant = self._tenant(context)
            TENANT.set(tenant)                  # the tokenizer's turns
            try:
                gens, thinking = await self._generations(request, own)
                if request.sampling.use_beam_search:
                    for m in await self._beams(request, gens, thinking, tenant, echoed, context.time_remaining()):
                        yield m
                    context.set_trailing_metadata((("x-request-id", trailing),))
                    return
                running = self.fe.start(gens, context.time_remaining(), tenant)
            except APIError as exc:
                await _abort(context, exc, trailing)
            except Exception:                   # no Python error text to the caller (as HTTP's 500)
                log.exception("request %s failed", own)
                await _abort(context, INTERNAL, trailing)
            gen = gens[0]
            scored = gen.params.prompt_logprobs is not None       # sent with choice 0's first message
            split = [ThinkingStream(thinking) for _ in gens] if thinking is not None else None
            sent = [0] * len(gens)
            try:
                async for d in running.deltas():
                    sent[d.index] += len(d.token_ids)
                    prompt = None
                    if scored and d.index == 0:
                        prompt, scored = [logprob_to_proto(lp) for lp in gen.prompt_logprobs or ()], False
                    reasoning, text = ("", d.text) if split is None else split[d.index].feed(
                        d.text, final=bool(d.finish_reason))
                    yield generate_pb2.GenerateResponse(
                        request_id=echoed, text=text, reasoning=reasoning, token_ids=d.token_ids,
                        finish_reason=d.finish_reason or "", index=d.index, usage=_usage(gens[d.index], sent[d.index]),
                        logprobs=[logprob_to_proto(lp) for lp in d.logprobs or ()], prompt_logprobs=prompt)
            except APIError as exc:
                await _abort(context, exc, trailing)
            context.set_trailing_metadata((("x-pdserve-route", gen.route()),
                                           ("x-request-id", trailing)))
