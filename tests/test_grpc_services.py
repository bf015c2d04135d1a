"""Every service serves gRPC health checking and reflection."""
import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

SERVICES = {"router": "pdserve.v1.Generator", "prefill": "pdserve.v1.PrefillWorker",
            "decode": "pdserve.v1.DecodeWorker"}


def _addr(cluster, role):
    return cluster.grpc if role == "router" else cluster.worker_addr(role)


@pytest.mark.parametrize("role", list(SERVICES))
def test_health_and_reflection(cluster, role):
    with grpc.insecure_channel(_addr(cluster, role)) as ch:
        health = health_pb2_grpc.HealthStub(ch)
        for name in ("", SERVICES[role]):
            resp = health.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)
            assert resp.status == health_pb2.HealthCheckResponse.SERVING
        stub = reflection_pb2_grpc.ServerReflectionStub(ch)
        replies = list(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                                 timeout=5))
        names = {s.name for s in replies[0].list_services_response.service}
        assert {SERVICES[role], "grpc.health.v1.Health"} <= names
