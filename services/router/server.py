"""Router process: HTTP (uvicorn) and gRPC in one event loop, sharing one Cluster."""
from __future__ import annotations

import asyncio
import json
import logging
import socket
import time
from pathlib import Path

import uvicorn

from services.common.grpc_server import ServiceHost
from services.common.lifecycle import (announce, cancel_and_wait, settle_garbage_collector, stop_event_on_signals,
                                       stop_within, within)
from services.common.metrics import RouterMetrics
from services.common.security import KeyCheck, RequireBearer, TLSFiles, read_api_keys
from services.common.settings import RouterSettings
from services.engine.text.model_store import context_length, read_config, resolve_model
from services.engine.text.tokenizer import eos_token_ids, load_tokenizer
from services.router.admission import Admission, tenant_policies
from services.router.cluster import Cluster
from services.router.connections import http_protocol
from services.router.grpc_api import GeneratorService
from services.router.frontend import FrontEnd
from services.router.openai_api import create_app
from services.router.sampling import sampling_defaults
from services.router.tools import check_strict_level
from services.router.workers import STOP_SECONDS as WORKERS_STOP_SECONDS
from services.rpc import generate_pb2_grpc

log = logging.getLogger(__name__)
# Seconds the HTTP and gRPC servers wait past --drain-timeout for the last requests to
# write their end (FrontEnd.drain has ended them by then).
STOP_MARGIN = 5.0


