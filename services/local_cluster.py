"""`pdserve up`: the whole cluster on one machine, one OS process per service.

Start order: the registry (the --redis given, else a private redis-server on a unix
socket if one is installed, else none: the router is given the workers' addresses),
then M decode and N prefill workers (in parallel, each announces its ports when its
model is loaded), and the router: alongside them when there is a registry (it learns
of each worker as it registers, and `up` is up once the router's /ready counts them
all), after them otherwise (it is given their ports). Stop order is the reverse.
Once up, a service that dies is started again, on the same ports, after a backoff (1 s,
doubling to 30 s) while the others keep serving; a dead decode worker's shared KV
memory is removed first.
Children also get SIGTERM if `up` itself is killed, so nothing is left running.

With --autoscale an autoscaler thread (services/autoscaler) resizes the pools through
`resize`: new workers are spawned like the first ones and join through the registry;
a removed worker gets SIGTERM and drains (deregister, refuse new work, finish what it
accepted), and its exit is expected, not a failure. Workers still loading go first.

How each process is started, pinned and waited for is in local_processes.py.
"""
from __future__ import annotations

import asyncio
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Sequence

from services.autoscaler.settings import AutoscalerSettings
from services.common.budgets import MIXED_PREFILL_AGGREGATED_CPU, token_budget
from services.common.devices import device_type
from services.common.security import ClusterSecret, new_secret_file, read_api_keys, redact_url
from services.common.flags import to_argv
from services.common.settings import ClusterSettings, WorkerSettings
from services.common.shm import remove_segments_of
from services.forkserver import ForkServer, adopted_orphans
from services.local_processes import (LENT_CORE_NICE, Child, ChildProcess, assign_gpus, child_setup, plan_cpus,
                                      router_url, start_private_redis, visible_devices, wait_router_sees)

START_TIMEOUT = 600.0
# The router drains up to its --drain-timeout (30 s), then its servers' grace (5 s).
ROUTER_STOP_SECONDS = 45.0
REGISTRY_STOP_SECONDS = 10.0
# A service that dies is started again after 1, 2, 4 ... up to 30 s; one that then lives
# this long has its count of restarts in a row cleared.
RESTART_BACKOFF = (1.0, 30.0)
STABLE_SECONDS = 60.0


