"""The registry's joins channel, on a real redis-server: a worker's first announcement
nudges every router at once (services/common/registry.py), so it is routed to without
waiting for the routers' next refresh."""
from __future__ import annotations

import asyncio
import time

from services.common.registry import Heartbeat, RedisRegistry
from services.rpc import worker_pb2


def test_a_workers_first_announcement_nudges_a_listener_at_once_and_its_heartbeats_do_not(redis_url):
    """Listening past the connection's socket timeout (1.5 s at a 3 s TTL), a listener
    hears each worker that joins within a fraction of a second, once: the heartbeats
    that follow (every TTL / 3) say nothing."""
    async def run() -> tuple[list[float], list[float]]:
        router, worker = RedisRegistry(redis_url), RedisRegistry(redis_url)
        heard: list[float] = []

        async def listen() -> None:
            async for _ in router.joins():
                heard.append(time.monotonic())
        listener = asyncio.create_task(listen())
        await asyncio.sleep(2.0)
        joined = []
        beats = []
        for epoch in ("e1", "e2"):
            joined.append(time.monotonic())
            beat = Heartbeat(worker if epoch == "e1" else RedisRegistry(redis_url),
                             lambda epoch=epoch: worker_pb2.WorkerInfo(role="decode", epoch=epoch,
                                                                        address="127.0.0.1:1"))
            await beat.start()
            beats.append(beat)
        await asyncio.sleep(2.5)                        # two heartbeats each
        listener.cancel()
        for beat in beats:
            await beat.stop()
        await router.close()
        return joined, heard

    joined, heard = asyncio.run(run())
    assert len(heard) == 2, heard
    assert all(0 <= h - j < 0.5 for j, h in zip(joined, heard)), [h - j for j, h in zip(joined, heard)]
