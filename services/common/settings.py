"""One settings object per service, built once from the command line and validated.

Environment variables are read here and nowhere else (`PDSERVE_*` defaults for flags).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

DTYPES = ("bfloat16", "float32", "float16")
KV_TRANSPORTS = ("auto", "shm", "nixl", "tcp")


def env_default(name: str, default: str | None = None) -> str | None:
    return os.environ.get(f"PDSERVE_{name.upper().replace('-', '_')}", default)


@dataclass
class WorkerSettings:
    role: str                           # "prefill" or "decode"
    model: str | None = None            # None = the default model
    dtype: str = "bfloat16"
    device: str = "auto"
    block_size: int = 16
    kv_cache_tokens: int = 65536        # decode pool size in tokens
    max_batch: int = 64
    threads: int = 0                    # torch threads; 0 = torch's default
    host: str = "127.0.0.1"
    grpc_port: int = 0
    metrics_port: int = 0
    kv_transport: str = "auto"
    advertise: str | None = None        # host peers use to reach this worker (default: host)
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
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError("--block-size must be a power of two")
        if self.kv_cache_tokens < self.block_size:
            raise ValueError("--kv-cache-tokens must hold at least one block")
        if self.max_batch < 1:
            raise ValueError("--max-batch must be at least 1")

    def transport_options(self) -> dict[str, dict]:
        # A NIXL writer drives its own transfers when it polls; only the receiving side
        # needs a progress thread (for new writers' handshakes), and a slow one suffices:
        # a faster one costs the forward pass measurable time on a small host.
        nixl = {"progress_interval": 0.05 if self.role == "decode" else 0.0}
        return {"tcp": {"host": self.host, "advertise": self.advertise or self.host}, "nixl": nixl}


@dataclass
class RouterSettings:
    model: str | None = None
    served_model_name: str | None = None
    host: str = "127.0.0.1"
    http_port: int = 8000
    grpc_port: int = 50051
    prefill: list[str] = field(default_factory=list)
    decode: list[str] = field(default_factory=list)
    max_pending: int = 512              # admitted requests beyond this get 429
    request_timeout: float = 600.0
    prefill_timeout: float = 120.0      # also the KV write lease a reservation asks for
    max_body_bytes: int = 8 * 1024 * 1024
    announce_file: str | None = None
    log_level: str = "info"

    def __post_init__(self) -> None:
        if not self.prefill or not self.decode:
            raise ValueError("the router needs at least one --prefill and one --decode address")
        if self.max_pending < 1:
            raise ValueError("--max-pending must be at least 1")
