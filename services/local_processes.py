"""The OS processes under `pdserve up` (and the head of `up --ray`): how each child starts
(it dies with `up`, keeps to its cores, yields to decode on cores it borrows), which cores
and GPUs each worker gets, a private redis-server for the registry, and the wait until the
router sees every worker. `Child` is what `up` keeps of each process it started."""
from __future__ import annotations

import ctypes
import json
import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Protocol, Sequence


# The niceness of a prefill worker that also runs on the decode workers' cores: when both
# want a decode core, decode gets ~90 % of it (weights 1024 against 110), so prefill uses
# the time decode leaves and no step of a running stream waits behind it. Measured with
# vLLM's long workload (1,024 in, 8 concurrent; AVX512-BF16 EPYC): ITL p99 / p50 1.71 at
# equal priority, 1.31-1.36 at nice 10, 1.46 with no lending; output 44.3, 43.0-43.6 and
# 42.4 tok/s.
LENT_CORE_NICE = 10
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


def child_setup(cpus: set[int] | None, nice: int = 0):
    """Runs in the child before exec: die with `up`, keep to `cpus` if given, and lower
    its priority by `nice` (every thread the service starts later inherits both)."""
    def setup() -> None:
        _die_with_parent()
        if cpus:
            os.sched_setaffinity(0, cpus)
        if nice:
            os.nice(nice)
    return setup


def plan_cpus(roles: list[str], available: list[int], lend: bool = False) -> list[set[int] | None]:
    """One core of its own per worker when there are enough cores, else no pinning.
    Decode workers then never wait behind a prompt on their core: that isolation is what
    disaggregation buys on one host. With `lend` (`--lend-decode-cores`, off by
    default), each prefill worker also runs on the decode workers' cores (dealt round
    robin among the prefill workers), a thread on each: between decode steps, and while
    decode has little to do, those cores would otherwise sit idle while a long prompt is
    computed on one. Decode keeps its own core and has it first (the prefill worker runs
    at LENT_CORE_NICE). Our matmuls deal work dynamically, but torch's other ops split it
    statically and wait at each barrier for the thread on a busy decode core: with decode
    busy a 1,024-token pass took 4.49 s against 1.35 s on the worker's own core alone."""
    if len(roles) > len(available):
        return [None] * len(roles)
    pins = [{cpu} for cpu in available[:len(roles)]]
    prefill = [i for i, role in enumerate(roles) if role == "prefill"]
    if lend and prefill:
        for n, i in enumerate(i for i, role in enumerate(roles) if role == "decode"):
            pins[prefill[n % len(prefill)]] |= pins[i]
    return pins


def router_url(settings, port: int, loopback: bool = True) -> str:
    """The base URL of a router started with `settings` (its host and TLS files) on
    `port`; with `loopback`, a wildcard host is reached on this machine's loopback."""
    host = settings.host
    if loopback:
        host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)
    return f"{'https' if settings.tls_cert else 'http'}://{f'[{host}]' if ':' in host else host}:{port}"


def wait_router_sees(url: str, workers: dict[str, int], timeout: float, check: Callable[[], None]) -> None:
    """Until the router at `url` counts at least `workers` healthy workers of each role on
    /ready: workers it was not given join through the registry, at its first refresh
    after they register. `check()` runs between probes and raises to give up. The probe
    checks no certificate, as a Kubernetes HTTPS probe does not: it reaches this
    cluster's own router."""
    import ssl
    import urllib.error
    import urllib.request
    unverified = None
    if url.startswith("https:"):
        unverified = ssl.create_default_context()
        unverified.check_hostname, unverified.verify_mode = False, ssl.CERT_NONE
    deadline = time.monotonic() + timeout
    while True:
        try:
            try:
                with urllib.request.urlopen(f"{url}/ready", timeout=5, context=unverified) as r:
                    body = r.read()
            except urllib.error.HTTPError as e:      # 503 until a worker of each role is in
                body = e.read()
            seen = json.loads(body or b"{}").get("workers", {})
        except (OSError, ValueError):                # not listening yet, or not JSON
            seen = {}
        if all(seen.get(role, 0) >= n for role, n in workers.items()):
            return
        check()
        if time.monotonic() > deadline:
            raise RuntimeError(f"the router did not see the workers in {timeout:.0f} s (it sees {seen or 'none'})")
        time.sleep(0.05)


