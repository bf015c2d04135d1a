"""`pdserve up --ray` and `pdserve scale`: the same router, prefill and decode services as
Ray actors, on one machine or on a Ray cluster.

    up --ray   join --address, or start a Ray instance on this machine (loopback only, with
               `prefill` and `decode` resources) -> registry: --redis, else a private
               redis-server when the cluster is one node -> M decode and N prefill worker
               actors -> the router actor on this node -> run until Ctrl-C / SIGTERM
    stop       router -> every worker drains (deregister, finish accepted requests, stop)
               and its actor is killed -> ray.shutdown() -> redis; the processes of a Ray
               instance `up` started are checked gone, PID by PID
    scale      RayPools.apply({"decode": 3}) adds actors named pdserve-<role>-<i> with a
               running worker's settings, or drains and removes the newest ones

Each actor runs the service's own entry point (`run_worker`, the router's `serve`) on an
event loop in a thread of its own; `ServiceActor.stop` sets the event SIGTERM sets in a
process. Workers bind and advertise their node's IP, so a router on another node reaches
them. Actors are detached and named in the "pdserve" namespace: a separate `pdserve scale`
or an autoscaler finds and counts them through Ray, and `up` removes them when it stops.
A worker whose process dies (or whose service ends by itself: a worker that gave up on
failing steps exits) is started again by Ray under its name, and serves again.
"""
from __future__ import annotations

import asyncio
import dataclasses
import ipaddress
import json
import logging
import os
import re
import shutil
import signal
import tempfile
import threading
import time
from pathlib import Path

from services.common.lifecycle import announce, setup_logging
from services.common.security import redact_url
from services.common.settings import ClusterSettings, RouterSettings, WorkerSettings
from services.local_processes import router_url, start_private_redis, wait_router_sees

log = logging.getLogger(__name__)

NAMESPACE = "pdserve"
ROLES = ("prefill", "decode")
ROUTER = "pdserve-router"
START_TIMEOUT = 600.0
# A worker's actor is started again, after RESTART_DELAY, whenever its process dies (Ray
# keeps its name and placement): as `up` restarts a dead worker.
WORKER_RESTARTS = -1
RESTART_DELAY = 2.0
STOP_GRACE = 15.0                      # after the drain: the gRPC server's own stop, teardown
STOP_TIMEOUT = 120.0                   # what a caller waits for stop(): drain timeout + grace
NAME_RELEASE_TIMEOUT = 15.0
ROUTABLE_TIMEOUT = 30.0                # the router's registry refresh runs every second
LOCAL_SLOTS = 16                       # prefill and decode actors a local instance places
OBJECT_STORE_BYTES = 80 * 1024 * 1024  # no data goes through Ray's object store
PROCESS_EXIT_TIMEOUT = 15.0
_WORKER_NAME = re.compile(r"^pdserve-(prefill|decode)-(\d+)$")


def worker_name(role: str, index: int) -> str:
    return f"pdserve-{role}-{index}"


def placement(role: str, cluster_resources: dict[str, float], gpus: int = 1) -> dict:
    """Ray options that place a worker: `gpus` GPUs (one per tensor-parallel rank) when
    the cluster has GPUs, and one unit of the custom resource named after its role when
    nodes define it (`ray start --resources='{"decode": 4}'` marks a node for four decode
    workers)."""
    options: dict = {"num_cpus": 0}
    if cluster_resources.get("GPU", 0) >= 1:
        options["num_gpus"] = gpus
    if cluster_resources.get(role, 0) >= 1:
        options["resources"] = {role: 1}
    return options


def parse_counts(items: list[str]) -> dict[str, int]:
    """["prefill=2", "decode=3"] -> {"prefill": 2, "decode": 3}."""
    counts = {}
    for item in items:
        role, sep, n = item.partition("=")
        if not sep or role not in ROLES or not n.isdigit():
            raise ValueError(f"expected prefill=N or decode=N, not {item!r}")
        counts[role] = int(n)
    return counts


