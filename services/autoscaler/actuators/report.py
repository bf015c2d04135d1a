"""Changes nothing: takes the registered workers as the pool's size and logs what it
would set. For trying a policy on a live cluster before letting it act."""
from __future__ import annotations

import logging
from typing import Sequence

from services.autoscaler.actuators import PoolSize
from services.autoscaler.core import Role

log = logging.getLogger(__name__)


class ReportActuator:
    name = "report"

    def observe(self, role: Role, registered: int) -> PoolSize:
        return PoolSize(registered)

    def scale(self, role: Role, replicas: int, victims: Sequence[str]) -> bool:
        log.info("would set %s to %d replica(s)%s", role.value, replicas,
                 f", draining {', '.join(victims)}" if victims else "")
        return False
