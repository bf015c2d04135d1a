"""The Kubernetes actuator through the real `kubernetes` client, against a stand-in for
the API server.

No Kubernetes API server can run here. `ScaleAPIStandIn` is a small real HTTP server
that implements only what the actuator touches, the way the API server answers it:
    GET, PATCH, PUT  /apis/apps/v1/namespaces/{ns}/deployments/{name}/scale
    GET              /api/v1/namespaces/{ns}/pods?labelSelector=...
    PATCH            /api/v1/namespaces/{ns}/pods/{name}      (annotations)
It is not a Kubernetes: no ReplicaSet acts on the replica count (the test plays that
part where it matters), and authentication, RBAC and admission are not exercised; the
chart's Role is checked by tests/test_helm_chart.py instead.
"""
from __future__ import annotations

import asyncio
import json
import re
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

import pytest
from kubernetes import client

from services.autoscaler.actuators import PoolSize
from services.autoscaler.actuators.kubernetes import DELETION_COST, KubernetesActuator
from services.autoscaler.core import Limits, Policy, PoolBounds, Reason, Role
from services.autoscaler.service import Autoscaler
from services.common.registry import RedisRegistry
from services.autoscaler.settings import AutoscalerSettings
from services.rpc import worker_pb2

NS = "serving"
SCALE = re.compile(r"^/apis/apps/v1/namespaces/([^/]+)/deployments/([^/]+)/scale$")
PODS = re.compile(r"^/api/v1/namespaces/([^/]+)/pods$")
POD = re.compile(r"^/api/v1/namespaces/([^/]+)/pods/([^/]+)$")


@dataclass
class Deployment:
    name: str
    replicas: int
    pods: list[dict] = field(default_factory=list)
    version: int = 1

    @property
    def selector(self) -> str:
        return f"app.kubernetes.io/component={self.name}"


class ScaleAPIStandIn:
    """A stand-in for the Kubernetes API server's Deployment scale subresource (and the
    pod reads and annotation patches that go with it). Every request is recorded."""

    def __init__(self, *deployments: Deployment) -> None:
        self.deployments = {d.name: d for d in deployments}
        self.requests: list[tuple[str, str, str, object]] = []     # method, path, content type, body
        self.lock = threading.Lock()
        stand_in = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                stand_in.handle(self, "GET")

            def do_PATCH(self):
                stand_in.handle(self, "PATCH")

            def do_PUT(self):
                stand_in.handle(self, "PUT")

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def api_client(self) -> client.ApiClient:
        config = client.Configuration()
        config.host = self.url
        return client.ApiClient(config)

    def close(self) -> None:
        self.server.shutdown()

    # ---- the API ----
    def scale_object(self, d: Deployment) -> dict:
        return {"apiVersion": "autoscaling/v1", "kind": "Scale",
                "metadata": {"name": d.name, "namespace": NS, "resourceVersion": str(d.version)},
                "spec": {"replicas": d.replicas},
                "status": {"replicas": len(d.pods), "selector": d.selector}}

    def handle(self, h: BaseHTTPRequestHandler, method: str) -> None:
        url = urlparse(h.path)
        length = int(h.headers.get("Content-Length") or 0)
        body = json.loads(h.rfile.read(length)) if length else None
        content_type = h.headers.get("Content-Type", "")
        with self.lock:
            self.requests.append((method, url.path, content_type, body))
            code, reply = self.route(method, url, content_type, body)
        data = json.dumps(reply).encode()
        h.send_response(code)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        h.wfile.write(data)

    def route(self, method: str, url, content_type: str, body) -> tuple[int, dict]:
        if m := SCALE.match(url.path):
            d = self.deployments.get(m.group(2))
            if m.group(1) != NS or d is None:
                return 404, status(404, "NotFound", f'deployments.apps "{m.group(2)}" not found')
            if method == "PATCH":
                replicas = patched_replicas(content_type, body, d.replicas)
                if replicas is None:
                    return 415, status(415, "UnsupportedMediaType", f"the patch type {content_type} is not supported")
                d.replicas, d.version = replicas, d.version + 1
            elif method == "PUT":
                if body["metadata"].get("resourceVersion") not in (None, str(d.version)):
                    return 409, status(409, "Conflict", "the object has been modified")
                d.replicas, d.version = body["spec"]["replicas"], d.version + 1
            return 200, self.scale_object(d)
        if (m := PODS.match(url.path)) and method == "GET":
            selector = parse_qs(url.query).get("labelSelector", [""])[0]
            items = [p for d in self.deployments.values() if d.selector == selector for p in d.pods]
            return 200, {"apiVersion": "v1", "kind": "PodList", "metadata": {}, "items": items}
        if (m := POD.match(url.path)) and method == "PATCH":
            pod = next((p for d in self.deployments.values() for p in d.pods if p["metadata"]["name"] == m.group(2)),
                       None)
            if pod is None:
                return 404, status(404, "NotFound", f'pods "{m.group(2)}" not found')
            annotations = pod["metadata"].setdefault("annotations", {})
            for key, value in body["metadata"]["annotations"].items():     # a merge patch: null removes
                if value is None:
                    annotations.pop(key, None)
                else:
                    annotations[key] = value
            return 200, pod
        return 404, status(404, "NotFound", "not served by this stand-in")


