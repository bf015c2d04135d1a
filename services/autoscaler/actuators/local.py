"""`pdserve up --autoscale`: the pools are worker processes of the LocalCluster this
runs in. Growing spawns workers; shrinking sends SIGTERM, so the worker deregisters,
refuses new work (the router retries elsewhere) and finishes what it accepted."""
from __future__ import annotations

from typing import Sequence

from services.autoscaler.actuators import PoolSize
from services.autoscaler.core import Role


class LocalActuator:
    name = "local"

    def __init__(self, cluster) -> None:          # services.local_cluster.LocalCluster
        self.cluster = cluster

    def observe(self, role: Role, registered: int) -> PoolSize:
        return PoolSize(self.cluster.pool_size(role.value), self.cluster.draining(role.value))

    def scale(self, role: Role, replicas: int, victims: Sequence[str]) -> bool:
        self.cluster.resize(role.value, replicas, victims)
        return True
