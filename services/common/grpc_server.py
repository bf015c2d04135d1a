"""A gRPC aio server with what every pdserve service serves: health and reflection; and
the channel every internal client dials with (credentials in services/common/security.py)."""
from __future__ import annotations

import inspect

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]
# Channels between the cluster's own services: a worker restarted at the same address
# (up, a supervisor, a pod) is reached within half a second. By default a channel that failed
# backs off up to two minutes, and every channel to that address shares its backoff
# through gRPC's global subchannel pool, so even a fresh channel waited 7-10 s.
DIAL_OPTIONS = CHANNEL_OPTIONS + [
    ("grpc.use_local_subchannel_pool", 1),
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 500),
]


# A public gRPC port's bounds per connection (ServiceHost `public`), as its HTTP side
# has a header deadline and a cap per client address.
PUBLIC_IDLE_MS = 30_000
PUBLIC_STREAMS = 512


class ServiceHost:
    """Builds the server; `serving()` flips health to SERVING once the service is ready."""

    def __init__(self, service_names: list[str], interceptors: list | None = None,
                 max_receive_bytes: int = MAX_MESSAGE_BYTES, public: bool = False) -> None:
        """`max_receive_bytes`: the largest request taken (a public service's clients are
        held to what its HTTP side takes; the cluster's own calls carry KV handles).
        `public`: clients are anyone's, so a connection with no call running is closed
        after PUBLIC_IDLE_MS (idle connections by the thousand filled the router's file
        descriptors), and one connection runs at most PUBLIC_STREAMS calls at once."""
        # DecodeRequests last: a caller is authenticated before its bytes are read.
        options = [("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                   ("grpc.max_receive_message_length", max_receive_bytes)]
        if public:
            options += [("grpc.max_connection_idle_ms", PUBLIC_IDLE_MS),
                        ("grpc.max_concurrent_streams", PUBLIC_STREAMS)]
        self.server = grpc.aio.server(options=options, interceptors=[*(interceptors or ()), DecodeRequests()])
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self._names = service_names
        reflection.enable_server_reflection([*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME],
                                            self.server)

    def bind(self, host: str, port: int, credentials: grpc.ServerCredentials | None = None) -> int:
        address = f"{host}:{port}"
        if credentials is None:
            bound = self.server.add_insecure_port(address)
        else:
            bound = self.server.add_secure_port(address, credentials)
        if bound == 0:
            raise OSError(f"cannot bind gRPC on {host}:{port}")
        return bound

    async def set_status(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ["", *self._names]:
            await self.health.set(name, status)


class DecodeRequests(grpc.aio.ServerInterceptor):
    """Decodes a unary call's request inside the call, so bytes that are no such message (a
    corrupt message, a string that is not UTF-8) fail it INVALID_ARGUMENT: grpc decodes
    before any handler runs, and answers a DecodeError UNKNOWN, logging a traceback per call.
    Streamed requests (reflection's) keep grpc's own decoding."""

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or handler.request_streaming or handler.request_deserializer is None:
            return handler
        behavior = handler.unary_stream if handler.response_streaming else handler.unary_unary
        decode = handler.request_deserializer
        kw = {"response_serializer": handler.response_serializer}       # no request_deserializer: raw bytes

        async def request(raw: bytes, context):
            try:
                return decode(raw)
            except DecodeError as exc:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"undecodable request: {exc}")

        if inspect.isasyncgenfunction(behavior):
            async def stream(raw, context):
                async for response in behavior(await request(raw, context), context):
                    yield response
            return grpc.unary_stream_rpc_method_handler(stream, **kw)
        if not inspect.iscoroutinefunction(behavior):      # a synchronous handler: left as grpc runs it
            return handler

        async def call(raw, context):
            return await behavior(await request(raw, context), context)
        if handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(call, **kw)
        return grpc.unary_unary_rpc_method_handler(call, **kw)


def channel(address: str, credentials: grpc.ChannelCredentials | None = None, server_name: str | None = None,
            interceptors: list | None = None) -> grpc.aio.Channel:
    """A channel to `address`: plaintext, or TLS with `credentials` (`server_name`: the
    name the peer's certificate carries, when it is dialled by IP)."""
    if credentials is None:
        return grpc.aio.insecure_channel(address, options=DIAL_OPTIONS, interceptors=interceptors)
    options = DIAL_OPTIONS + ([("grpc.ssl_target_name_override", server_name)] if server_name else [])
    return grpc.aio.secure_channel(address, credentials, options=options, interceptors=interceptors)
