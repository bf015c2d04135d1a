"""How a chat or text completion's generations become OpenAI's answer: one JSON body with
its choices, usage and logprobs, or a stream of server-sent chunks. A `Shape` says what
the answer looks like besides its text (chat or completion, tool calls, echo, `n`)."""
from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass
from typing import AsyncIterator, Callable

from fastapi.responses import JSONResponse, Response, StreamingResponse

from services.engine.core.sampling import TokenLogprob
from services.router.frontend import Collected, FrontEnd, RunningRequest
from services.router.http_input import error_response
from services.router.generation import Delta, Generation
from services.router.output_text import TextOptions
from services.router.protocol import APIError, CommonRequest
from services.router.reasoning import Thinking, ThinkingStream
from services.router.tool_syntax import split
from services.router.tools import ToolPlan, new_call, parse_calls


def sse(obj) -> bytes:
    return b"data: " + sse_json(obj).encode() + b"\n\n"


# Characters JSON leaves raw but Unicode calls line breaks: a client that splits the
# stream with str.splitlines (httpx's iter_lines does) would cut an event at them.
_UNICODE_BREAKS = re.compile("[\x85\u2028\u2029]")


def sse_json(obj) -> str:
    """`obj` as the JSON of one SSE data line: UTF-8 as it is, but for the characters
    other than CR and LF that some clients take for line ends, which are escaped."""
    text = json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    if not text.isascii() and _UNICODE_BREAKS.search(text):
        text = _UNICODE_BREAKS.sub(lambda m: f"\\u{ord(m.group()):04x}", text)
    return text


# What a stream sends while it waits (--sse-keepalive-seconds): a blank line, which ends
# no event, so every SSE client passes over it. A comment (": keep-alive") is the usual
# choice, but a client that strips each network read before splitting events on blank
# lines (vLLM's `bench serve`) glues a comment that arrives alone to the next event and
# loses the rest of the stream: a first token later than the keep-alive failed there.
SSE_KEEPALIVE = b"\n"


def usage(gens: list[Generation], n: int = 1, sent: list[int] | None = None) -> dict:
    """Summed over the request's prompts (`gens`: n choices per prompt, in order); with
    `sent`, each choice's output tokens sent so far, not all made (and of its thinking's,
    no more than those)."""
    prompts = [gens[i:i + n] for i in range(0, len(gens), n)]
    p = sum(len(g[0].prompt_ids) for g in prompts)
    made = [g.completion_tokens for g in gens] if sent is None else sent
    c = sum(made)
    out = {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
           "prompt_tokens_details": {"cached_tokens": sum(max(g.cached_tokens for g in gs) for gs in prompts)}}
    if gens[0].thinking is not None:            # --reasoning-parser: the thinking's share, as vLLM gives it
        out["completion_tokens_details"] = {"reasoning_tokens": sum(min(g.thinking.count, m)
                                                                    for g, m in zip(gens, made))}
    return out


@dataclass(frozen=True)
class TokenName:
    """How logprobs name a token: `name(token_id)` its text, `name.bytes(token_id)` the
    bytes OpenAI's chat logprobs give beside it."""
    text: Callable[[int], str]
    bytes: Callable[[int], list[int]]

    def __call__(self, token_id: int) -> str:
        return self.text(token_id)


def token_names(fe: FrontEnd, as_ids: bool) -> TokenName:
    """How logprobs name a token: its text, or vLLM's "token_id:N" (return_tokens_as_token_ids)."""
    if as_ids:
        return TokenName(lambda t: f"token_id:{t}", lambda t: list(f"token_id:{t}".encode()))
    return TokenName(fe.token_text, fe.token_bytes)


def chat_logprobs(name: TokenName, logprobs: list[TokenLogprob]) -> dict:
    def entry(token_id: int, logprob: float) -> dict:
        return {"token": name(token_id), "logprob": logprob, "bytes": name.bytes(token_id)}
    return {"content": [{**entry(lp.token_id, lp.logprob),
                         "top_logprobs": [entry(t, v) for t, v in zip(lp.top_ids, lp.top_logprobs)]}
                        for lp in logprobs]}


