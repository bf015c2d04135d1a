"""Ray: a thin adapter over a RayPools (services/ray_cluster.py, `pdserve up --ray`),
whose `scale(role, n)` adds or removes actors and `counts()` says how many each pool
has. RayPools picks which actor goes and drains it; the victims asked for here are not
passed on. Ray itself is imported only by RayPools, never here."""
from __future__ import annotations

from typing import Protocol, Sequence

from services.autoscaler.actuators import PoolSize
from services.autoscaler.core import Role


class Pools(Protocol):
    def scale(self, role: str, n: int) -> None: ...

    def counts(self) -> dict[str, int]: ...


class RayActuator:
    name = "ray"

    def __init__(self, pools: Pools) -> None:
        self.pools = pools

    def observe(self, role: Role, registered: int) -> PoolSize:
        return PoolSize(self.pools.counts()[role.value])

    def scale(self, role: Role, replicas: int, victims: Sequence[str]) -> bool:
        self.pools.scale(role.value, replicas)
        return True