def status(code: int, reason: str, message: str) -> dict:
    return {"apiVersion": "v1", "kind": "Status", "status": "Failure", "code": code, "reason": reason,
            "message": message}


def patched_replicas(content_type: str, body, replicas: int) -> int | None:
    kind = content_type.split(";")[0].strip()
    if kind == "application/json-patch+json":
        for op in body:
            if op["op"] in ("replace", "add") and op["path"] == "/spec/replicas":
                replicas = op["value"]
        return replicas
    if kind in ("application/merge-patch+json", "application/strategic-merge-patch+json"):
        return body.get("spec", {}).get("replicas", replicas)
    return None


def pod(name: str, ip: str, deleting: bool = False) -> dict:
    meta = {"name": name, "namespace": NS, "labels": {}}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "status": {"phase": "Running", "podIP": ip}}


@pytest.fixture
def api():
    stand_in = ScaleAPIStandIn(
        Deployment("pdserve-prefill", 1, [pod("pdserve-prefill-a", "10.1.0.1")]),
        Deployment("pdserve-decode", 2, [pod("pdserve-decode-a", "10.2.0.1"), pod("pdserve-decode-b", "10.2.0.2"),
                                         pod("pdserve-decode-old", "10.2.0.9", deleting=True)]))
    yield stand_in
    stand_in.close()


def actuator(api: ScaleAPIStandIn) -> KubernetesActuator:
    return KubernetesActuator(NS, {Role.PREFILL: "pdserve-prefill", Role.DECODE: "pdserve-decode"},
                              api.api_client())


def test_stand_in_observe_reads_the_scale_subresource_and_counts_terminating_pods(api):
    k8s = actuator(api)
    assert k8s.observe(Role.PREFILL, 0) == PoolSize(1, 0)
    assert k8s.observe(Role.DECODE, 0) == PoolSize(2, 1)
    assert ("GET", f"/apis/apps/v1/namespaces/{NS}/deployments/pdserve-decode/scale") in \
        [(m, p) for m, p, _, _ in api.requests]


def test_stand_in_scale_out_patches_spec_replicas(api):
    k8s = actuator(api)
    k8s.observe(Role.PREFILL, 0)
    assert k8s.scale(Role.PREFILL, 3, [])
    assert api.deployments["pdserve-prefill"].replicas == 3
    method, path, content_type, body = api.requests[-1]
    assert (method, path) == ("PATCH", f"/apis/apps/v1/namespaces/{NS}/deployments/pdserve-prefill/scale")
    assert content_type.startswith("application/strategic-merge-patch+json") and body == {"spec": {"replicas": 3}}
    assert k8s.observe(Role.PREFILL, 0).replicas == 3