async def serve(settings: RouterSettings, stop: asyncio.Event | None = None) -> None:
    """Serve until `stop` is set (default: SIGTERM/SIGINT)."""
    model_dir = resolve_model(settings.model, settings.revision)
    tokenizer = load_tokenizer(model_dir)
    if settings.chat_template:
        tokenizer.chat_template = Path(settings.chat_template).read_text()
    served_model_name, *aliases = settings.served_model_name or [model_dir.name]
    metrics = RouterMetrics(served_model_name)
    api_keys = read_api_keys(settings.api_key, settings.api_key_file)
    admission = Admission(settings.max_pending, tenant_policies(api_keys), lambda: cluster.capacity(), metrics)
    # before any worker is asked: a value no request could take stops the router here
    defaults = sampling_defaults(model_dir, settings.generation_config, settings.generation_overrides)
    check_strict_level(settings.tool_strict_level,
                       settings.tool_call_parser if settings.enable_auto_tool_choice else None)
    if defaults:
        log.warning("a request that leaves them out takes these sampling defaults, the model's generation config "
                    "with --override-generation-config: %s (--generation-config vllm: OpenAI's)",
                    json.dumps(defaults))
    cluster = Cluster(settings, tokenizer, metrics, eos_token_ids(model_dir))
    await cluster.start()
    max_model_len = context_length(read_config(model_dir), settings.max_model_len)
    fe = FrontEnd(cluster, admission, tokenizer, served_model_name, max_model_len, settings.max_body_bytes,
                  settings.request_timeout, sse_keepalive=settings.sse_keepalive_seconds,
                  shared_prefix_cache=settings.shared_prefix_cache, sampling_defaults=defaults,
                  model_aliases=tuple(aliases), reasoning_parser=settings.reasoning_parser,
                  tool_call_parser=settings.tool_call_parser if settings.enable_auto_tool_choice else None,
                  tool_strict_level=settings.tool_strict_level)

    keys = KeyCheck(api_keys)
    tls = TLSFiles(settings.tls_cert, settings.tls_key)
    host = ServiceHost(["pdserve.v1.Generator"], [RequireBearer(keys, "API key")] if keys else None,
                       max_receive_bytes=settings.max_body_bytes, public=True)
    generate_pb2_grpc.add_GeneratorServicer_to_server(GeneratorService(fe, keys), host.server)
    grpc_port = host.bind(settings.host, settings.grpc_port, tls.server_credentials())

    # IPPROTO_TCP named: asyncio turns Nagle off only on connections of a socket that says
    # so, and with Nagle on, a kept-alive connection's response body waits ~40 ms behind
    # its head for the client's delayed ACK (as does every small streamed chunk).
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((settings.host, settings.http_port))
    http_port = sock.getsockname()[1]
    app = create_app(fe, metrics.render, keys, settings.protect_metrics, settings.allowed_origins)
    # log_config=None: uvicorn's records go through the process's own handler (--log-format),
    # not handlers of its own; the access log is pdserve.access (router/access.py).
    # http: h11 with a deadline on request heads and a cap per client address
    # (connections.py); ws="none": no WebSocket routes, so no upgrade either.
    # Stopping, running requests get --drain-timeout (FrontEnd.drain ends what is left with
    # a 503); the servers' own grace comes after that, so nothing is cut off unsaid.
    grace = settings.drain_timeout + STOP_MARGIN
    config = uvicorn.Config(app, log_level=settings.log_level.lower(), timeout_graceful_shutdown=grace,
                            access_log=False,
                            log_config=None, ssl_certfile=settings.tls_cert, ssl_keyfile=settings.tls_key,
                            http=http_protocol(settings.header_timeout, settings.body_timeout,
                                                settings.max_connections_per_client),
                            ws="none")
    http = uvicorn.Server(config)
    # uvicorn's own handlers replace the loop's while it serves and raise the signal again
    # once it has stopped; the loop is told of it either way (its wakeup fd), so `stop`
    # is set at once
    process_ends = stop is None
    if stop is None:
        stop = stop_event_on_signals(asyncio.get_running_loop())
    outside = asyncio.all_tasks()           # the loop's tasks not the router's, which its stop leaves

    await host.server.start()
    await host.set_status(True)
    http_task = asyncio.create_task(http.serve(sockets=[sock]))
    while not http.started and not http_task.done():
        await asyncio.sleep(0.01)
    settle_garbage_collector()
    log.info("router serving HTTP on %s://%s:%d and gRPC%s on %s:%d (model %s; %s)", "https" if tls.cert else "http",
             settings.host, http_port, " over TLS" if tls.cert else "", settings.host, grpc_port,
             fe.served_model_name, "API keys required" if keys else "no API key required")
    announce(settings.announce_file, http_port=http_port, grpc_port=grpc_port)
    try:
        await asyncio.wait([asyncio.create_task(stop.wait()), http_task], return_when=asyncio.FIRST_COMPLETED)
    finally:
        # each part below is bounded; past all of them together (and a margin) the stop is stuck
        bound = 2 * (grace + STOP_MARGIN) + STOP_MARGIN + WORKERS_STOP_SECONDS + 2 * STOP_MARGIN
        with stop_within(bound, process_ends):
            await host.set_status(False)
            fe.drain(settings.drain_timeout)
            http.should_exit = True
            phases = StopClock()
            await within(host.server.stop(grace), grace + STOP_MARGIN, "the gRPC server's stop")
            phases.done("gRPC")
            if not await within(http_task, grace + STOP_MARGIN, "the HTTP server's stop"):
                http.force_exit = True                  # its wait for connections ends at once
                await within(http_task, STOP_MARGIN, "the HTTP server's forced stop")
            phases.done("HTTP")
            await cluster.stop()
            phases.done("workers' channels")
            # what is left (requests parked on their clients' queues, background calls)
            # ends here, bounded, not in asyncio.run's unbounded cancel of every task
            await cancel_and_wait(asyncio.all_tasks() - outside - {asyncio.current_task()}, STOP_MARGIN,
                                  "router stop")
            phases.done("what was left")
            phases.report(grace)
    if http_task.done() and not http_task.cancelled() and http_task.exception() is not None:
        raise http_task.exception()         # the HTTP server failed: the router fails with it


class StopClock:
    """How long each part of a stop took: said at info level, and as a warning when the
    stop ran past the time it is given (so a slow exit names its part)."""

    def __init__(self) -> None:
        self.start = self.mark = time.monotonic()
        self.parts: list[str] = []

    def done(self, part: str) -> None:
        now = time.monotonic()
        self.parts.append(f"{part} {now - self.mark:.2f} s")
        self.mark = now

    def report(self, allowed: float) -> None:
        took = self.mark - self.start
        log.log(logging.WARNING if took > allowed else logging.INFO,
                "router stopped in %.2f s (%s)", took, ", ".join(self.parts))
