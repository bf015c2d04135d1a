"""The decode pools' shared-memory segments, by name: where they live, whose they are,
which are left by dead processes. Plain Python, so that `pdserve up` can check for
leaked segments without importing torch (a second of every start)."""
from __future__ import annotations

import logging
import os
import uuid
from pathlib import Path

log = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
SEGMENT_PREFIX = "pdserve-kv-"


def new_segment_path(kind: str = "") -> Path:
    """A new segment's name: the prefix, this process's pid (whose death makes it stale),
    `kind` (e.g. "tp-") and a random part."""
    return SHM_DIR / f"{SEGMENT_PREFIX}{os.getpid()}-{kind}{uuid.uuid4().hex[:12]}"


def shm_free_bytes() -> int:
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return 0
    return st.f_bavail * st.f_frsize


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale_segments() -> list[Path]:
    """Remove shared-memory segments whose owning process is gone."""
    removed = []
    if not SHM_DIR.is_dir():
        return removed
    for path in SHM_DIR.glob(SEGMENT_PREFIX + "*"):
        try:
            pid = int(path.name[len(SEGMENT_PREFIX):].split("-")[0])
        except ValueError:
            continue
        if not _pid_alive(pid):
            path.unlink(missing_ok=True)
            removed.append(path)
    if removed:
        log.warning("removed %d shared-memory KV segments left by dead processes", len(removed))
    return removed


def remove_segments_of(pid: int) -> list[Path]:
    """Remove the segments a dead process `pid` left (a killed decode worker's KV pool):
    nobody else would ever free them. Returns those removed."""
    removed = live_segments(pid)
    for path in removed:
        path.unlink(missing_ok=True)
    return removed


def live_segments(pid: int | None = None) -> list[Path]:
    """Segments present now (of one owner pid, if given): for leak checks."""
    pattern = SEGMENT_PREFIX + (f"{pid}-*" if pid is not None else "*")
    return sorted(SHM_DIR.glob(pattern)) if SHM_DIR.is_dir() else []