def completion_logprobs(name: TokenName, logprobs: list[TokenLogprob | None], offset: int,
                        token_ids: list[int] | None = None, top: int | None = None) -> dict:
    """OpenAI's completions logprobs; `token_ids` names the tokens where an entry is None
    (an echoed prompt's first token has no log probability); `top` cuts each entry's
    likeliest tokens to that many (a prompt's may have been computed for more). Each
    entry's top tokens include the token itself, as OpenAI's and vLLM's do: up to
    `top` + 1 of them."""
    tokens, offsets = [], []
    for i, lp in enumerate(logprobs):
        tokens.append(name(lp.token_id if lp is not None else token_ids[i]))
        offsets.append(offset)
        offset += len(tokens[-1])

    def likeliest(lp: TokenLogprob) -> dict:
        entry = {name(t): v for t, v in list(zip(lp.top_ids, lp.top_logprobs))[:top]}
        entry.setdefault(name(lp.token_id), lp.logprob)
        return entry
    return {"tokens": tokens, "token_logprobs": [lp and lp.logprob for lp in logprobs],
            "top_logprobs": [lp and likeliest(lp) for lp in logprobs], "text_offset": offsets}


def prompt_logprobs(name: TokenName, leader: Generation, top: int) -> list[dict | None]:
    """vLLM's prompt_logprobs: None for the first prompt token, then for each a dict by
    token id of the token itself and the `top` likeliest, each with its log probability,
    its rank (1 = likeliest; null for a token outside the `top` computed) and its text."""
    out: list[dict | None] = [None]
    for token, lp in zip(leader.prompt_ids[1:], leader.prompt_logprobs or ()):
        ranks = {t: r for r, t in enumerate(lp.top_ids[:top], 1)}
        entry = {str(token): {"logprob": lp.logprob, "rank": ranks.get(token), "decoded_token": name(token)}}
        for t, v in list(zip(lp.top_ids, lp.top_logprobs))[:top]:
            entry.setdefault(str(t), {"logprob": v, "rank": ranks[t], "decoded_token": name(t)})
        out.append(entry)
    return out


def echoed_logprobs(leader: Generation) -> list[TokenLogprob | None]:
    """The prompt's logprobs, for `echo` with `logprobs`: None for its first token. The
    prompt's first choice has them (its prompt is the one computed)."""
    return [None, *(leader.prompt_logprobs or ())]


@dataclass(frozen=True)
class Shape:
    """What a response looks like besides its choices' text."""
    chat: bool
    names: TokenName                    # how logprobs name a token (token_names)
    tools: ToolPlan | None = None
    echo: tuple[str, ...] = ()          # each prompt (chat: the last message), returned before its choices' text
    echo_only: bool = False             # echo with max_tokens 0: the prompt and nothing else
    n: int = 1                          # choices per prompt: choice index = prompt x n + choice
    prompt_logprobs: int | None = None  # vLLM's prompt_logprobs: this many likeliest per prompt token
    thinking: Thinking | None = None    # chat: a reasoning model's thinking told from its content

    def leader(self, gens: list[Generation], index: int) -> Generation:
        """The first choice of choice `index`'s prompt (it holds the prompt's logprobs)."""
        return gens[index - index % self.n]


def text_options(req: CommonRequest) -> TextOptions:
    return TextOptions(req.skip_special_tokens, req.spaces_between_special_tokens, req.include_stop_str_in_output)


