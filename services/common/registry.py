"""Worker discovery through Redis: announcements with a heartbeat and a TTL; and what
routers and the autoscaler tell each other there.

    <namespace>:worker:<role>:<epoch>   WorkerInfo (protobuf bytes), TTL
    <namespace>:joins                   a channel: a worker's epoch, when it first announces
    <namespace>:latency:<router id>     LatencyReport: a router's latency per worker, TTL
    <namespace>:autoscaler:status       AutoscalerStatus: the last tick's decisions, TTL
    <namespace>:autoscaler:decisions    hash "<role>:<reason>" -> decisions counted
    <namespace>:autoscaler:bounds       hash of live overrides (min_prefill, max_decode,
                                        budget, ...), written by operators

A worker writes its record every `ttl / 3` seconds with an expiry of `ttl`, so one that
stops heartbeating (killed, hung, cut off) drops out of every router within the TTL.
The key carries the epoch, which changes on every start: a restarted worker is a new
record, never a stale one reused. Graceful shutdown deletes the record first, before
the worker stops taking requests. Routers read all records each refresh, every second,
and at once when a worker publishes its first announcement on the joins channel: a
worker that starts or restarts is routed to without waiting for the next refresh. The
message is only a nudge; what a router routes to is still the signed records it reads.

With a cluster secret (services/common/security.py) every record is signed and a reader
drops, with a warning, any record that is unsigned or signed with another secret: being
able to write to Redis is not enough to be routed users' prompts. The operators' bounds
hash is the exception (written by hand with redis-cli); Redis's own password guards it.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import AsyncIterator, Awaitable, Callable

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from services.common.lifecycle import cancel_and_wait
from services.common.security import ClusterSecret, redact_url
from services.rpc import autoscaler_pb2, worker_pb2

log = logging.getLogger(__name__)

DEFAULT_TTL = 3.0
# redis-py's aclose can wait forever on its socket's close (redis/redis-py#3941): a router
# stopped by `up` was seen to outlive it, hung in the joins listener's cleanup. A close
# waits this long, then the connection is dropped as it is.
CLOSE_TIMEOUT = 2.0


async def _close(closing: Awaitable[None], what: str) -> None:
    try:
        await asyncio.wait_for(closing, CLOSE_TIMEOUT)
    except Exception as exc:                # timed out, or already broken: closed either way
        log.debug("closing %s: %r", what, exc)


class RedisRegistry:
    def __init__(self, url: str, namespace: str = "pdserve", ttl: float = DEFAULT_TTL,
                 secret: ClusterSecret | None = None) -> None:
        if ttl <= 0:
            raise ValueError("the registry TTL must be positive")
        self.url = url
        self.namespace = namespace
        self.ttl = ttl
        self.secret = secret
        self._refused: set[bytes] = set()           # keys already warned about
        self._redis = aioredis.from_url(url, socket_timeout=max(1.0, ttl / 2), socket_connect_timeout=2.0)

    @property
    def where(self) -> str:
        """The registry's address without its credentials, for logs."""
        return redact_url(self.url)

    def _seal(self, message) -> bytes:
        payload = message.SerializeToString()
        return self.secret.sign(payload) if self.secret else payload

    def _key(self, role: str, epoch: str) -> str:
        return f"{self.namespace}:worker:{role}:{epoch}"

    async def announce(self, info: worker_pb2.WorkerInfo, joining: bool = False) -> None:
        await self._redis.set(self._key(info.role, info.epoch), self._seal(info), px=int(self.ttl * 1000))
        if joining:
            await self._redis.publish(f"{self.namespace}:joins", info.epoch)

    async def joins(self) -> AsyncIterator[None]:
        """Once for every worker's first announcement, from the time of the call."""
        pubsub = self._redis.pubsub(ignore_subscribe_messages=True)
        try:
            await pubsub.subscribe(f"{self.namespace}:joins")
            while True:                     # a bounded wait: the connection's socket timeout is short
                if await pubsub.get_message(timeout=1.0) is not None:
                    yield
        finally:
            await _close(pubsub.aclose(), f"the joins channel of {self.where}")

    async def withdraw(self, role: str, epoch: str) -> None:
        await self._redis.delete(self._key(role, epoch))

    async def workers(self) -> list[worker_pb2.WorkerInfo]:
        return self._parse_all(worker_pb2.WorkerInfo, await self._values(f"{self.namespace}:worker:*"))

    # ---- routers <-> autoscaler ----
    async def publish_latency(self, report: autoscaler_pb2.LatencyReport, ttl: float) -> None:
        await self._redis.set(f"{self.namespace}:latency:{report.router_id}", self._seal(report), px=int(ttl * 1000))

    async def latency_reports(self) -> list[autoscaler_pb2.LatencyReport]:
        return self._parse_all(autoscaler_pb2.LatencyReport, await self._values(f"{self.namespace}:latency:*"))

    async def publish_autoscaler(self, status: autoscaler_pb2.AutoscalerStatus, ttl: float) -> None:
        """The tick's status, and one more decision counted per pool by its reason."""
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.set(f"{self.namespace}:autoscaler:status", self._seal(status), px=int(ttl * 1000))
            for pool in status.pools:
                pipe.hincrby(f"{self.namespace}:autoscaler:decisions", f"{pool.role}:{pool.reason}", 1)
            await pipe.execute()

    async def autoscaler_status(self) -> tuple[autoscaler_pb2.AutoscalerStatus | None, dict[tuple[str, str], int]]:
        """The live status (None once it expired: no autoscaler runs) and the decision counts."""
        raw = await self._redis.get(f"{self.namespace}:autoscaler:status")
        counts = await self._redis.hgetall(f"{self.namespace}:autoscaler:decisions")
        decisions = {}
        for key, value in counts.items():
            role, _, reason = key.decode().partition(":")
            decisions[(role, reason)] = int(value)
        status = self._parse_all(autoscaler_pb2.AutoscalerStatus,
                                 [(f"{self.namespace}:autoscaler:status".encode(), raw)] if raw else [])
        return (status[0] if status else None), decisions

    async def bounds_overrides(self) -> dict[str, str]:
        raw = await self._redis.hgetall(f"{self.namespace}:autoscaler:bounds")
        return {k.decode(): v.decode() for k, v in raw.items()}

    async def _values(self, pattern: str) -> list[tuple[bytes, bytes]]:
        keys = [k async for k in self._redis.scan_iter(match=pattern, count=500)]
        if not keys:
            return []
        # a key may expire between SCAN and MGET
        return [(k, raw) for k, raw in zip(keys, await self._redis.mget(keys)) if raw is not None]

    def _open(self, key: bytes, raw: bytes) -> bytes | None:
        if self.secret is None:
            return raw
        payload = self.secret.open(raw)
        if payload is None and key not in self._refused:
            if len(self._refused) > 10_000:
                self._refused.clear()
            self._refused.add(key)
            log.warning("ignoring %s in %s: it is not signed with this cluster's secret", key.decode(errors="replace"),
                        self.where)
        return payload

    def _parse_all(self, message_type, records: list[tuple[bytes, bytes]]) -> list:
        out = []
        for key, raw in records:
            payload = self._open(key, raw)
            if payload is None:
                continue
            message = message_type()
            try:
                message.ParseFromString(payload)
            except Exception:                    # protobuf's DecodeError; not ours to trust
                log.warning("ignoring an unreadable %s record in %s", message_type.__name__, self.where)
                continue
            out.append(message)
        return out

    async def close(self) -> None:
        await _close(self._redis.aclose(), f"the registry at {self.where}")