def _is_loopback(address: str) -> bool:
    host = address.rpartition(":")[0] or address
    try:
        return host == "localhost" or ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def connect(address: str | None, temp_dir: Path | None = None, log_to_driver: bool = True):
    """Join the Ray cluster at `address` ("auto": the one RAY_ADDRESS or `ray start` names),
    or start a Ray instance on this machine when it is None. Returns the `ray` module."""
    local = address is None or _is_loopback(address)
    if local:
        # Ray names a node by the host's outward address even when asked for 127.0.0.1;
        # its switch for single-machine platforms keeps a local instance on loopback and
        # lets another process join one by a loopback address. Read when ray is imported.
        os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    import ray
    common = {"namespace": NAMESPACE, "logging_level": logging.WARNING, "log_to_driver": log_to_driver}
    if address is not None:
        if local:
            # A local instance uses Ray's default token auth. ray.init enables it on the
            # client only for address="auto"; do the same for this machine's instance.
            from ray._private.authentication.authentication_token_setup import (
                maybe_enable_token_auth_if_token_available)
            maybe_enable_token_auth_if_token_available(warn_if_disabled=False)
        ray.init(address=address, **common)
    else:
        ray.init(num_cpus=os.cpu_count() or 1, resources={role: LOCAL_SLOTS for role in ROLES},
                 include_dashboard=False, object_store_memory=OBJECT_STORE_BYTES,
                 _temp_dir=str(temp_dir) if temp_dir else None, **common)
    return ray


class StopRequest:
    """A stop asked for from any thread, delivered to a service's event loop once it runs:
    the event SIGTERM sets in a `pdserve prefill|decode|router` process."""

    def __init__(self) -> None:
        self._asked = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._event: asyncio.Event | None = None

    def attach(self) -> asyncio.Event:
        """On the service's loop: the event to serve until."""
        self._event, self._loop = asyncio.Event(), asyncio.get_running_loop()
        if self._asked.is_set():
            self._event.set()
        return self._event

    @property
    def asked(self) -> bool:
        return self._asked.is_set()

    def ask(self) -> None:
        self._asked.set()
        if self._loop is not None:
            try:
                self._loop.call_soon_threadsafe(self._event.set)
            except RuntimeError:                 # the loop has already ended
                pass


async def _service(settings: WorkerSettings | RouterSettings, stop: StopRequest) -> int:
    """What a `pdserve router|prefill|decode` process runs; its exit status."""
    if isinstance(settings, RouterSettings):
        from services.router.server import serve
        await serve(settings, stop.attach())
        return 0
    from services.worker.main import run_worker
    if settings.role == "decode":
        from services.decode.worker import build
    else:
        from services.prefill.worker import build
    return await run_worker(settings, build, stop.attach())