def start_private_redis(workdir: Path) -> tuple[subprocess.Popen, str] | None:
    """A redis-server for this machine only, on a unix socket in `workdir`, stopped with
    its parent: (process, URL), or None when redis-server is not installed."""
    server = shutil.which("redis-server")
    if server is None:
        return None
    sock = workdir / "redis.sock"
    sock.unlink(missing_ok=True)                # left by one that was killed
    proc = subprocess.Popen([server, "--port", "0", "--unixsocket", str(sock), "--unixsocketperm", "700",
                             "--save", "", "--appendonly", "no", "--dir", str(workdir)],
                            stdout=subprocess.DEVNULL, preexec_fn=_die_with_parent)
    deadline = time.monotonic() + 30
    while not sock.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            raise RuntimeError("the private redis-server did not start")
        time.sleep(0.05)
    return proc, f"unix://{sock}"


def assign_gpus(in_use: Sequence[tuple[int, ...]], num_gpus: int, per_worker: int, share: bool) -> tuple[int, ...]:
    """The GPUs for one more worker, given those the live workers hold: `per_worker`
    free ones, lowest first; with `share`, the least used when too few are free. Too
    few without `share` is an error that says what to do."""
    if per_worker > num_gpus:
        raise RuntimeError(f"--gpus-per-worker {per_worker}, but this machine has {num_gpus} GPU(s)")
    load = [0] * num_gpus
    for gpus in in_use:
        for g in gpus:
            load[g] += 1
    free = [g for g in range(num_gpus) if load[g] == 0]
    if len(free) >= per_worker:
        return tuple(free[:per_worker])
    if not share:
        held = len(in_use)
        raise RuntimeError(f"{held + 1} workers at {per_worker} GPU(s) each need {(held + 1) * per_worker} GPUs; "
                           f"this machine has {num_gpus}. Start fewer workers, or pass --share-gpus to place "
                           "several on one GPU (each then needs --gpu-memory-utilization below 1/workers)")
    return tuple(sorted(range(num_gpus), key=lambda g: (load[g], g))[:per_worker])


def visible_devices(gpus: tuple[int, ...], parent: str | None) -> str:
    """CUDA_VISIBLE_DEVICES for a worker handed GPUs by ordinal, as torch counts them
    under `up`'s own CUDA_VISIBLE_DEVICES (`parent`): that list's entries (indices or
    GPU UUIDs), so a worker stays on the GPUs `up` was given (a Slurm job's, a shared
    host's), not on the machine's first ones."""
    if parent is None:
        return ",".join(str(g) for g in gpus)
    entries = [e.strip() for e in parent.split(",")]
    return ",".join(entries[g] for g in gpus)


def check_ports_free(host: str, ports: dict[str, int]) -> None:
    """ValueError naming the flag whose port another process holds on `host`, before
    `up` starts anything (the router binds them last, after the workers have loaded)."""
    for flag, port in ports.items():
        if port == 0:
            continue
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)       # as the router binds it
            try:
                s.bind((host, port))
            except OSError as exc:
                raise ValueError(f"{flag} {port}: cannot listen on {host}:{port} ({exc.strerror})") from None


def child_pids(pid: int | str = "self") -> set[int]:
    """The processes whose parent is `pid` (any of its threads), from /proc; OSError if
    it is gone."""
    return {int(k) for task in Path(f"/proc/{pid}/task").iterdir() for k in (task / "children").read_text().split()}


class ChildProcess(Protocol):
    """What `up` uses of a process it started: a subprocess.Popen, or a worker forked by
    the fork server (services/forkserver.py: ForkedProcess)."""
    pid: int
    returncode: int | None

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def send_signal(self, sig: int) -> None: ...

    def kill(self) -> None: ...


@dataclass
class Child:
    name: str
    proc: ChildProcess
    announce: Path
    respawn: Callable[[], ChildProcess] | None = None    # None: not restarted when it dies
    started: float = field(default_factory=time.monotonic)
    restarts: int = 0                   # in a row, without a long enough life in between
    restart_at: float | None = None     # when a dead child is started again
    announced_pid: int | None = None
    gpus: tuple[int, ...] = ()          # the GPUs it sees (CUDA_VISIBLE_DEVICES)

    def ports(self) -> dict | None:
        try:
            return json.loads(self.announce.read_text())
        except (OSError, ValueError):
            return None
