"""The edge of each front end: every finished HTTP request and gRPC call is counted by
API route and status (`pdserve_requests`) and told in one line on the `pdserve.access`
logger, with what its generation did when it ran one: tokens, time to first token and
the route it took (`Generation.route()`).

A generation is made deep inside a route handler, which the edge cannot see into: it
reaches the edge through a context variable holding the call's `Exchange`, set by the
edge before the call runs and filled in by `FrontEnd.start`. Each call runs in a task
of its own, so each sees only its own exchange.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Iterator

from services.common.metrics import RouterMetrics
from services.router.generation import Generation

log = logging.getLogger("pdserve.access")

# Probes and scrapes arrive every few seconds: counted, but logged at debug level only.
QUIET_PATHS = frozenset({"/health", "/ready", "/metrics"})
# The api label of a path no route serves: paths are the client's to choose, labels are not.
OTHER_API = "other"


@dataclass
class Exchange:
    """One HTTP request or gRPC call, as its access-log line tells it."""
    method: str                         # the HTTP method, or "gRPC"
    path: str                           # the HTTP path, or the gRPC method's full name
    api: str                            # pdserve_requests' label: a route served, or OTHER_API
    started: float = field(default_factory=time.monotonic)
    status: str = ""                    # the HTTP status code, or the gRPC status name
    request_id: str = ""                # x-request-id as returned (gRPC: as given)
    generations: list[Generation] = field(default_factory=list)     # one per choice (n)

    def fields(self) -> dict:
        gens = self.generations
        out = {"request_id": self.request_id or (gens[0].request_id if gens else "-"), "method": self.method,
               "path": self.path, "status": self.status, "duration": round(time.monotonic() - self.started, 4)}
        if gens:
            ttfts = [g.ttft for g in gens if g.ttft is not None]
            out.update(response_id=gens[0].request_id, prompt_tokens=len(gens[0].prompt_ids),
                       completion_tokens=sum(g.completion_tokens for g in gens),
                       cached_tokens=max(g.cached_tokens for g in gens),
                       ttft=round(min(ttfts), 4) if ttfts else None,
                       finish_reason=gens[0].finish_reason if len(gens) == 1 else
                       ",".join(str(g.finish_reason) for g in gens),
                       route=", ".join(g.route() for g in gens if g.decision) or None)
            if len(gens) > 1:
                out["choices"] = len(gens)
        return out


_current: ContextVar[Exchange | None] = ContextVar("pdserve_exchange", default=None)


def attach(gen: Generation) -> None:
    """The call being served runs `gen` (nothing to do outside a call, as in unit tests)."""
    exchange = _current.get()
    if exchange is not None:
        exchange.generations.append(gen)


@contextmanager
def unattached() -> Iterator[None]:
    """Generations started in the block are not the call's own choices (a beam search's
    steps: its beams are, attached once found)."""
    token = _current.set(None)
    try:
        yield
    finally:
        _current.reset(token)


class AccessLog:
    def __init__(self, metrics: RouterMetrics) -> None:
        self.metrics = metrics

    @contextmanager
    def track(self, exchange: Exchange) -> Iterator[Exchange]:
        """`exchange` is the current call until the block ends; then it is counted and
        logged. The block sets its status."""
        token = _current.set(exchange)
        try:
            yield exchange
        finally:
            _current.reset(token)
            self.finished(exchange)

    @contextmanager
    def grpc_call(self, method: str, context) -> Iterator[Exchange]:
        """A gRPC call: its status is OK if the block ends, else the code the servicer
        aborted with, CANCELLED when the client went away, UNKNOWN for anything else."""
        with self.track(Exchange("gRPC", method, method)) as exchange:
            try:
                yield exchange
            except (asyncio.CancelledError, GeneratorExit):
                exchange.status = "CANCELLED"
                raise
            except BaseException:
                code = context.code()
                exchange.status = getattr(code, "name", "UNKNOWN")
                raise
            exchange.status = "OK"

    def finished(self, exchange: Exchange) -> None:
        self.metrics.requests.labels(exchange.api, exchange.status).inc()
        fields = {k: v for k, v in exchange.fields().items() if v is not None}
        level = logging.DEBUG if exchange.path in QUIET_PATHS else logging.INFO
        log.log(level, logfmt(fields), extra={"fields": fields})


class AccessLogMiddleware:
    """ASGI middleware: counts and logs every HTTP request. Added after RequestId, so it
    sees the x-request-id that goes out. Plain ASGI, like the others: streams pass
    through untouched, and a stream is logged once its last byte is sent."""

    def __init__(self, app, metrics: RouterMetrics) -> None:
        self.app = app
        self.access = AccessLog(metrics)
        self._paths: frozenset[str] | None = None

    def _api(self, scope) -> str:
        if self._paths is None:                     # the app's routes, known once it serves
            self._paths = frozenset(r.path for r in scope["app"].routes if hasattr(r, "path"))
        return scope["path"] if scope["path"] in self._paths else OTHER_API

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        exchange = Exchange(scope["method"], scope["path"], self._api(scope))

        async def send_noting(message):
            if message["type"] == "http.response.start":
                exchange.status = str(message["status"])
                exchange.request_id = next((v.decode("latin-1") for k, v in message.get("headers", ())
                                            if k.lower() == b"x-request-id"), "")
            await send(message)

        with self.access.track(exchange):
            try:
                await self.app(scope, receive, send_noting)
            except asyncio.CancelledError:
                exchange.status = exchange.status or "499"      # nginx's "client closed request"
                raise
            except BaseException:
                exchange.status = exchange.status or "500"      # what the server error handler sends
                raise


def logfmt(fields: dict) -> str:
    """key=value pairs; a value holding spaces, quotes, '=' or control characters is
    quoted (JSON escapes), so one record stays one line."""
    def value(v) -> str:
        s = str(v)
        return json.dumps(s, ensure_ascii=False) if not s or not s.isprintable() or any(c in s for c in ' ="\\') \
            else s
    return " ".join(f"{k}={value(v)}" for k, v in fields.items())
