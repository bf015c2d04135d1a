"""The registry on a real redis-server: a worker's first announcement nudges every
router at once (services/common/registry.py), so it is routed to without waiting for
the routers' next refresh; a stopped heartbeat never announces its worker again."""
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


def test_a_stopping_listener_and_registry_close_within_the_bound_when_redis_py_hangs_closing(redis_url, monkeypatch):
    """redis-py's aclose can wait forever on its socket's close (redis/redis-py#3941): a
    router once outlived `up`, its joins listener hung in that cleanup. Here aclose is
    made to hang as it did (the one stand-in: the hang is rare and timing-bound), on a
    real redis-server: the cancelled listener and the registry's close still end within
    CLOSE_TIMEOUT."""
    import redis.asyncio.client as client
    from services.common import registry

    async def hang(self) -> None:
        await asyncio.sleep(3600)

    async def run() -> tuple[float, float]:
        router = RedisRegistry(redis_url)

        async def listen() -> None:
            async for _ in router.joins():
                pass
        listener = asyncio.create_task(listen())
        await asyncio.sleep(0.5)                        # subscribed
        monkeypatch.setattr(client.PubSub, "aclose", hang)
        monkeypatch.setattr(client.Redis, "aclose", hang)
        started = time.monotonic()
        listener.cancel()
        try:
            await listener
        except asyncio.CancelledError:
            pass
        stopped = time.monotonic() - started
        started = time.monotonic()
        await router.close()
        return stopped, time.monotonic() - started

    stopped, closed = asyncio.run(asyncio.wait_for(run(), 30))
    assert stopped < registry.CLOSE_TIMEOUT + 1.5 and closed < registry.CLOSE_TIMEOUT + 1.5, (stopped, closed)


def test_a_stopped_heartbeat_never_announces_its_worker_again(redis_url):
    """A worker's stop deregisters it; a beat whose cancel came during its Redis call
    (redis-py can lose the cancellation there) used to go on and write the record back,
    so routers kept routing to a draining worker. Stopped at random moments of fast
    beats: the heartbeat has ended and the record is gone, every time."""
    import random

    async def main():
        probe, left, running = RedisRegistry(redis_url, namespace="stop"), 0, 0
        for i in range(60):
            info = worker_pb2.WorkerInfo(role="decode", epoch=f"e{i}", address="x:1")
            beat = Heartbeat(RedisRegistry(redis_url, ttl=0.03, namespace="stop"), lambda info=info: info)
            await beat.start()
            await asyncio.sleep(random.uniform(0, 0.02))
            await beat.stop()
            await asyncio.sleep(0.05)
            running += not beat._task.done()
            left += any(w.epoch == info.epoch for w in await probe.workers())
        await probe.close()
        return left, running
    assert asyncio.run(main()) == (0, 0)