class LocalCluster:
    def __init__(self, settings: ClusterSettings, autoscaling: AutoscalerSettings | None = None) -> None:
        self.settings = settings
        self.autoscaling = autoscaling
        self.workdir = Path(tempfile.mkdtemp(prefix="pdserve-up-"))
        self.children: list[Child] = []
        self.pools: dict[str, list[Child]] = {"prefill": [], "decode": []}
        self.draining_children: list[Child] = []
        self._workers: dict[str, WorkerSettings] = {}
        self._serial = {"prefill": itertools.count(), "decode": itertools.count()}
        self._threads = 1
        self._lock = threading.Lock()           # the autoscaler thread resizes the pools
        self._stop = False
        self._scaler: threading.Thread | None = None
        self._scaler_stop = threading.Event()
        self._summary: tuple[dict, str | None] | None = None     # the router's ports, the registry
        self._num_gpus = 0                  # GPUs handed out to workers, one set each
        self._forks: ForkServer | None = None   # services/forkserver.py; None: each starts by exec

    def _spawn(self, name: str, command: str, settings, threads: int, cpus: set[int] | None = None,
               gpus: tuple[int, ...] = (), nice: int = 0, forked: bool = False) -> Child:
        """`forked`: from the fork server, when there is one (workers: the router loads no torch)."""
        announce = self.workdir / f"{name}.json"
        env = dict(os.environ)
        if threads:
            env["OMP_NUM_THREADS"] = str(threads)
        if gpus:                            # the worker's "cuda" is its own GPU(s)
            env["CUDA_VISIBLE_DEVICES"] = visible_devices(gpus, os.environ.get("CUDA_VISIBLE_DEVICES"))

        # The registry URL may carry a password: it travels in the environment, which
        # other users cannot read, not on the command line, which they can.
        if getattr(settings, "redis", None):
            env["PDSERVE_REDIS"] = settings.redis

        def popen(settings=settings) -> ChildProcess:
            argv = [command, *to_argv(replace(settings, announce_file=str(announce)), skip=("redis",))]
            proc = self._forks.spawn(argv, env, cpus, nice) if forked and self._forks else None
            if proc is not None:
                return proc
            if forked and self._forks is not None:      # it could not: say why once, exec from now on
                print(f"pdserve: starting each worker as a fresh interpreter (the fork server: "
                      f"{self._forks.why_not})", flush=True)
                self._close_fork_server()
            return subprocess.Popen([sys.executable, "-m", "services.cli", *argv], env=env,
                                    preexec_fn=child_setup(cpus, nice))
        child = Child(name, popen(), announce, gpus=gpus)

        def respawn() -> ChildProcess:
            # Again on the ports it had, so static addresses (and clients) stay valid.
            bound = child.ports() or {}
            ports = {k: bound[k] for k in ("grpc_port", "http_port", "metrics_port") if k in bound}
            return popen(replace(settings, **{k: v for k, v in ports.items() if hasattr(settings, k)}))
        child.respawn = respawn
        self.children.append(child)
        return child

    # ---- pools (the autoscaler's LocalActuator calls these from its thread) ----
    def _spawn_worker(self, role: str, cpus: set[int] | None = None) -> Child:
        gpus = ()
        if self._num_gpus:
            held = [c.gpus for c in self.pools["prefill"] + self.pools["decode"] + self.draining_children]
            # one GPU per tensor-parallel rank at least
            per = max(self.settings.gpus_per_worker, self.settings.tp(role))
            if self.settings.share_gpus:        # ranks share the cards there are (correctness checks)
                per = min(per, self._num_gpus)
            gpus = assign_gpus(held, self._num_gpus, per, self.settings.share_gpus)
        threads = len(cpus) if cpus else self._threads     # a thread per core it may run on
        lends = role == "prefill" and cpus is not None and len(cpus) > 1    # plan_cpus: on decode cores too
        # a lending prefill worker's own thread is the one on its own core (plan_cpus)
        worker = replace(self._workers[role], threads=threads)
        if lends:
            worker = replace(worker, own_threads=1)
        child = self._spawn(f"{role}-{next(self._serial[role])}", role, worker, threads, cpus, gpus,
                            LENT_CORE_NICE if lends else 0, forked=True)
        self.pools[role].append(child)
        return child

    def pool_size(self, role: str) -> int:
        with self._lock:
            return len(self.pools[role])

    def draining(self, role: str) -> int:
        with self._lock:
            return sum(c.name.startswith(role) for c in self.draining_children)

    def resize(self, role: str, n: int, victims: Sequence[str] = ()) -> None:
        """Spawn workers up to n, or drain down to n: first workers not serving (still
        loading, the youngest first, or dead and waiting to be started again: that start
        is cancelled), then `victims` (registered addresses, best first), then the
        youngest."""
        with self._lock:
            pool = self.pools[role]
            while len(pool) < n:
                print(f"pdserve: starting {self._spawn_worker(role).name}", flush=True)
            ports = {c.name: (c.ports() or {}).get("grpc_port") for c in pool}
            wanted = [a.rpartition(":")[2] for a in victims]
            while len(pool) > n:
                loading = [c for c in pool if ports[c.name] is None or c.proc.poll() is not None]
                named = sorted((c for c in pool if str(ports[c.name]) in wanted),
                               key=lambda c: wanted.index(str(ports[c.name])))
                victim = loading[-1] if loading else named[0] if named else pool[-1]
                pool.remove(victim)
                self.draining_children.append(victim)
                victim.proc.send_signal(signal.SIGTERM)
                print(f"pdserve: draining {victim.name} (pid {victim.proc.pid})", flush=True)

    def _start_autoscaler(self, redis: str) -> None:
        from services.autoscaler.actuators.local import LocalActuator
        from services.autoscaler.service import Autoscaler
        from services.common.registry import RedisRegistry
        settings = replace(self.autoscaling, redis=redis)

        async def run() -> None:
            registry = RedisRegistry(redis, secret=ClusterSecret.from_file(str(self.workdir / "cluster-secret")))
            scaler = Autoscaler(settings, registry, LocalActuator(self), announce=self._announce_change)
            try:
                await scaler.run(self._scaler_stop)
            finally:
                await registry.close()
        self._scaler = threading.Thread(target=asyncio.run, args=(run(),), name="autoscaler", daemon=True)
        self._scaler.start()
        b = settings.limits
        print(f"pdserve: autoscaling prefill {b.prefill.min}-{b.prefill.max}, decode {b.decode.min}-{b.decode.max}"
              f" workers, a decision every {settings.interval:g} s", flush=True)

    @staticmethod
    def _announce_change(change) -> None:
        print(f"pdserve: autoscaler: [{time.strftime('%H:%M:%S', time.localtime(change.at))}] {change.decision}",
              flush=True)

    def _reap_drained(self) -> None:
        with self._lock:
            for c in [c for c in self.draining_children if c.proc.poll() is not None]:
                self.draining_children.remove(c)
                self.children.remove(c)
                removed = remove_segments_of(c.proc.pid)        # what one killed or dead before its drain left
                print(f"pdserve: {c.name} drained and stopped (exit code {c.proc.returncode})"
                      + (f"; removed {len(removed)} shared-memory segment(s)" if removed else ""), flush=True)

    def _api_keys(self) -> dict:
        """The router's keys in one file only its owner reads, not in its argv."""
        keys = read_api_keys(self.settings.api_key, self.settings.api_key_file)
        if not keys:
            return {}
        path = self.workdir / "api-keys"
        path.touch(mode=0o600)
        path.write_text("\n".join(k.line() for k in keys) + "\n")
        return {"api_key": [], "api_key_file": str(path)}

    def _registry(self) -> str | None:
        """The registry URL the services share, or None for static addresses."""
        if self.settings.redis:
            print(f"pdserve: registry: {redact_url(self.settings.redis)}", flush=True)
            return self.settings.redis
        if not self.settings.private_registry:
            print("pdserve: registry: none (--no-private-registry); the router is given the workers' addresses",
                  flush=True)
            return None
        started = start_private_redis(self.workdir)
        if started is None:
            print("pdserve: registry: none (redis-server is not installed); "
                  "the router is given the workers' addresses", flush=True)
            return None
        proc, url = started

        def respawn() -> subprocess.Popen:
            again = start_private_redis(self.workdir)    # the same socket: workers re-register there
            if again is None:
                raise RuntimeError("redis-server is gone")
            return again[0]
        self.children.append(Child("redis", proc, self.workdir / "redis.sock", respawn))
        print(f"pdserve: registry: a private redis-server at {url}", flush=True)
        return url

    def _wait_ready(self, children: list[Child]) -> list[dict]:
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            self._check_children(children)
            ports = [c.ports() for c in children]
            if all(ports):
                return ports
            if time.monotonic() > deadline:
                raise RuntimeError("services did not become ready in time")
            time.sleep(0.05)

    def _check_children(self, children: list[Child] | None = None) -> None:
        """Raises if `up` is stopping or one of `children` (default: all) has exited."""
        if self._stop:
            raise KeyboardInterrupt
        for c in self.children if children is None else children:
            if c.proc.poll() is not None:
                raise RuntimeError(f"{c.name} exited with code {c.proc.returncode} during start-up")

    def run(self) -> int:
        s = self.settings
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._on_signal)
        num_prefill = 0 if s.aggregated else s.num_prefill
        cores = sorted(os.sched_getaffinity(0))
        num_decode = s.num_decode or self._default_decode_workers(len(cores))
        if self.autoscaling:                    # start inside the bounds
            limits = self.autoscaling.limits
            num_decode = min(max(num_decode, limits.decode.min), limits.decode.max)
            num_prefill = min(max(num_prefill, limits.prefill.min), limits.prefill.max)
        workers = num_prefill + num_decode
        # Disaggregated: a core and one torch thread per worker when they fit. Aggregated:
        # each worker shares the cores. Pools that grow and shrink are not pinned: cores
        # are planned once, at start. Tensor-parallel workers: a thread per rank where
        # the cores go round, and no pinning (a worker's ranks inherit its affinity).
        ranks = num_prefill * s.tp("prefill") + num_decode * s.tp("decode")
        self._threads = s.threads or (max(1, len(cores) // ranks) if ranks > workers else
                                      max(1, len(cores) // workers) if s.aggregated else
                                      max(1, len(cores) // max(2, workers)))
        pins = (plan_cpus(["decode"] * num_decode + ["prefill"] * num_prefill, cores, s.lend_decode_cores)
                if s.pin_cpus and self._threads == 1 and not self.autoscaling and ranks == workers
                else [None] * workers)
        self._num_gpus = self._gpus_to_hand_out()
        try:
            if self.autoscaling and s.aggregated:
                raise RuntimeError("--autoscale scales the prefill and decode pools: not with --mode aggregated")
            if num_decode < 1 or (num_prefill < 1 and not s.aggregated):
                raise RuntimeError("--prefill and --decode need at least one worker each")
            if self.autoscaling and not s.redis and shutil.which("redis-server") is None:
                raise RuntimeError("--autoscale needs a Redis registry and redis-server is not installed: "
                                   "`make redis` or `apt-get install redis-server` installs it, or pass --redis URL")
            if s.fork_server:                    # its imports overlap the registry's start
                self._forks = ForkServer.start()
            redis = self._registry()
            secret = str(new_secret_file(self.workdir / "cluster-secret"))
            self._workers = {role: self._worker_settings(role, redis, secret) for role in ("decode", "prefill")}
            decodes = [self._spawn_worker("decode", pins[i]) for i in range(num_decode)]
            prefills = [self._spawn_worker("prefill", pins[num_decode + i]) for i in range(num_prefill)]
            lent = max((len(p) for p in pins[num_decode:] if p), default=1)
            print(f"pdserve: {s.mode}: {num_decode} decode + {num_prefill} prefill worker(s), {self._threads} torch "
                  f"thread(s) each" + (", one core each" if pins[0] else "")
                  + (f"; prefill also on the decode cores ({lent} threads)" if lent > 1 else ""), flush=True)
            keys = self._api_keys()
            if redis:                            # the router's ~3 s start overlaps the workers' loading
                router = self._spawn("router", "router", s.router(redis=redis, cluster_secret_file=secret, **keys), 1)
            ports = self._wait_ready(decodes + prefills)
            dports, pports = ports[:len(decodes)], ports[len(decodes):]
            if not redis:
                router = self._spawn("router", "router", s.router(
                    cluster_secret_file=secret, decode=[f"127.0.0.1:{w['grpc_port']}" for w in dports],
                    prefill=[f"127.0.0.1:{w['grpc_port']}" for w in pports], **keys), 1)
            (rports,) = self._wait_ready([router])
            wait_router_sees(router_url(s, rports["http_port"]), {"prefill": num_prefill, "decode": num_decode},
                             START_TIMEOUT, self._check_children)
            self._banner(rports, pports, dports, redis)
            if self.autoscaling:
                self._start_autoscaler(redis)
            self._summary = (rports, redis)
            while not self._stop:
                self._reap_drained()
                self._supervise()
                self._reap_orphans()
                time.sleep(0.2)
            return 0
        except KeyboardInterrupt:
            return 0
        except (RuntimeError, ValueError) as exc:
            print(f"pdserve: {exc}", file=sys.stderr, flush=True)
            return 1
        finally:
            self.shutdown()

    def _supervise(self) -> None:
        """Start again every service that died (not one draining on purpose), with
        backoff; the rest keep serving. A dead decode worker's shared KV memory is
        removed first: nobody else would ever free it."""
        now = time.monotonic()
        with self._lock:
            for c in self.children:
                if c in self.draining_children or c.respawn is None:
                    continue
                if c.proc.poll() is None:
                    if c.restart_at is None and now - c.started > STABLE_SECONDS:
                        c.restarts = 0
                    if c.announced_pid != c.proc.pid and (c.ports() or {}).get("pid") == c.proc.pid:
                        c.announced_pid = c.proc.pid        # (re)started and serving
                        self._rewrite_summary()
                    continue
                if c.restart_at is None:
                    delay = min(RESTART_BACKOFF[0] * 2 ** c.restarts, RESTART_BACKOFF[1])
                    c.restart_at = now + delay
                    removed = remove_segments_of(c.proc.pid)
                    print(f"pdserve: {c.name} (pid {c.proc.pid}) exited with code {c.proc.returncode}; "
                          f"starting it again in {delay:g} s"
                          + (f" (restart {c.restarts + 1} in a row)" if c.restarts else "")
                          + (f"; removed {len(removed)} shared-memory segment(s)" if removed else ""), flush=True)
                elif now >= c.restart_at:
                    c.restarts += 1
                    try:
                        c.proc = c.respawn()
                    except (OSError, RuntimeError) as exc:
                        c.restart_at = now + min(RESTART_BACKOFF[0] * 2 ** c.restarts, RESTART_BACKOFF[1])
                        print(f"pdserve: {c.name} could not be started again ({exc}); trying later", flush=True)
                        continue
                    c.started, c.restart_at = now, None
                    print(f"pdserve: {c.name} started again (pid {c.proc.pid})", flush=True)

    def _rewrite_summary(self) -> None:
        if self._summary is None:
            return
        rports, redis = self._summary
        router = next((c for c in self.children if c.name == "router"), None)
        rports = {**rports, **((router.ports() or {}) if router else {})}
        ports = {role: [c.ports() or {} for c in pool] for role, pool in self.pools.items()}
        self._banner(rports, ports["prefill"], ports["decode"], redis, quiet=True)

    def _gpus_to_hand_out(self) -> int:
        """On a CUDA machine with --device auto or cuda: how many GPUs `up` hands out,
        one set per worker. A device named by index (cuda:1) is the user's placement."""
        if self.settings.device not in ("auto", "cuda"):
            return 0
        if device_type(self.settings.device) != "cuda":
            return 0
        import torch
        n = torch.cuda.device_count()
        print(f"pdserve: {n} GPU(s); {self.settings.gpus_per_worker} per worker"
              + (", shared when too few" if self.settings.share_gpus else ""), flush=True)
        return n

    def _worker_settings(self, role: str, redis: str | None, secret: str | None) -> WorkerSettings:
        """What each worker of `role` is started with. Aggregated on CPU, with the settings
        automatic, a decode worker's step that decodes takes a prompt of up to the token
        budget whole and a longer one 64 tokens at a time (MIXED_PREFILL_AGGREGATED_CPU
        says why)."""
        s = self.settings
        overrides = {}
        if role == "decode" and self._aggregated_on_cpu():
            if s.mixed_prefill_tokens == -1:
                overrides["mixed_prefill_tokens"] = MIXED_PREFILL_AGGREGATED_CPU
            if s.mixed_whole_prompt_tokens == -1:
                overrides["mixed_whole_prompt_tokens"] = token_budget(s.max_num_batched_tokens, role)
        return s.worker(role, threads=self._threads, redis=redis, cluster_secret_file=secret, **overrides)

    def _aggregated_on_cpu(self) -> bool:
        return self.settings.aggregated and device_type(self.settings.device) == "cpu"

    def _default_decode_workers(self, cores: int) -> int:
        """One, except aggregated on CPU: a single-threaded worker per core. Each then
        runs its own mixed steps with no OpenMP team to keep in step: one worker with a
        thread per core measured 220 output tok/s on 2 cores against 320 for two."""
        return max(1, cores) if self._aggregated_on_cpu() and self.settings.tp("decode") == 1 else 1

    def _banner(self, r: dict, prefills: list[dict], decodes: list[dict], redis: str | None,
                quiet: bool = False) -> None:
        host, http = self.settings.host, router_url(self.settings, r["http_port"], loopback=False)
        summary = {"http": http, "grpc": f"{host}:{r['grpc_port']}",
                   "router_pid": r["pid"], "prefill": prefills[0] if prefills else None, "decode": decodes[0],
                   "prefills": prefills, "decodes": decodes, "redis": redact_url(redis) if redis else None,
                   "cluster_secret_file": str(self.workdir / "cluster-secret"),
                   "redis_pid": next((c.proc.pid for c in self.children if c.name == "redis"), None)}
        workers = [f"{role} worker pid {w['pid']} (gRPC :{w['grpc_port']}, metrics :{w['metrics_port']})"
                   for role, group in (("prefill", prefills), ("decode", decodes)) for w in group]
        if not quiet:
            print(f"pdserve is up: OpenAI-compatible HTTP on {http}/v1, "
                  f"gRPC on {host}:{r['grpc_port']}\n  " + "\n  ".join(workers) + "\n  Ctrl-C stops everything.",
                  flush=True)
        if self.settings.announce_file:
            tmp = Path(self.settings.announce_file + ".tmp")
            tmp.write_text(json.dumps(summary))
            tmp.replace(self.settings.announce_file)

    def _on_signal(self, signum, frame) -> None:
        self._stop = True

    def _reap_orphans(self) -> None:
        """The processes `up` adopted as a subreaper and never started (a dead worker's
        ranks): reaped as they exit. Under the lock: a worker the autoscaler is forking
        is `up`'s child before it is in `children`."""
        with self._lock:
            adopted_orphans({c.proc.pid for c in self.children} | ({self._forks.proc.pid} if self._forks else set()))

    def _close_fork_server(self) -> None:
        forks, self._forks = self._forks, None
        if forks is not None:
            forks.close()

    def shutdown(self) -> None:
        if self._scaler is not None:            # no resize while everything stops
            self._scaler_stop.set()
            self._scaler.join(timeout=30)
        self._close_fork_server()
        # The router drains first, its requests finishing on workers still serving; then
        # the workers (nothing left to drain but what another router sent); last the
        # registry they all read. (Ctrl-C in a terminal reaches every process at once.)
        routers = [c for c in self.children if c.name == "router"]
        workers = [c for c in reversed(self.children) if c.name not in ("router", "redis")]
        registry = [c for c in self.children if c.name == "redis"]
        # Each group its own bound: one's drain takes none of the next's. A worker gets
        # what its own stop may take before it exits as stuck (more with more ranks).
        bounds = (ROUTER_STOP_SECONDS, max(self.settings.worker(role).stop_seconds for role in ("prefill", "decode")),
                  REGISTRY_STOP_SECONDS)
        for group, bound in zip((routers, workers, registry), bounds):
            deadline = time.monotonic() + bound
            for c in group:
                if c.proc.poll() is None:
                    c.proc.send_signal(signal.SIGTERM)
            for c in group:
                try:
                    c.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    c.proc.kill()
                    c.proc.wait()
                    remove_segments_of(c.proc.pid)      # a killed decode worker's pool
        shutil.rmtree(self.workdir, ignore_errors=True)