async def respond(fe: FrontEnd, req: CommonRequest, request_id: str, prompts: list[list[Generation]], shape: Shape,
                  tenant: str) -> Response:
    running = fe.start_prompts(prompts, tenant=tenant, text=text_options(req))
    gens = running.gens
    base = base_of(fe, request_id, shape)
    if req.stream:
        return StreamingResponse(stream_events(fe, running, req, base, shape), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    try:
        results = await running.collect()
    except APIError as exc:
        return error_response(exc)
    if shape.echo_only:
        for gen in gens:
            gen.completion_tokens = 0
    return whole_answer(base, gens, results, req, shape, len(prompts))


def base_of(fe: FrontEnd, request_id: str, shape: Shape) -> dict:
    """What every answer and chunk of a request begins with."""
    return {"id": request_id, "object": "chat.completion" if shape.chat else "text_completion",
            "created": int(time.time()), "model": fe.served_model_name}


def whole_answer(base: dict, gens: list[Generation], results: list[Collected], req: CommonRequest, shape: Shape,
                 prompts: int) -> JSONResponse:
    """The answer not streamed: every choice (`gens` and their `results`, `shape.n` a
    prompt, of `prompts`) whole, with the usage."""
    choices = [whole_choice(i, gens, result, req, shape) for i, result in enumerate(results)]
    body = {**base, "choices": choices, "usage": usage(gens, shape.n)}
    if req.return_token_ids and prompts == 1:
        body["prompt_token_ids"] = gens[0].prompt_ids
    if shape.chat and shape.prompt_logprobs is not None:
        body["prompt_logprobs"] = prompt_logprobs(shape.names, gens[0], shape.prompt_logprobs)
    return JSONResponse(body, headers={"x-pdserve-route": ", ".join(g.route() for g in gens)})


def whole_choice(index: int, gens: list[Generation], result: Collected, req: CommonRequest, shape: Shape) -> dict:
    gen, leader = gens[index], shape.leader(gens, index)
    choice: dict = {"index": index, "logprobs": None, "finish_reason": gen.finish_reason,
                    "stop_reason": gen.stop_reason}
    if shape.chat:
        echo = shape.echo[0] if shape.echo else ""
        text = result.text
        message: dict = {"role": "assistant", "content": echo + text}
        if shape.thinking is not None:
            reasoning, answer = shape.thinking.split(text)
            text = answer or ""
            message["content"] = echo + text if echo or answer is not None else None
            if req.include_reasoning:
                message["reasoning"] = message["reasoning_content"] = reasoning
        if shape.tools is not None:
            content, calls = parse_calls(shape.tools, text)
            message["content"] = echo + (content or "") if echo else content
            if calls:
                message["tool_calls"] = calls
                if shape.tools.mode != "named" and gen.finish_reason == "stop":
                    choice["finish_reason"] = "tool_calls"
        choice["message"] = message
        if gen.params.logprobs is not None:
            choice["logprobs"] = chat_logprobs(shape.names, result.logprobs)
    else:
        if shape.echo_only:                     # max_tokens 0: the prompt alone
            result = Collected("", [], [])
            choice["finish_reason"] = "length"
        echo = shape.echo[index // shape.n] if shape.echo else ""
        choice["text"] = echo + result.text
        if gen.params.logprobs is not None:
            lps = (echoed_logprobs(leader) if shape.echo else []) + result.logprobs
            choice["logprobs"] = completion_logprobs(shape.names, lps, 0, gen.prompt_ids, gen.params.logprobs)
        if shape.prompt_logprobs is not None:
            choice["prompt_logprobs"] = prompt_logprobs(shape.names, leader, shape.prompt_logprobs)
        if req.return_token_ids:
            choice["prompt_token_ids"] = gen.prompt_ids        # vLLM's place for it
    if req.return_token_ids:
        choice["token_ids"] = result.token_ids
    return choice


async def stream_events(fe: FrontEnd, running: RunningRequest, req: CommonRequest, base: dict,
                        shape: Shape) -> AsyncIterator[bytes]:
    gens = running.gens
    chat = shape.chat
    base = {**base, "object": "chat.completion.chunk" if chat else "text_completion"}
    options = req.stream_options
    with_usage = bool(options and options.include_usage)
    every_usage = bool(with_usage and options.continuous_usage_stats)
    tools = shape.tools
    thinking = [ThinkingStream(shape.thinking) for _ in gens] if shape.thinking is not None else None
    # "auto" and "required": content streams, calls go out whole or in parts (ToolPlan.stream)
    calls = [tools.stream() for _ in gens] if tools is not None and not tools.streams_arguments else []
    offsets = [0] * len(gens)                     # completions: where each choice's text is
    # Output tokens sent so far, per choice: continuous usage counts these (vLLM's role
    # chunk, before the first token, counts none), not those made and still queued.
    sent = [0] * len(gens)

    def usage_so_far(index: int | None = None) -> dict:
        """A chunk's usage field, where the request asked for one: continuous usage counts
        the chunk's own choice (its prompt and the tokens it sent), as vLLM's does; a chunk
        of no choice, the request's."""
        if not with_usage:
            return {}
        if not every_usage:
            return {"usage": None}
        if index is None:
            return {"usage": usage(gens, shape.n, sent)}
        return {"usage": usage([gens[index]], 1, [sent[index]])}

    def chunk(index: int, delta: dict | None = None, text: str = "", finish: str | None = None,
              token_ids: list[int] | None = None, logprobs: list[TokenLogprob] | None = None,
              prompt_ids: list[int] | None = None) -> bytes:
        choice: dict = {"index": index, "logprobs": None, "finish_reason": finish}
        if finish:
            choice["stop_reason"] = gens[index].stop_reason
        if chat:
            choice["delta"] = delta or {}
            if logprobs:
                choice["logprobs"] = chat_logprobs(shape.names, logprobs)
        else:
            choice["text"] = text
            if logprobs:
                choice["logprobs"] = completion_logprobs(shape.names, logprobs, offsets[index],
                                                         gens[index].prompt_ids, gens[index].params.logprobs)
            offsets[index] += len(text)
            if prompt_ids is not None:
                choice["prompt_token_ids"] = prompt_ids
        if token_ids is not None:
            choice["token_ids"] = token_ids
        event = {**base, "choices": [choice]}
        if finish:
            # The route is known only once the choice is done: it rides on its last chunk.
            event["pdserve_route"] = gens[index].route()
        return sse({**event, **usage_so_far(index)})

    def content(index: int, d: Delta) -> dict:
        if thinking is None:
            return answer(index, d.text, d)
        reasoning, text = thinking[index].feed(d.text, final=bool(d.finish_reason))
        if not reasoning or not req.include_reasoning:
            return answer(index, text, d) if text or not reasoning else {}
        delta = answer(index, text, d) if text else {}
        return {"reasoning": reasoning, "reasoning_content": reasoning, **delta}

    def answer(index: int, text: str, d: Delta) -> dict:
        if tools is None:       # a chunk per delta, text or not: clients time tokens by chunks
            return {"content": text} if text or d.token_ids else {}
        if tools.streams_arguments:
            return {"tool_calls": [{"index": 0, "function": {"arguments": text}}]} if text else {}
        return calls_delta(index, calls[index].pieces(text))

    def calls_delta(index: int, pieces: list) -> dict:
        """A delta of a calls stream's pieces: its text as content, each whole call (the
        calls counted so far end with them), and each call's parts as they come (an
        opening with the name, then its arguments), one entry a call."""
        text, found = split(pieces)
        delta: dict = {"content": text} if text else {}
        first = calls[index].calls - len(found)
        entries: dict[int, dict] = {}
        for piece in pieces:
            if isinstance(piece, str):
                continue
            if isinstance(piece, dict):
                entries[first] = {"index": first, **piece}
                first += 1
            elif piece.kind == "open":
                entries[piece.index] = {"index": piece.index, **piece.call}
            elif piece.kind == "arguments":
                entry = entries.setdefault(piece.index, {"index": piece.index, "function": {"arguments": ""}})
                entry["function"] = {**entry["function"], "arguments": entry["function"]["arguments"] + piece.text}
        if entries:
            delta["tool_calls"] = list(entries.values())
        return delta

    def closing(index: int, finish: str) -> tuple[dict, str]:
        """A choice's last delta: what its calls stream held to the end (a call still
        open, text that might have begun one)."""
        if tools is None or tools.streams_arguments:
            return {}, finish
        return calls_delta(index, calls[index].close()), \
            "tool_calls" if calls[index].calls and finish == "stop" else finish

    started = set()
    single = len(gens) == shape.n                  # one prompt: its ids go in a chunk of their own
    try:
        async for d in running.deltas(fe.sse_keepalive):
            if d is None:
                yield SSE_KEEPALIVE
                continue
            i = d.index
            ids = d.token_ids if req.return_token_ids else None
            if i not in started:
                # The role chunk goes out with the first token, as vLLM's and OpenAI's do:
                # clients time the first token from the first chunk.
                started.add(i)
                if ids is not None and single and not started - {i}:
                    yield sse({**base, "choices": [], "prompt_token_ids": gens[0].prompt_ids, **usage_so_far()})
                prompt_ids = gens[i].prompt_ids if ids is not None and not single else None
                if chat:
                    first = {"role": "assistant", "content": shape.echo[0] if shape.echo else ""}
                    if tools is not None and tools.streams_arguments:
                        first = {"role": "assistant", "content": None, "tool_calls": [
                            {"index": 0, **new_call(tools.name, "")}]}
                    yield chunk(i, first)
                elif shape.echo:
                    prompt = echoed_logprobs(shape.leader(gens, i)) if gens[i].params.logprobs is not None else None
                    yield chunk(i, text=shape.echo[i // shape.n], logprobs=prompt, prompt_ids=prompt_ids)
                elif prompt_ids is not None:
                    yield chunk(i, prompt_ids=prompt_ids)
            if shape.echo_only:
                if d.finish_reason:
                    gens[i].completion_tokens = 0
                    yield chunk(i, finish="length")
                continue
            sent[i] += len(d.token_ids)
            # The last token and the finish reason go out in one chunk, as vLLM sends them
            # (clients that time tokens by chunks would count a separate finish as a token),
            # unless the finish brings a delta of its own (tool calls known at the end).
            if chat:
                delta = content(i, d)
                last, finish = closing(i, d.finish_reason) if d.finish_reason else ({}, None)
                if finish and not last:
                    yield chunk(i, delta, token_ids=ids, logprobs=d.logprobs, finish=finish)
                    continue
                if delta or ids or d.logprobs:
                    yield chunk(i, delta, token_ids=ids, logprobs=d.logprobs)
                if finish:
                    yield chunk(i, last, finish=finish)
            elif d.text or d.token_ids or d.logprobs or d.finish_reason:
                yield chunk(i, text=d.text, token_ids=ids, logprobs=d.logprobs, finish=d.finish_reason)
        if with_usage:
            yield sse({**base, "choices": [], "usage": usage(gens, shape.n)})
    except APIError as exc:
        yield sse(exc.body())
    yield b"data: [DONE]\n\n"
