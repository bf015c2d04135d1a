"""One settings object per service, built once from the command line and validated.

Environment variables are read here and nowhere else: `PDSERVE_<FLAG>` is any flag's default.
"""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from services.autoscaler.core import Limits, Policy

DTYPES = ("bfloat16", "float32", "float16")
KV_TRANSPORTS = ("auto", "shm", "nixl", "tcp")
ATTENTION_KERNELS = ("auto", "native", "torch")


def env_defaults(parser: argparse.ArgumentParser, environ=os.environ) -> None:
    """Let `PDSERVE_<FLAG>` set any flag's default (`--kv-cache-tokens` reads
    PDSERVE_KV_CACHE_TOKENS): what container specs set. The command line still wins;
    values go through the flag's type conversion, and settings validate them."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                env_defaults(sub, environ)
            continue
        if not action.option_strings or action.dest == "help":
            continue
        value = environ.get("PDSERVE_" + action.option_strings[-1].lstrip("-").upper().replace("-", "_"))
        if value is None:
            continue
        if isinstance(action, argparse._StoreTrueAction):
            action.default = value.strip().lower() in ("1", "true", "yes", "on")
        elif isinstance(action, argparse._AppendAction):
            action.default = [v.strip() for v in value.split(",") if v.strip()]
        else:
            action.default = value


@dataclass
class WorkerSettings:
    role: str                           # "prefill" or "decode"
    model: str | None = None            # None = the default model
    dtype: str = "bfloat16"
    device: str = "auto"
    block_size: int = 16
    kv_cache_tokens: int = 65536        # decode pool size in tokens
    prefix_cache_tokens: int = 16384    # prefill: tokens of prompt KV kept for reuse (0: off)
    max_batch: int = 64
    prefill_chunk_tokens: int = 0       # decode worker's local prefill: tokens per step (0: whole prompt)
    threads: int = 0                    # torch threads; 0 = torch's default
    attention_kernel: str = "auto"      # attention: native C kernels, torch's ops, or auto
    host: str = "127.0.0.1"
    grpc_port: int = 0
    metrics_port: int = 0
    kv_transport: str = "auto"
    advertise: str | None = None        # HOST or HOST:PORT peers use to reach this worker
    redis: str | None = None            # registry URL; None: a router is given this address
    registry_ttl: float = 3.0           # seconds a registry record outlives its last heartbeat
    drain_timeout: float = 30.0         # on SIGTERM: how long accepted requests may still run
    fault_drop_transfers: float = 0.0   # tests only: fraction of KV transfers dropped midway
    announce_file: str | None = None
    log_level: str = "info"

    def __post_init__(self) -> None:
        if self.kv_transport not in KV_TRANSPORTS:
            raise ValueError(f"--kv-transport must be one of {', '.join(KV_TRANSPORTS)}")
        if not 0.0 <= self.fault_drop_transfers <= 1.0:
            raise ValueError("--fault-drop-transfers must be in [0, 1]")
        if self.role not in ("prefill", "decode"):
            raise ValueError(f"role must be prefill or decode, not {self.role!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}")
        if self.attention_kernel not in ATTENTION_KERNELS:
            raise ValueError(f"--attention-kernel must be one of {', '.join(ATTENTION_KERNELS)}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError("--block-size must be a power of two")
        if self.kv_cache_tokens < self.block_size:
            raise ValueError("--kv-cache-tokens must hold at least one block")
        if self.prefill_chunk_tokens < 0:
            raise ValueError("--prefill-chunk-tokens must be 0 (whole prompts) or more")
        if self.prefix_cache_tokens < 0:
            raise ValueError("--prefix-cache-tokens must be 0 (off) or more")
        if self.max_batch < 1:
            raise ValueError("--max-batch must be at least 1")
        if self.registry_ttl <= 0:
            raise ValueError("--registry-ttl must be positive")

    @property
    def advertise_host(self) -> str:
        host, _, port = (self.advertise or self.host).rpartition(":")
        return host if port.isdigit() and host else (self.advertise or self.host)

    def advertise_address(self, bound_port: int) -> str:
        """host:port routers dial: --advertise as given, else its host and the bound port."""
        host, _, port = (self.advertise or "").rpartition(":")
        if port.isdigit() and host:
            return self.advertise
        return f"{self.advertise_host}:{bound_port}"

    def transport_options(self) -> dict[str, dict]:
        # A NIXL writer drives its own transfers when it polls; only the receiving side
        # needs a progress thread (for new writers' handshakes), and a slow one suffices:
        # a faster one costs the forward pass measurable time on a small host.
        nixl = {"progress_interval": 0.05 if self.role == "decode" else 0.0}
        return {"tcp": {"host": self.host, "advertise": self.advertise_host}, "nixl": nixl}


@dataclass
class RouterSettings:
    model: str | None = None
    served_model_name: str | None = None
    host: str = "127.0.0.1"
    http_port: int = 8000
    grpc_port: int = 50051
    prefill: list[str] = field(default_factory=list)
    decode: list[str] = field(default_factory=list)
    redis: str | None = None            # discover workers here instead of --prefill/--decode
    registry_ttl: float = 3.0
    local_prefill_max_tokens: int = 256 # prompts up to this may prefill on the decode worker
    aggregated: bool = False            # no prefill pool: decode workers prefill everything
    max_pending: int = 512              # admitted requests beyond this get 429
    request_timeout: float = 600.0
    prefill_timeout: float = 120.0      # also the KV write lease a reservation asks for
    max_body_bytes: int = 8 * 1024 * 1024
    announce_file: str | None = None
    log_level: str = "info"

    def __post_init__(self) -> None:
        if not self.redis and (not self.decode or not (self.prefill or self.aggregated)):
            raise ValueError("the router needs --redis, or at least one --decode and one --prefill address "
                             "(or --aggregated)")
        if self.local_prefill_max_tokens < 0:
            raise ValueError("--local-prefill-max-tokens must be 0 (always disaggregate) or more")
        if self.max_pending < 1:
            raise ValueError("--max-pending must be at least 1")


@dataclass
class AutoscalerSettings:
    """`pdserve autoscaler`, and the autoscaler `pdserve up --autoscale` runs in-process."""
    redis: str | None                   # None only until `up` has started its registry
    policy: "Policy"
    limits: "Limits"
    actuator: str = "report"            # kubernetes | local | ray | report
    interval: float = 15.0              # seconds between ticks
    namespace: str | None = None        # kubernetes
    prefill_deployment: str | None = None
    decode_deployment: str | None = None
    kubeconfig: str | None = None       # None: in-cluster credentials, else ~/.kube/config
    host: str = "127.0.0.1"
    metrics_port: int | None = None     # its own /metrics and /healthz; None: not served
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
