"""The autoscaler's settings: `pdserve autoscaler`, and the autoscaler `pdserve up
--autoscale` runs in-process. Its policy knobs are the `Policy` and `Limits` of core.py."""
from __future__ import annotations

from dataclasses import dataclass

from services.autoscaler.core import Limits, Policy


@dataclass
class AutoscalerSettings:
    """`pdserve autoscaler`, and the autoscaler `pdserve up --autoscale` runs in-process."""
    redis: str | None                   # None only until `up` has started its registry
    policy: Policy
    limits: Limits
    actuator: str = "report"            # kubernetes | local | ray | report
    interval: float = 15.0              # seconds between ticks
    namespace: str | None = None        # kubernetes
    prefill_deployment: str | None = None
    decode_deployment: str | None = None
    kubeconfig: str | None = None       # None: in-cluster credentials, else ~/.kube/config
    host: str = "127.0.0.1"
    metrics_port: int | None = None     # its own /metrics and /healthz; None: not served
    cluster_secret_file: str | None = None  # registry records are signed with it, and checked
    log_level: str = "info"

    def __post_init__(self) -> None:
        if self.interval <= 0:
            raise ValueError("--autoscale-interval must be positive")
        if self.actuator == "kubernetes" and not (self.namespace and self.prefill_deployment
                                                  and self.decode_deployment):
            raise ValueError("--actuator kubernetes needs --namespace, --prefill-deployment and --decode-deployment")
        if self.actuator not in ("kubernetes", "local", "report"):
            raise ValueError("--actuator must be kubernetes or report here (local runs inside `pdserve up "
                             "--autoscale`; the Ray actuator is handed a RayPools by whatever runs the Ray pools)")