class ServiceActor:
    """One pdserve service inside a Ray actor: `start` runs it and returns where it
    listens, `stop` drains it as SIGTERM would, `wait` returns once it has ended. (No
    `async def` here: Ray would make it an asyncio actor, whose blocking start and wait
    would hold the loop stop needs.)"""

    def __init__(self, name: str, settings: WorkerSettings | RouterSettings) -> None:
        self.name = name
        self.settings = settings
        self._thread: threading.Thread | None = None
        self._stop = StopRequest()
        self._error: str | None = None
        self._announced = False
        import ray
        if ray.get_runtime_context().was_current_actor_reconstructed:
            # Ray started this worker's actor again (WORKER_RESTARTS) after its process
            # died (a crash, the OOM killer, a worker that gave up on failing steps): it
            # serves again under its name, as `up` restarts a dead worker.
            log.warning("%s: its process died; starting it again in %g s", name, RESTART_DELAY)
            time.sleep(RESTART_DELAY)           # a worker that cannot start is not restarted at once, forever
            self.start()

    def __repr__(self) -> str:                  # Ray prefixes the actor's log lines with it
        return self.name

    def worker_settings(self) -> WorkerSettings | RouterSettings:
        return self.settings

    def start(self, timeout: float = START_TIMEOUT) -> dict:
        import ray
        ip = ray.util.get_node_ip_address()
        workdir = Path(tempfile.mkdtemp(prefix=f"{self.name}-"))
        path = workdir / "announce.json"
        if isinstance(self.settings, WorkerSettings):
            settings = dataclasses.replace(self.settings, host=ip, advertise=ip, announce_file=str(path))
        else:
            settings = dataclasses.replace(self.settings, announce_file=str(path))
        setup_logging(settings.log_level, self.name, settings.log_format)
        self._thread = threading.Thread(target=self._run, args=(settings,), name=self.name, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        try:
            while not path.exists():
                if not self._thread.is_alive():
                    raise RuntimeError(f"{self.name} failed to start: {self._error}")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{self.name} did not start in {timeout:.0f} s")
                time.sleep(0.05)
            self._announced = True
            return {"name": self.name, "node_ip": ip, **json.loads(path.read_text())}
        finally:
            shutil.rmtree(workdir, ignore_errors=True)

    def _run(self, settings: WorkerSettings | RouterSettings) -> None:
        status = 1
        try:
            status = asyncio.run(_service(settings, self._stop)) or 0
        except Exception as exc:                 # reported by start() and wait()
            self._error = f"{type(exc).__name__}: {exc}"
            log.exception("%s failed", self.name)
        if status and isinstance(settings, WorkerSettings) and not self._stop.asked and self._announced:
            # A worker that ended by itself after serving: its process ends too, so Ray
            # starts the actor again (a failure to start is start()'s to report).
            logging.shutdown()
            os._exit(70)

    def stop(self) -> str | None:
        """Deregister, finish accepted requests (up to the drain timeout) and stop."""
        self._stop.ask()
        return self.wait(getattr(self.settings, "drain_timeout", 0.0) + STOP_GRACE)

    def wait(self, timeout: float | None = None) -> str | None:
        """Block until the service has ended (or `timeout`); its error, if it failed."""
        if self._thread is not None:
            self._thread.join(timeout)
        return self._error


# Threads for start/wait/stop/worker_settings at once: stop() must reach an actor whose
# start() or wait() is still blocked.
ACTOR_OPTIONS = {"namespace": NAMESPACE, "lifetime": "detached", "max_concurrency": 4}


def actor_names(ray) -> set[str]:
    """Every live actor of pdserve's namespace on the connected cluster."""
    return {a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == NAMESPACE}


class RayPools:
    """The prefill and decode pools as named Ray actors: what `pdserve scale` drives, and
    the actuator an autoscaler can call. Needs a connected `ray` (see `connect`). New
    workers take `template`'s settings (role replaced), else a running worker's."""

    def __init__(self, ray, template: WorkerSettings | None = None, start_timeout: float = START_TIMEOUT,
                 tp: dict[str, int] | None = None) -> None:
        """`tp`: each role's tensor-parallel size, where it differs from the template's."""
        self.ray = ray
        self.template = template
        self.tp = tp or {}
        self.start_timeout = start_timeout
        self._actor = ray.remote(ServiceActor)

    def names(self, role: str) -> list[str]:
        """The role's live actors, oldest index first."""
        found = [(int(m[2]), m[0]) for m in map(_WORKER_NAME.match, actor_names(self.ray)) if m and m[1] == role]
        return [name for _, name in sorted(found)]

    def counts(self) -> dict[str, int]:
        return {role: len(self.names(role)) for role in ROLES}

    def scale(self, role: str, n: int) -> list[dict]:
        return self.apply({role: n})

    def apply(self, counts: dict[str, int]) -> list[dict]:
        """Add or remove workers until each pool named in `counts` has its size. Returns
        when the new workers are serving (and registered) and the removed ones have
        drained and stopped; returns the new workers' addresses."""
        for role, n in counts.items():
            if role not in ROLES or n < 0:
                raise ValueError(f"a pool size is prefill=N or decode=N with N >= 0, not {role}={n}")
        current = {role: self.names(role) for role in counts}
        starting = [s for role, n in counts.items() if n > len(current[role])
                    for s in self._add(role, n - len(current[role]), current[role])]
        try:
            self._remove([name for role, n in counts.items() for name in current[role][n:]])
        finally:
            started = self._wait_started(starting)
        return started

    def _template_for(self, role: str) -> WorkerSettings:
        """A new `role` worker's settings: the template's, else a running worker's (of
        the role where one runs, else of the other pool), with the role's own
        tensor-parallel size where `tp` names one."""
        template = self.template
        if template is None:
            names = self.names(role) or [n for r in ROLES for n in self.names(r)]
            if not names:
                raise RuntimeError("no pdserve worker runs on this Ray cluster to copy settings from; "
                                   "start the cluster with `pdserve up --ray`")
            actor = self.ray.get_actor(names[0], namespace=NAMESPACE)
            template = self.ray.get(actor.worker_settings.remote(), timeout=60)
        return dataclasses.replace(template, role=role,
                                   tensor_parallel_size=self.tp.get(role, template.tensor_parallel_size))

    def _add(self, role: str, k: int, existing: list[str]) -> list[tuple]:
        template = self._template_for(role)
        options = placement(role, self.ray.cluster_resources(), template.tensor_parallel_size)
        taken, index, out = set(existing), 0, []
        for _ in range(k):
            while worker_name(role, index) in taken:
                index += 1
            name = worker_name(role, index)
            taken.add(name)
            actor = self._actor.options(name=name, max_restarts=WORKER_RESTARTS, **ACTOR_OPTIONS,
                                        **options).remote(name, template)
            out.append((name, actor, actor.start.remote(self.start_timeout)))
        return out

    def _wait_started(self, starting: list[tuple]) -> list[dict]:
        started, failed = [], []
        for name, actor, ready in starting:
            try:
                started.append(self.ray.get(ready, timeout=self.start_timeout + 30))
            except Exception as exc:             # Ray's wrapper keeps the actor's error as .cause
                failed.append(f"{name}: {getattr(exc, 'cause', None) or exc}")
                self.ray.kill(actor)
        if failed:
            raise RuntimeError("workers failed to start: " + "; ".join(failed))
        return started

    def _remove(self, names: list[str]) -> None:
        if not names:
            return
        actors = [self.ray.get_actor(name, namespace=NAMESPACE) for name in names]
        stopping = [actor.stop.remote() for actor in actors]
        self.ray.wait(stopping, num_returns=len(stopping), timeout=STOP_TIMEOUT)
        for name, actor, ref in zip(names, actors, stopping):
            try:
                error = self.ray.get(ref, timeout=0)
            except Exception as exc:             # the actor died or never answered
                error = str(exc)
            if error:
                log.warning("%s stopped with an error: %s", name, error)
            self.ray.kill(actor)
        deadline = time.monotonic() + NAME_RELEASE_TIMEOUT
        while set(names) & actor_names(self.ray):
            if time.monotonic() > deadline:
                raise RuntimeError(f"Ray did not release the names of {', '.join(names)}")
            time.sleep(0.1)


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


class RayCluster:
    """`pdserve up --ray`: start everything, keep running, stop everything."""

    def __init__(self, settings: ClusterSettings) -> None:
        self.settings = settings
        self.workdir = Path(tempfile.mkdtemp(prefix="pdserve-ray-"))
        self.ray = None
        self.started_ray = settings.address is None
        self.owns_actors = False
        self.router = None
        self.redis = None                       # a private redis-server this process started
        self.registry_url: str | None = None
        self.ray_pids: set[int] = set()

    def run(self) -> int:
        a = self.settings
        try:
            if a.num_prefill < 1 or a.num_decode < 0:
                raise RuntimeError("--prefill and --decode need at least one worker each")
            if a.mode != "disaggregated" or a.autoscale:
                raise RuntimeError("--ray runs --mode disaggregated pools, resized with `pdserve scale` "
                                   "(not --mode aggregated, not --autoscale)")
            self.ray = connect(a.address, self.workdir / "ray")
            for sig in (signal.SIGINT, signal.SIGTERM):      # after ray.init, which sets its own
                signal.signal(sig, _interrupt)
            self._note_ray_processes()
            if running := actor_names(self.ray):
                raise RuntimeError(f"pdserve already runs on this Ray cluster ({', '.join(sorted(running))}); "
                                   "change its pools with `pdserve scale`")
            self.owns_actors = True
            self.registry_url = self._registry()
            pools = RayPools(self.ray, self._worker_template(self.registry_url),
                             tp={role: self.settings.tp(role) for role in ROLES})
            router_ready = self._start_router(self.registry_url)    # finds the workers in the registry
            sizes = {"decode": a.num_decode or 1, "prefill": a.num_prefill}
            workers = pools.apply(sizes)
            router = self.ray.get(router_ready)
            wait_router_sees(router_url(a, router["http_port"]), sizes, ROUTABLE_TIMEOUT, lambda: None)
            self._banner(router, workers)
            done = self.router.wait.remote()
            while not self.ray.wait([done], timeout=1.0)[0]:
                pass
            print(f"pdserve: the router stopped ({self.ray.get(done)}); stopping", flush=True)
            return 1
        except KeyboardInterrupt:
            return 0
        except (RuntimeError, ValueError) as exc:
            print(f"pdserve: {exc}", flush=True)
            return 1
        finally:
            self.shutdown()

    def _note_ray_processes(self) -> None:
        if self.started_ray:
            import psutil
            self.ray_pids |= {p.pid for p in psutil.Process().children(recursive=True)}

    def _registry(self) -> str:
        if self.settings.redis:
            print(f"pdserve: registry: {redact_url(self.settings.redis)}", flush=True)
            return self.settings.redis
        if sum(node["Alive"] for node in self.ray.nodes()) > 1:
            raise RuntimeError("a Ray cluster of several nodes needs --redis URL, a Redis every node reaches")
        started = start_private_redis(self.workdir)
        if started is None:
            raise RuntimeError("pdserve up --ray needs --redis URL, or redis-server installed to start one")
        self.redis, url = started
        print(f"pdserve: registry: a private redis-server at {url}", flush=True)
        return url

    def _worker_template(self, redis: str) -> WorkerSettings:
        a = self.settings
        return a.worker("decode", threads=a.threads or max(1, (os.cpu_count() or 2) // 2), redis=redis)

    def _start_router(self, redis: str):
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
        settings = self.settings.router(redis=redis)
        here = NodeAffinitySchedulingStrategy(self.ray.get_runtime_context().get_node_id(), soft=False)
        actor = self.ray.remote(ServiceActor).options(name=ROUTER, num_cpus=0, scheduling_strategy=here,
                                                      **ACTOR_OPTIONS)
        self.router = actor.remote(ROUTER, settings)
        return self.router.start.remote(START_TIMEOUT)

    def _banner(self, router: dict, workers: list[dict]) -> None:
        host, address = self.settings.host, self.ray.get_runtime_context().gcs_address
        for w in workers:
            w["address"] = f"{w['node_ip']}:{w['grpc_port']}"
        by_role = {role: [w for w in workers if w["name"].startswith(f"pdserve-{role}-")] for role in ROLES}
        lines = [f"{w['name']} pid {w['pid']} on {w['address']} (metrics :{w['metrics_port']})" for w in workers]
        where = f"a Ray instance on this machine at {address}" if self.started_ray else f"the Ray cluster at {address}"
        http = router_url(self.settings, router["http_port"], loopback=False)
        print(f"pdserve is up on {where}: OpenAI-compatible HTTP on {http}/v1, "
              f"gRPC on {host}:{router['grpc_port']}\n  " + "\n  ".join(lines) +
              f"\n  `pdserve scale --address {address} decode=N prefill=N` resizes the pools; "
              "Ctrl-C stops everything.", flush=True)
        announce(self.settings.announce_file, http=http,
                 grpc=f"{host}:{router['grpc_port']}", router_pid=router["pid"], ray_address=address,
                 ray_started=self.started_ray, redis=self.registry_url and redact_url(self.registry_url),
                 prefills=by_role["prefill"], decodes=by_role["decode"])

    def shutdown(self) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):          # the drain is not to be cut short
            signal.signal(sig, signal.SIG_IGN)
        ray = self.ray
        if ray is not None and ray.is_initialized():
            try:
                if self.owns_actors:
                    self._stop_actors()
            finally:
                self._note_ray_processes()
                ray.shutdown()
        if self.redis is not None:
            self.redis.terminate()
            self.redis.wait(timeout=10)
        self._check_ray_processes_gone()
        shutil.rmtree(self.workdir, ignore_errors=True)

    def _stop_actors(self) -> None:
        if self.router is not None:
            try:
                # as long as its own stop may take (its drain, then STOP_GRACE), and a margin:
                # killed sooner, requests still draining would end in a cut connection
                drain = self.settings.router().drain_timeout
                self.ray.get(self.router.stop.remote(), timeout=drain + STOP_GRACE + 5)
            except Exception as exc:                 # stopping anyway
                log.warning("the router did not stop cleanly: %s", exc)
            self.ray.kill(self.router)
        RayPools(self.ray).apply({role: 0 for role in ROLES})

    def _check_ray_processes_gone(self) -> None:
        """ray.shutdown() stops the instance `up` started; make sure, process by process."""
        if not self.ray_pids:
            return
        import psutil
        procs = []
        for pid in self.ray_pids:
            try:
                procs.append(psutil.Process(pid))
            except psutil.NoSuchProcess:
                pass
        _, alive = psutil.wait_procs(procs, timeout=PROCESS_EXIT_TIMEOUT)
        if alive:
            print(f"pdserve: Ray processes still running after shutdown, killed: "
                  f"{sorted(p.pid for p in alive)}", flush=True)
            for p in alive:
                p.kill()


def scale_command(args) -> int:
    """`pdserve scale prefill=N decode=M [--address ADDR]`."""
    counts = parse_counts(args.counts)
    ray = connect(args.address or "auto", log_to_driver=False)
    try:
        pools = RayPools(ray)
        before = pools.counts()
        pools.apply(counts)
        after = pools.counts()
        print("pdserve: " + ", ".join(f"{role} {before[role]} -> {after[role]}" for role in ROLES), flush=True)
        return 0
    except RuntimeError as exc:
        print(f"pdserve scale: {exc}", flush=True)
        return 1
    finally:
        ray.shutdown()
