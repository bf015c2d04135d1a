"""What the HTTP and gRPC front ends share: model and prompt checks, admission, and
each admitted request running as its own task.

The task feeds a queue that the response reads. Whatever happens to the connection,
the task's `finally` releases the request on every worker; a client that disconnects
cancels the task.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import AsyncIterator

from services.engine.tokenizer import encode_chat, encode_prompt
from services.router.cluster import Cluster, Delta, Generation
from services.router.protocol import APIError, bad_request

log = logging.getLogger(__name__)


@dataclass
class FrontEnd:
    """What the front ends (HTTP and gRPC) share."""
    cluster: Cluster
    tokenizer: object
    served_model_name: str
    max_model_len: int
    max_body_bytes: int

    def check_model(self, model: str | None) -> None:
        if model and model != self.served_model_name:
            raise APIError(404, f"The model `{model}` does not exist. Served: `{self.served_model_name}`.",
                           code="model_not_found", param="model", grpc_code="NOT_FOUND")

    def tokenize_chat(self, messages: list[dict[str, str]]) -> list[int]:
        try:
            return encode_chat(self.tokenizer, messages)
        except Exception as exc:                  # a template that rejects the conversation
            raise bad_request(f"cannot apply the chat template: {exc}", param="messages") from None

    def tokenize_prompt(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, list):
            vocab = len(self.tokenizer)
            if any(not 0 <= t < vocab for t in prompt):
                raise bad_request(f"prompt token ids must be in [0, {vocab})", param="prompt")
            return list(prompt)
        return encode_prompt(self.tokenizer, prompt)

    def start(self, gen: Generation) -> "RunningRequest":
        self.cluster.admit()
        return RunningRequest(self.cluster, gen)


class RunningRequest:
    """A generation running as a task; deltas arrive on a queue."""

    def __init__(self, cluster: Cluster, gen: Generation) -> None:
        self.gen = gen
        self.queue: asyncio.Queue[Delta | APIError | None] = asyncio.Queue()
        self.task = asyncio.create_task(self._run(cluster))

    async def _run(self, cluster: Cluster) -> None:
        metrics = cluster.metrics
        last = None
        try:
            async for delta in cluster.generate(self.gen):
                now = time.monotonic()
                if last is None:
                    metrics.ttft.observe(now - self.gen.started)
                    if self.gen.decision == "remote":       # prefilled by the prefill pool
                        cluster.latency.observe_ttft(self.gen.prefill_epoch, now - self.gen.started)
                else:
                    metrics.itl.observe(now - last)
                    if delta.token_ids:                      # a closing chunk without tokens is no gap
                        cluster.latency.observe_itl(self.gen.decode_epoch, now - last)
                last = now
                self.queue.put_nowait(delta)
            self.queue.put_nowait(None)
        except APIError as exc:
            self.queue.put_nowait(exc)
        except Exception as exc:                      # CancelledError (client gone) passes through
            log.exception("request %s failed", self.gen.request_id)
            self.queue.put_nowait(APIError(500, f"internal error: {exc}", type_="server_error", grpc_code="INTERNAL"))
        finally:
            cluster.done()
            metrics.e2e.observe(time.monotonic() - self.gen.started)
            metrics.prompt_tokens.inc(len(self.gen.prompt_ids))
            metrics.generation_tokens.inc(self.gen.completion_tokens)

    async def deltas(self) -> AsyncIterator[Delta]:
        """Raises the request's APIError if it failed."""
        try:
            while True:
                item = await self.queue.get()
                if item is None:
                    return
                if isinstance(item, APIError):
                    raise item
                yield item
        finally:
            if not self.task.done():
                self.task.cancel()

    async def collect(self) -> tuple[str, list[int]]:
        text, ids = [], []
        async for d in self.deltas():
            text.append(d.text)
            ids.extend(d.token_ids)
        return "".join(text), ids
