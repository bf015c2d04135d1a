"""Process plumbing shared by every service: logging, readiness announcements, signals."""
from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
from pathlib import Path


def setup_logging(level: str, role: str) -> None:
    logging.basicConfig(level=level.upper(), format=f"%(asctime)s {role} %(levelname)s %(name)s: %(message)s")
    for noisy in ("httpx", "uvicorn.access"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def announce(path: str | None, **fields) -> None:
    """Tell a supervisor where this service listens: a JSON file written atomically."""
    if not path:
        return
    tmp = Path(f"{path}.tmp")
    tmp.write_text(json.dumps({"pid": os.getpid(), **fields}))
    tmp.replace(path)


def stop_event_on_signals(loop: asyncio.AbstractEventLoop) -> asyncio.Event:
    """An event set by SIGINT/SIGTERM, so services drain instead of dying mid-request."""
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    return stop


def set_torch_threads(threads: int) -> None:
    import torch
    if threads > 0:
        torch.set_num_threads(threads)
        os.environ.setdefault("OMP_NUM_THREADS", str(threads))
