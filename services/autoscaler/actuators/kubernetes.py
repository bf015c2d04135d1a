"""Kubernetes: each pool is a Deployment, sized through its `scale` subresource, the
same endpoint `kubectl scale` and the HorizontalPodAutoscaler use.

    observe  GET   .../deployments/NAME/scale       spec.replicas, status.selector
             GET   .../pods?labelSelector=...       pods being deleted = draining
    scale    PATCH .../pods/POD (victims only)      controller.kubernetes.io/pod-deletion-cost
             PATCH .../deployments/NAME/scale       spec.replicas

A lower pod-deletion-cost makes the ReplicaSet remove that pod first (pods that are not
scheduled or not ready still go before any of them): the autoscaler's choice, the least
loaded and youngest worker, is a strong hint, not a guarantee. The removed pod gets its
preStop wait and then SIGTERM, which drains it. RBAC (the chart's Role): get and patch
on deployments/scale, list and patch on pods.
"""
from __future__ import annotations

import logging
from typing import Sequence

from services.autoscaler.actuators import PoolSize
from services.autoscaler.core import Role

log = logging.getLogger(__name__)

DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"
REQUEST_TIMEOUT = 10.0


def api_client(kubeconfig: str | None = None):
    """In-cluster credentials when running in a pod, else a kubeconfig file."""
    from kubernetes import client, config
    if kubeconfig is None:
        try:
            config.load_incluster_config()
            return client.ApiClient()
        except config.ConfigException:
            pass
    config.load_kube_config(config_file=kubeconfig)
    return client.ApiClient()


class KubernetesActuator:
    name = "kubernetes"

    def __init__(self, namespace: str, deployments: dict[Role, str], client=None) -> None:
        from kubernetes import client as k8s
        api = client if client is not None else api_client()
        self.apps, self.core = k8s.AppsV1Api(api), k8s.CoreV1Api(api)
        self.namespace = namespace
        self.deployments = deployments
        self._selector: dict[Role, str] = {}

    def observe(self, role: Role, registered: int) -> PoolSize:
        scale = self.apps.read_namespaced_deployment_scale(self.deployments[role], self.namespace,
                                                           _request_timeout=REQUEST_TIMEOUT)
        self._selector[role] = scale.status.selector if scale.status else ""
        return PoolSize(scale.spec.replicas or 0, sum(p.metadata.deletion_timestamp is not None
                                                      for p in self._pods(role)))

    def scale(self, role: Role, replicas: int, victims: Sequence[str]) -> bool:
        if victims:
            self._mark_victims(role, victims)
        self.apps.patch_namespaced_deployment_scale(self.deployments[role], self.namespace,
                                                    {"spec": {"replicas": replicas}},
                                                    _request_timeout=REQUEST_TIMEOUT)
        return True

    def _pods(self, role: Role) -> list:
        if not self._selector.get(role):
            return []
        return self.core.list_namespaced_pod(self.namespace, label_selector=self._selector[role],
                                             _request_timeout=REQUEST_TIMEOUT).items

    def _mark_victims(self, role: Role, victims: Sequence[str]) -> None:
        """Victims are registered addresses, POD_IP:PORT: the first gets the lowest cost.
        A pod still marked from an earlier scale-in (the ReplicaSet took another, or that
        scale-in was undone) loses its mark: it would go first next time whatever its load."""
        pods = self._pods(role)
        by_ip = {p.status.pod_ip: p for p in pods if p.status and p.status.pod_ip}
        chosen = {address.rpartition(":")[0] for address in victims}
        for p in pods:
            marked = DELETION_COST in (p.metadata.annotations or {})
            if marked and p.metadata.deletion_timestamp is None and (p.status and p.status.pod_ip) not in chosen:
                self.core.patch_namespaced_pod(p.metadata.name, self.namespace,
                                               {"metadata": {"annotations": {DELETION_COST: None}}},
                                               _request_timeout=REQUEST_TIMEOUT)
        for rank, address in enumerate(victims):
            pod = by_ip.get(address.rpartition(":")[0])
            if pod is None:
                log.info("no pod of %s has the address %s; the ReplicaSet picks", self.deployments[role], address)
                continue
            cost = str(rank - len(victims))
            self.core.patch_namespaced_pod(pod.metadata.name, self.namespace,
                                           {"metadata": {"annotations": {DELETION_COST: cost}}},
                                           _request_timeout=REQUEST_TIMEOUT)