class Heartbeat:
    """Announces a worker until stopped; Redis being away is logged, not fatal."""

    def __init__(self, registry: RedisRegistry, info: Callable[[], worker_pb2.WorkerInfo]) -> None:
        self.registry = registry
        self.info = info
        self._task: asyncio.Task | None = None
        self._failing = False
        self._stopping = False

    async def start(self) -> None:
        await self._beat(joining=True)            # registered before start() returns, routers nudged
        self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        period = self.registry.ttl / 3
        while not self._stopping:       # a cancel lost inside the Redis client still ends it here
            started = time.monotonic()
            await self._beat()
            await asyncio.sleep(max(0.0, period - (time.monotonic() - started)))

    async def _beat(self, joining: bool = False) -> None:
        try:
            await self.registry.announce(self.info(), joining)
            if self._failing:
                log.info("registry %s reachable again", self.registry.where)
            self._failing = False
        except (RedisError, OSError) as exc:
            if not self._failing:
                log.warning("cannot reach the registry %s (%s); routers will drop this worker after %.0f s",
                            self.registry.where, exc, self.registry.ttl)
            self._failing = True

    async def stop(self) -> None:
        """Deregister: routers stop sending new work at their next refresh. The beats end
        first, so none can announce the worker again after its record is gone."""
        self._stopping = True
        if self._task is not None:
            await cancel_and_wait([self._task], CLOSE_TIMEOUT, "the registry heartbeat")
        info = self.info()
        try:
            await self.registry.withdraw(info.role, info.epoch)
        except (RedisError, OSError) as exc:
            log.warning("could not deregister from %s: %s", self.registry.where, exc)
        await self.registry.close()
