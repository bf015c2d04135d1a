"""The autoscaler's loop against a real Redis: worker records and a router's latency
reports in, decisions to an actuator, status and decision counts out to the registry,
and a router's /metrics exporting them. Workers are registry records written by the
test (no model runs here); tests/test_autoscaler_live.py runs real processes."""
from __future__ import annotations

import asyncio
import shutil
import threading
import time
from dataclasses import replace

import pytest

from services.autoscaler.actuators import PoolSize, actuator_class
from services.autoscaler.actuators.ray import RayActuator
from services.autoscaler.core import Limits, Policy, PoolBounds, Reason, Role
from services.autoscaler.service import Autoscaler, limits_with_overrides
from services.common.metrics import RouterMetrics
from services.common.registry import RedisRegistry
from services.autoscaler.settings import AutoscalerSettings
from services.common.settings import RouterSettings
from services.router.cluster import Cluster
from services.rpc import worker_pb2

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None,
                                reason="redis-server is not installed (make test installs it)")

POLICY = Policy(slo_ttft=1.0, slo_itl=0.1, window=30, min_samples=5, warmup=10, scale_out_cooldown=0,
                scale_in_cooldown=0, scale_in_after=600, manual_hold=60)
EAGER = replace(POLICY, scale_in_after=0)       # scales in on the first calm tick
LIMITS = Limits(PoolBounds(1, 3), PoolBounds(1, 4))


class RecordingActuator:
    """A pool of the size it was last set to; remembers every call."""
    name = "recording"

    def __init__(self, **sizes: int) -> None:
        self.sizes = {Role(k): v for k, v in sizes.items()}
        self.calls: list[tuple[Role, int, list[str]]] = []

    def observe(self, role: Role, registered: int) -> PoolSize:
        return PoolSize(self.sizes[role])

    def scale(self, role: Role, replicas: int, victims) -> bool:
        self.calls.append((role, replicas, list(victims)))
        self.sizes[role] = replicas
        return True


def worker(role: str, epoch: str, port: int, started_at: float, **load) -> worker_pb2.WorkerInfo:
    return worker_pb2.WorkerInfo(role=role, epoch=epoch, address=f"127.0.0.1:{port}", started_at=started_at,
                                 num_blocks=1000, free_blocks=1000, **load)


def test_decisions_flow_from_the_registry_to_the_actuator_and_back_to_the_router(redis_url):
    async def scenario():
        registry = RedisRegistry(redis_url, ttl=30)
        now = time.time()
        for info in (worker("prefill", "p0", 7001, now - 60), worker("decode", "d0", 7002, now - 60),
                     worker("decode", "d1", 7003, now - 60, running=3)):
            await registry.announce(info)
        router = Cluster(RouterSettings(redis=redis_url, registry_ttl=30), None, RouterMetrics("m"))
        await router.workers.refresh()
        actuator = RecordingActuator(prefill=1, decode=2)
        scaler = Autoscaler(AutoscalerSettings(redis_url, POLICY, LIMITS, interval=1), registry, actuator)

        await scaler.tick()                     # learns who is warm; the router's counts so far are its baseline
        for _ in range(40):                     # decode gaps 3x the ITL SLO on d0, prefill well within SLO
            router.latency.observe_itl("d0", 0.3)
            router.latency.observe_ttft("p0", 0.2)
        await router.workers.refresh()   # publishes the latency report
        decisions = await scaler.tick()
        assert decisions[Role.DECODE].reason is Reason.SCALE_OUT_SLO, decisions[Role.DECODE]
        assert decisions[Role.PREFILL].reason is Reason.HOLD, decisions[Role.PREFILL]
        assert actuator.calls == [(Role.DECODE, 4, [])]                 # x3 on two workers: doubled
        assert [c.decision.role for c in scaler.timeline] == [Role.DECODE]

        await router.workers.refresh()   # reads the status back
        text = router.metrics.render().decode()
        assert f'pdserve_autoscaler_desired_replicas{{role="decode"}} {actuator.sizes[Role.DECODE]}.0' in text
        assert 'pdserve_autoscaler_desired_replicas{role="prefill"} 1.0' in text
        assert 'pdserve_autoscaler_decisions_total{reason="scale_out_slo",role="decode"} 1.0' in text
        assert 'pdserve_autoscaler_decisions_total{reason="hold",role="prefill"} 2.0' in text
        await router.stop()
        await registry.close()
    asyncio.run(scenario())


