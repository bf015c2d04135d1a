"""asyncio helpers shared by the services."""
from __future__ import annotations

import asyncio
from typing import Awaitable, TypeVar

T = TypeVar("T")


class Interrupted(Exception):
    """`unless`'s interrupt came before the work's result."""


async def unless(work: Awaitable[T], interrupt: Awaitable[object]) -> T:
    """`work`'s result, unless `interrupt` completes first: `work` is then cancelled, its
    cleanup has run by the time Interrupted is raised. Whatever is still pending when
    this returns is cancelled (this call cancelled: both)."""
    task, stop = asyncio.ensure_future(work), asyncio.ensure_future(interrupt)
    try:
        await asyncio.wait((task, stop), return_when=asyncio.FIRST_COMPLETED)
    finally:
        stop.cancel()
        if not task.done():
            task.cancel()
    if not task.done() or task.cancelled():
        await asyncio.wait((task,))
        raise Interrupted
    return task.result()
