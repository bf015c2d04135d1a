"""What sets a pool's replica count: one small interface, one module per backend,
registered by name and imported only when chosen (the Kubernetes and Ray clients are
heavy and optional).

    kubernetes  the Deployment `scale` subresource (in-cluster or kubeconfig)
    local       the worker processes of `pdserve up` (services/local_cluster.py)
    ray         actors of a RayPools (`pdserve up --ray`)
    report      changes nothing: logs what it would set (a dry run, and the tests' fake)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Protocol, Sequence

from services.autoscaler.core import Role


@dataclass(frozen=True)
class PoolSize:
    replicas: int                       # what the pool is set to now, whoever set it
    draining: int = 0                   # removed workers still finishing (holding their slot)


class Actuator(Protocol):
    name: ClassVar[str]

    def observe(self, role: Role, registered: int) -> PoolSize:
        """The pool as the backend sees it. `registered` (workers of the role in the
        registry) is for backends with nothing of their own to count."""

    def scale(self, role: Role, replicas: int, victims: Sequence[str]) -> bool:
        """Set the pool to `replicas`. When that removes workers, `victims` are the
        registered ones to drain, best first (addresses); workers not started yet go
        before any of them. Removal is always a drain (SIGTERM), never a kill. Returns
        whether the pool was set (False: only reported)."""


BACKENDS = {
    "kubernetes": "services.autoscaler.actuators.kubernetes:KubernetesActuator",
    "local": "services.autoscaler.actuators.local:LocalActuator",
    "ray": "services.autoscaler.actuators.ray:RayActuator",
    "report": "services.autoscaler.actuators.report:ReportActuator",
}


def actuator_class(name: str) -> type:
    import importlib
    try:
        module, _, cls = BACKENDS[name].partition(":")
    except KeyError:
        raise ValueError(f"unknown actuator {name!r}; one of {', '.join(BACKENDS)}") from None
    return getattr(importlib.import_module(module), cls)