def test_stand_in_scale_in_marks_the_victim_pod_cheapest_to_delete_first(api):
    k8s = actuator(api)
    k8s.observe(Role.DECODE, 0)
    k8s.scale(Role.DECODE, 1, ["10.2.0.2:7001"])
    pods = {p["metadata"]["name"]: p for p in api.deployments["pdserve-decode"].pods}
    assert pods["pdserve-decode-b"]["metadata"]["annotations"] == {DELETION_COST: "-1"}
    assert "annotations" not in pods["pdserve-decode-a"]["metadata"]
    patches = [(m, p) for m, p, _, _ in api.requests if m == "PATCH"]
    assert patches == [("PATCH", f"/api/v1/namespaces/{NS}/pods/pdserve-decode-b"),      # before the scale
                       ("PATCH", f"/apis/apps/v1/namespaces/{NS}/deployments/pdserve-decode/scale")]
    assert api.deployments["pdserve-decode"].replicas == 1


def test_stand_in_scale_in_unmarks_a_pod_an_earlier_scale_in_marked_and_left(api):
    """The ReplicaSet took another pod than the one marked (the cost is a hint), or the
    pool grew again: the pod marked then is unmarked at the next scale-in, which would
    otherwise remove it first whatever its load."""
    k8s = actuator(api)
    pods = {p["metadata"]["name"]: p for p in api.deployments["pdserve-decode"].pods}
    pods["pdserve-decode-a"]["metadata"]["annotations"] = {DELETION_COST: "-1"}
    k8s.observe(Role.DECODE, 0)
    k8s.scale(Role.DECODE, 1, ["10.2.0.2:7001"])
    assert pods["pdserve-decode-a"]["metadata"]["annotations"] == {}
    assert pods["pdserve-decode-b"]["metadata"]["annotations"] == {DELETION_COST: "-1"}


def test_stand_in_answers_put_and_conflicts_like_the_api_server(api):
    apps = client.AppsV1Api(api.api_client())
    scale = apps.read_namespaced_deployment_scale("pdserve-decode", NS)
    scale.spec.replicas = 4
    assert apps.replace_namespaced_deployment_scale("pdserve-decode", NS, scale).spec.replicas == 4
    with pytest.raises(client.ApiException) as stale:
        apps.replace_namespaced_deployment_scale("pdserve-decode", NS, scale)     # old resourceVersion
    assert stale.value.status == 409
    with pytest.raises(client.ApiException) as missing:
        apps.read_namespaced_deployment_scale("nope", NS)
    assert missing.value.status == 404


def test_stand_in_autoscaler_scales_a_deployment_and_adopts_a_manual_edit(api, redis_url):
    """The whole loop: registry records in Redis, the planner, the actuator through the
    client. Then someone runs `kubectl scale` (a PUT here): the planner adopts it."""
    async def scenario():
        registry = RedisRegistry(redis_url, ttl=60)
        now = time.time()
        await registry.announce(worker_pb2.WorkerInfo(role="prefill", epoch="p0", address="10.1.0.1:7001",
                                                      started_at=now - 60, queued_prefill_tokens=30000))
        for i in (1, 2):
            await registry.announce(worker_pb2.WorkerInfo(role="decode", epoch=f"d{i}", address=f"10.2.0.{i}:7001",
                                                          started_at=now - 60, num_blocks=100, free_blocks=90))
        policy = Policy(warmup=10, scale_out_cooldown=0, scale_in_after=600, manual_hold=600,
                        target_prefill_queue_tokens=8192)
        settings = AutoscalerSettings(redis_url, policy, Limits(PoolBounds(1, 4), PoolBounds(1, 4)),
                                      actuator="kubernetes", interval=1, namespace=NS,
                                      prefill_deployment="pdserve-prefill", decode_deployment="pdserve-decode")
        scaler = Autoscaler(settings, registry, actuator(api))
        await scaler.tick()                     # a load signal acts on its second tick over
        decisions = await scaler.tick()
        assert decisions[Role.PREFILL].reason is Reason.SCALE_OUT_LOAD
        assert api.deployments["pdserve-prefill"].replicas == 2
        assert api.deployments["pdserve-decode"].replicas == 2
        apps = client.AppsV1Api(api.api_client())
        scale = apps.read_namespaced_deployment_scale("pdserve-decode", NS)
        scale.spec.replicas = 3
        apps.replace_namespaced_deployment_scale("pdserve-decode", NS, scale)
        decisions = await scaler.tick()
        assert decisions[Role.DECODE].reason is Reason.MANUAL and not decisions[Role.DECODE].changed
        assert api.deployments["pdserve-decode"].replicas == 3
        await registry.close()
    asyncio.run(scenario())
