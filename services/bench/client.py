"""One streamed request over an OpenAI-compatible HTTP API, timed chunk by chunk.

Completions send the prompt string to /v1/completions; chat sends it as one user
message to /v1/chat/completions (the server's template adds tokens: the record keeps
the server's own prompt count from `usage`). Output tokens come from `usage`, asked for
with stream_options.include_usage; a server that sends none has the text re-tokenised.
With ignore_eos (the default) the body also carries `ignore_eos: true` and
`min_tokens = max_tokens`, as vLLM and pdserve accept; --no-ignore-eos drops both for
servers that refuse unknown fields. `extra` (--extra-body) is merged in last, for a
server's own options. A stream is complete at `data: [DONE]`, or when it closes after a
chunk with a finish_reason (transformers serve sends no [DONE]).
"""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field, replace
from typing import Callable

import httpx

from services.bench.metrics import RequestRecord
from services.bench.workload import BenchRequest

ENDPOINTS = ("completions", "chat")


class EndpointError(Exception):
    """The endpoint could not be reached or did not answer as an OpenAI API does."""


def normalize_base_url(url: str) -> str:
    """http://host:port, also when given with a trailing /v1 or slash."""
    url = url.rstrip("/")
    return url[:-3] if url.endswith("/v1") else url


async def first_model(client: httpx.AsyncClient, base_url: str) -> str:
    try:
        r = await client.get(f"{base_url}/v1/models", timeout=30)
        r.raise_for_status()
        return r.json()["data"][0]["id"]
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as exc:
        raise EndpointError(f"could not ask {base_url}/v1/models for a model "
                            f"({type(exc).__name__}: {exc}); pass --model") from None


@dataclass(frozen=True)
class Endpoint:
    base_url: str
    model: str
    kind: str = "completions"
    ignore_eos: bool = True
    temperature: float = 0.0
    timeout_s: float = 600.0            # the whole request, first byte to last
    extra: dict = field(default_factory=dict)   # merged into every body, over the fields above

    def __post_init__(self) -> None:
        if self.kind not in ENDPOINTS:
            raise ValueError(f"--endpoint must be one of {', '.join(ENDPOINTS)}")

    @property
    def url(self) -> str:
        return f"{self.base_url}/v1/{'chat/completions' if self.kind == 'chat' else 'completions'}"

    def body(self, req: BenchRequest) -> dict:
        body: dict = {"model": self.model, "max_tokens": req.output_len, "temperature": self.temperature,
                      "stream": True, "stream_options": {"include_usage": True}}
        if self.kind == "chat":
            body["messages"] = [{"role": "user", "content": req.prompt}]
        else:
            body["prompt"] = req.prompt
        if self.ignore_eos:
            body["ignore_eos"] = True
            body["min_tokens"] = req.output_len
        body.update(self.extra)
        return body

    def chunk_text(self, chunk: dict) -> str:
        choices = chunk.get("choices") or []
        if not choices:
            return ""
        if self.kind == "chat":
            return (choices[0].get("delta") or {}).get("content") or ""
        return choices[0].get("text") or ""


async def _error_text(response: httpx.Response) -> str:
    raw = (await response.aread()).decode(errors="replace")
    try:
        message = json.loads(raw)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = raw.strip()[:200]
    return f"HTTP {response.status_code}: {message}"


async def send(client: httpx.AsyncClient, endpoint: Endpoint, req: BenchRequest, t0: float,
               count_tokens: Callable[[str], int]) -> RequestRecord:
    """Stream one request; every failure becomes a record with `error` set."""
    sent = time.perf_counter()
    chunk_times: list[float] = []
    text: list[str] = []
    usage: dict | None = None
    error: str | None = None
    try:
        async with asyncio.timeout(endpoint.timeout_s):
            async with client.stream("POST", endpoint.url, json=endpoint.body(req)) as response:
                if response.status_code != 200:
                    error = await _error_text(response)
                else:
                    done = finished = False
                    async for line in response.aiter_lines():
                        if not line.startswith("data:"):
                            continue                    # blank separators, SSE comments
                        data = line[5:].strip()
                        if data == "[DONE]":
                            done = True
                            break
                        chunk = json.loads(data)
                        if chunk.get("error"):
                            error = f"stream error: {chunk['error'].get('message', chunk['error'])}"
                            break
                        if chunk.get("usage"):
                            usage = chunk["usage"]
                        finished = finished or any(c.get("finish_reason") for c in chunk.get("choices") or ())
                        if piece := endpoint.chunk_text(chunk):
                            chunk_times.append(time.perf_counter())
                            text.append(piece)
                    if error is None and not done and not finished:
                        error = "stream ended without [DONE] or a finish_reason"
    except TimeoutError:
        error = f"no complete answer within {endpoint.timeout_s:g} s"
    except Exception as exc:        # any failure of one request is that request's result
        error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    end = time.perf_counter()
    if error is None and not chunk_times:
        error = "the stream carried no output text"
    record = RequestRecord(prompt_len=req.prompt_len, requested_output_len=req.output_len,
                           start=sent - t0, e2e=end - sent, error=error)
    if error is not None:
        return record
    if usage and isinstance(usage.get("completion_tokens"), int):
        output_len, source = usage["completion_tokens"], "usage"
    else:
        output_len, source = count_tokens("".join(text)), "retokenized"
    server_prompt = usage.get("prompt_tokens") if usage else None
    return replace(record, output_len=output_len, output_len_source=source,
                   server_prompt_len=server_prompt if isinstance(server_prompt, int) else None,
                   ttft=chunk_times[0] - sent, itl=tuple(b - a for a, b in zip(chunk_times, chunk_times[1:])))
