"""Which kind of device a worker will run on, decided without torch where the machine
plainly has no GPU: torch finds a CUDA (or ROCm) device through the driver's device
nodes, and with none of them present it finds none. `pdserve up` and its supervisor thus
start in a tenth of a second on a CPU machine instead of importing torch (a second of
CPU), while a GPU machine asks torch."""
from __future__ import annotations

import os

# NVIDIA's control and first device nodes, its driver's proc entry, WSL2's GPU
# paravirtualisation and AMD's compute node (ROCm's torch answers as torch.cuda).
GPU_DRIVER_NODES = ("/dev/nvidiactl", "/dev/nvidia0", "/proc/driver/nvidia", "/dev/dxg", "/dev/kfd")


def device_type(requested: str | None = None) -> str:
    """"cuda" or "cpu" (or the kind named: "cuda:1" -> "cuda") for --device `requested`."""
    if requested and requested != "auto":
        return requested.split(":", 1)[0]
    if not any(os.path.exists(node) for node in GPU_DRIVER_NODES):
        return "cpu"
    import torch
    return "cuda" if torch.cuda.is_available() else "cpu"