def test_scale_in_drains_the_least_loaded_worker_and_live_bounds_apply(redis_url):
    async def scenario():
        registry = RedisRegistry(redis_url, ttl=30)
        now = time.time()
        for info in (worker("prefill", "p0", 7001, now - 60), worker("decode", "busy", 7002, now - 60, running=5),
                     worker("decode", "idle", 7003, now - 60)):
            await registry.announce(info)
        actuator = RecordingActuator(prefill=1, decode=2)
        scaler = Autoscaler(AutoscalerSettings(redis_url, EAGER, LIMITS, interval=1), registry, actuator)
        await scaler.tick()
        assert actuator.calls == [(Role.DECODE, 1, ["127.0.0.1:7003"])]

        await registry._redis.hset("pdserve:autoscaler:bounds", mapping={"min_prefill": 2, "max_prefill": 2})
        decisions = await scaler.tick()
        assert decisions[Role.PREFILL].reason is Reason.BOUNDS and actuator.sizes[Role.PREFILL] == 2
        await registry._redis.hset("pdserve:autoscaler:bounds", "min_decode", "banana")
        decisions = await scaler.tick()          # refused as a whole: the command line's bounds again
        assert scaler._refused and "banana" in scaler._refused
        await registry.close()
    asyncio.run(scenario())


def test_live_bounds_parse_or_are_refused():
    limits, refused = limits_with_overrides(LIMITS, {"max_decode": "6", "budget": "5"})
    assert (limits.decode.max, limits.budget, refused) == (6, 5, None)
    assert limits_with_overrides(LIMITS, {"budget": "none"})[0].budget is None
    for bad in ({"min_decode": "5"}, {"max_prefill": "x"}, {"budget": "1"}):
        limits, refused = limits_with_overrides(LIMITS, bad)
        assert limits == LIMITS and refused


def test_report_actuator_changes_nothing_and_the_planner_knows_it(redis_url):
    async def scenario():
        registry = RedisRegistry(redis_url, ttl=30)
        now = time.time()
        for info in (worker("prefill", "p0", 7001, now - 60), worker("decode", "d0", 7002, now - 60),
                     worker("decode", "d1", 7003, now - 60)):
            await registry.announce(info)
        scaler = Autoscaler(AutoscalerSettings(redis_url, EAGER, LIMITS, interval=1), registry,
                            actuator_class("report")())
        await scaler.tick()
        for _ in range(3):                      # it would scale in each tick; nothing is set, no "manual" edit
            decisions = await scaler.tick()
            assert decisions[Role.DECODE].reason is Reason.SCALE_IN and decisions[Role.DECODE].current == 2
        await registry.close()
    asyncio.run(scenario())


def test_ray_actuator_is_a_thin_adapter_over_ray_pools():
    """RayPools.scale blocks until workers serve or have drained: the adapter runs it on
    a thread, reports the target meanwhile (actors still stopping as draining), and
    applies the latest target when several come in during one call."""
    class FakeRayPools:                         # the surface of services/ray_cluster.RayPools
        def __init__(self) -> None:
            self.n = {"prefill": 1, "decode": 3}
            self.calls: list[tuple[str, int]] = []
            self.release = threading.Event()

        def scale(self, role: str, n: int) -> list[dict]:
            self.calls.append((role, n))
            self.release.wait(10)
            self.n[role] = n
            return []

        def counts(self) -> dict[str, int]:
            return dict(self.n)

    pools = FakeRayPools()
    ray = RayActuator(pools)
    assert ray.observe(Role.DECODE, 0) == PoolSize(3)
    assert ray.scale(Role.DECODE, 2, ["ignored:1"])
    assert ray.observe(Role.DECODE, 0) == PoolSize(2, draining=1)           # returned at once
    deadline = time.monotonic() + 10
    while not pools.calls:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    ray.scale(Role.DECODE, 1, [])                                           # during the first call
    pools.release.set()
    ray.wait(10)
    assert pools.calls == [("decode", 2), ("decode", 1)] and ray.observe(Role.DECODE, 0) == PoolSize(1)
    # a target that fails (a worker that cannot start) stays the pool's setting: capacity
    # pending to the autoscaler, which gives it up after its pending timeout, not a change
    # made outside it; the next target replaces it
    pools.scale = lambda role, n: (_ for _ in ()).throw(RuntimeError("workers failed to start"))
    ray.scale(Role.PREFILL, 2, [])
    ray.wait(10)
    assert ray.observe(Role.PREFILL, 0) == PoolSize(2) and pools.counts()["prefill"] == 1
    pools.scale = FakeRayPools.scale.__get__(pools)
    ray.scale(Role.PREFILL, 1, [])
    ray.wait(10)
    assert ray.observe(Role.PREFILL, 0) == PoolSize(1)
    assert actuator_class("ray") is RayActuator
    with pytest.raises(ValueError):
        actuator_class("nomad")
