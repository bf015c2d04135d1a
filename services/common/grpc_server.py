"""A gRPC aio server with what every pdserve service serves: health and reflection."""
from __future__ import annotations

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]


class ServiceHost:
    """Builds the server; `serving()` flips health to SERVING once the service is ready."""

    def __init__(self, service_names: list[str]) -> None:
        self.server = grpc.aio.server(options=CHANNEL_OPTIONS)
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self._names = service_names
        reflection.enable_server_reflection([*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME],
                                            self.server)

    def bind(self, host: str, port: int) -> int:
        bound = self.server.add_insecure_port(f"{host}:{port}")
        if bound == 0:
            raise OSError(f"cannot bind gRPC on {host}:{port}")
        return bound

    async def set_status(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ["", *self._names]:
            await self.health.set(name, status)


def channel(address: str) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
