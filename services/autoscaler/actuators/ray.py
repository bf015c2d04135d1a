"""Ray: a thin adapter over a RayPools (services/ray_cluster.py, `pdserve up --ray`),
whose `scale(role, n)` adds or removes worker actors and `counts()` says how many each
pool has. RayPools picks which actor goes and drains it, so the victims asked for here
are not passed on. Its `scale` returns only once new workers serve and removed ones
have stopped, so it runs on a thread of its own per pool: the autoscaler keeps deciding
meanwhile and sees the target as the pool's size, with actors still stopping counted
as draining. Ray itself is imported by RayPools, never here."""
from __future__ import annotations

import logging
import threading
from typing import Protocol, Sequence

from services.autoscaler.actuators import PoolSize
from services.autoscaler.core import Role

log = logging.getLogger(__name__)


class Pools(Protocol):
    def scale(self, role: str, n: int) -> object: ...

    def counts(self) -> dict[str, int]: ...


class RayActuator:
    name = "ray"

    def __init__(self, pools: Pools) -> None:
        self.pools = pools
        self._lock = threading.Lock()
        self._wanted: dict[Role, int] = {}          # while a scale call is under way
        self._threads: dict[Role, threading.Thread] = {}

    def observe(self, role: Role, registered: int) -> PoolSize:
        """The pool's actors, or while a scale call is under way (or after one failed)
        its target, actors still stopping counted as draining."""
        with self._lock:            # first: a call that ends meanwhile leaves its actors counted below
            wanted = self._wanted.get(role)
        live = self.pools.counts()[role.value]
        return PoolSize(live) if wanted is None else PoolSize(wanted, max(0, live - wanted))

    def scale(self, role: Role, replicas: int, victims: Sequence[str]) -> bool:
        with self._lock:
            self._wanted[role] = replicas
            if role not in self._threads:
                self._threads[role] = threading.Thread(target=self._apply, args=(role,), daemon=True,
                                                       name=f"ray-scale-{role.value}")
                self._threads[role].start()
        return True

    def wait(self, timeout: float | None = None) -> None:
        """Until no scale call is under way (for shutdown and tests)."""
        with self._lock:
            threads = list(self._threads.values())
        for t in threads:
            t.join(timeout)

    def _apply(self, role: Role) -> None:
        """Scale to the latest target until it holds still. A target that failed (a
        worker that could not start) stays what the pool is set to, as a Deployment's
        replicas whose pods cannot start do: the autoscaler sees capacity pending (and
        gives it up after its pending timeout), not a change made outside it."""
        while True:
            with self._lock:
                n = self._wanted[role]
            failed = False
            try:
                self.pools.scale(role.value, n)
            except Exception:
                failed = True
                log.exception("scaling the Ray %s pool to %d failed; its workers are what counts() says",
                              role.value, n)
            with self._lock:
                if self._wanted[role] == n:
                    del self._threads[role]
                    if not failed:
                        del self._wanted[role]
                    return
