"""Worker discovery through Redis: announcements with a heartbeat and a TTL.

    key   <namespace>:worker:<role>:<epoch>   value  WorkerInfo (protobuf bytes)

A worker writes its record every `ttl / 3` seconds with an expiry of `ttl`, so one that
stops heartbeating (killed, hung, cut off) drops out of every router within the TTL.
The key carries the epoch, which changes on every start: a restarted worker is a new
record, never a stale one reused. Graceful shutdown deletes the record first, before
the worker stops taking requests. Routers read all records each refresh.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from services.rpc import worker_pb2

log = logging.getLogger(__name__)

DEFAULT_TTL = 3.0


class RedisRegistry:
    def __init__(self, url: str, namespace: str = "pdserve", ttl: float = DEFAULT_TTL) -> None:
        if ttl <= 0:
            raise ValueError("the registry TTL must be positive")
        self.url = url
        self.namespace = namespace
        self.ttl = ttl
        self._redis = aioredis.from_url(url, socket_timeout=max(1.0, ttl / 2), socket_connect_timeout=2.0)

    def _key(self, role: str, epoch: str) -> str:
        return f"{self.namespace}:worker:{role}:{epoch}"

    async def announce(self, info: worker_pb2.WorkerInfo) -> None:
        await self._redis.set(self._key(info.role, info.epoch), info.SerializeToString(), px=int(self.ttl * 1000))

    async def withdraw(self, role: str, epoch: str) -> None:
        await self._redis.delete(self._key(role, epoch))

    async def workers(self) -> list[worker_pb2.WorkerInfo]:
        keys = [k async for k in self._redis.scan_iter(match=f"{self.namespace}:worker:*", count=500)]
        if not keys:
            return []
        out = []
        for raw in await self._redis.mget(keys):
            if raw is None:                       # expired between SCAN and MGET
                continue
            info = worker_pb2.WorkerInfo()
            try:
                info.ParseFromString(raw)
            except Exception:                    # protobuf's DecodeError; not ours to trust
                log.warning("ignoring an unreadable worker record in %s", self.url)
                continue
            out.append(info)
        return out

    async def close(self) -> None:
        await self._redis.aclose()


class Heartbeat:
    """Announces a worker until stopped; Redis being away is logged, not fatal."""

    def __init__(self, registry: RedisRegistry, info: Callable[[], worker_pb2.WorkerInfo]) -> None:
        self.registry = registry
        self.info = info
        self._task: asyncio.Task | None = None
        self._failing = False

    async def start(self) -> None:
        await self._beat()                        # registered before start() returns
        self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        period = self.registry.ttl / 3
        while True:
            started = time.monotonic()
            await self._beat()
            await asyncio.sleep(max(0.0, period - (time.monotonic() - started)))

    async def _beat(self) -> None:
        try:
            await self.registry.announce(self.info())
            if self._failing:
                log.info("registry %s reachable again", self.registry.url)
            self._failing = False
        except (RedisError, OSError) as exc:
            if not self._failing:
                log.warning("cannot reach the registry %s (%s); routers will drop this worker after %.0f s",
                            self.registry.url, exc, self.registry.ttl)
            self._failing = True

    async def stop(self) -> None:
        """Deregister: routers stop sending new work at their next refresh."""
        if self._task is not None:
            self._task.cancel()
        info = self.info()
        try:
            await self.registry.withdraw(info.role, info.epoch)
        except (RedisError, OSError) as exc:
            log.warning("could not deregister from %s: %s", self.registry.url, exc)
        await self.registry.close()
