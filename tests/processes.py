"""What the tests share besides their fixtures (tests/conftest.py): starting the real
services as separate processes (`pdserve up`, or one service at a time), stopping them
by PID, and talking to workers over gRPC with the cluster's credential."""
from __future__ import annotations

import collections
import functools
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import grpc

from services.forkserver import ForkedProcess
from services.rpc import worker_pb2, worker_pb2_grpc

ROOT = Path(__file__).resolve().parents[1]
START_TIMEOUT = 300


class _Details(collections.namedtuple("_Details", ("method", "timeout", "metadata", "credentials",
                                                   "wait_for_ready", "compression")), grpc.ClientCallDetails):
    pass


class Bearer(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    """Puts a bearer credential on every call, as the router does on its calls to workers."""

    def __init__(self, metadata) -> None:
        self.metadata = tuple(metadata)

    def _details(self, d):
        return _Details(d.method, d.timeout, (*(d.metadata or ()), *self.metadata), d.credentials,
                        d.wait_for_ready, d.compression)

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._details(details), request)


def worker_channel(address: str, secret_file: str | None = None) -> grpc.Channel:
    """A channel to a worker carrying the cluster's credential (none: a stranger's)."""
    ch = grpc.insecure_channel(address)
    if secret_file is None:
        return ch
    from services.common.security import ClusterSecret
    return grpc.intercept_channel(ch, Bearer(ClusterSecret.from_file(secret_file).call_metadata()))


def worker_stub(ch: grpc.Channel, role: str):
    return (worker_pb2_grpc.DecodeWorkerStub if role == "decode" else worker_pb2_grpc.PrefillWorkerStub)(ch)


def worker_stats(address: str, role: str, secret_file: str | None = None) -> worker_pb2.WorkerStats:
    with worker_channel(address, secret_file) as ch:
        return worker_stub(ch, role).Stats(worker_pb2.InfoRequest(), timeout=10)


def wait_decode_idle(stats, timeout: float) -> worker_pb2.WorkerStats:
    """Wait until the decode pool is full again, nothing runs and no handoff is live;
    returns the last stats either way (the caller asserts on them)."""
    deadline = time.monotonic() + timeout
    while True:
        s = stats("decode")
        if (s.info.free_blocks == s.info.num_blocks and s.active_handoffs == 0
                and s.info.running == 0 and s.info.waiting == 0) or time.monotonic() > deadline:
            return s
        time.sleep(0.1)


@dataclass
class RunningCluster:
    proc: "subprocess.Popen | LaunchedWorker"
    info: dict
    log_path: Path

    @property
    def http(self) -> str:
        return self.info["http"]

    @property
    def grpc(self) -> str:
        return self.info["grpc"]

    def worker_addr(self, role: str) -> str:
        return f"127.0.0.1:{self.info[role]['grpc_port']}"

    @property
    def secret_file(self) -> str:
        return self.info["cluster_secret_file"]

    def worker_channel(self, role: str) -> grpc.Channel:
        return worker_channel(self.worker_addr(role), self.secret_file)

    def metrics_url(self, role: str) -> str:
        return f"http://127.0.0.1:{self.info[role]['metrics_port']}/metrics"

    def stats(self, role: str) -> worker_pb2.WorkerStats:
        return worker_stats(self.worker_addr(role), role, self.secret_file)

    def wait_idle(self, timeout: float = 30.0) -> worker_pb2.WorkerStats:
        return wait_decode_idle(self.stats, timeout)

    def router(self, tmp: Path, *flags: str) -> tuple[subprocess.Popen, dict]:
        """A second router over this cluster's workers, with `flags` of its own (a few
        seconds to start, where a cluster of its own takes the model's load in each of
        its workers): its process and announcement (`http_port`, `grpc_port`)."""
        return spawn_service(tmp, "router", "router", [
            "--http-port", "0", "--grpc-port", "0", "--log-level", "warning",
            "--cluster-secret-file", self.secret_file, "--local-prefill-max-tokens", "0",
            "--decode", self.worker_addr("decode"), "--prefill", self.worker_addr("prefill"), *flags])

    def pids(self) -> list[int]:
        workers = [w["pid"] for w in self.info["prefills"] + self.info["decodes"]]
        return [self.proc.pid, self.info["router_pid"], *workers] + ([self.info["redis_pid"]]
                                                                      if self.info["redis_pid"] else [])


# The KV transport test clusters use unless a test names one: shm, the one `auto` picks
# between the processes of one machine (kv_transfer/backends.py PREFERENCE). `auto` would
# also start a NIXL agent in every worker (UCX: about a second of CPU each), used by no
# handoff; the tests about NIXL, and the default configuration's `up`, name theirs.
TRANSPORT = "shm"


def start_cluster(*extra: str, dtype: str = "float32", pinned: bool = False, by_exec: bool = False) -> RunningCluster:
    """`pdserve up` with every prompt sent through a prefill worker (no local prefill for
    short prompts) unless `extra` says otherwise: the tests are about the KV handoff.
    Its workers are pinned to cores only when `pinned`: under `make test` two test
    processes run clusters at once, and every one would pin its decode worker, the
    busiest, to the same first core. `up` is forked from the tests' fork launcher, and
    forks its own fork server from itself, imports and all (a fresh server spends ~6 s of
    CPU importing); `by_exec`: started as a user starts it, a fresh interpreter with no
    torch that starts a fresh fork server."""
    tmp = Path(tempfile.mkdtemp(prefix="pdserve-test-"))
    announce = tmp / "cluster.json"
    log_path = tmp / "cluster.log"
    transport = [] if "--kv-transport" in extra else ["--kv-transport", TRANSPORT]
    argv = ["--http-port", "0", "--grpc-port", "0", "--dtype", dtype, "--kv-cache-tokens", "16384",
            "--announce-file", str(announce), "--log-level", "warning", "--local-prefill-max-tokens", "0",
            "--pin-cpus" if pinned else "--no-pin-cpus", *transport, *extra]
    proc = subprocess.Popen([sys.executable, "-m", "services.cli", "up", *argv], cwd=ROOT, stdout=open(log_path, "wb"),
                            stderr=subprocess.STDOUT) if by_exec else start_service("up", argv, log_path)
    return RunningCluster(proc, wait_announced(proc, announce, log_path, "cluster"), log_path)


def stop_cluster(c: RunningCluster, sig: int = signal.SIGINT, timeout: float = 30.0) -> int:
    return terminate(c.proc, timeout, sig)


def command_line(pid: int) -> list[str]:
    """A live process's command line, whether it was started by exec (its arguments
    apart) or forked by `up`'s fork server and titled (services/forkserver.py: one
    string, the same words)."""
    import shlex
    args = open(f"/proc/{pid}/cmdline").read().rstrip("\0").split("\0")
    return shlex.split(args[0]) if len(args) == 1 else args


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def free_port() -> int:
    """A port free now, for a service to be started on (and restarted on) later. It is
    below the kernel's ephemeral range: a socket bound to port 0 meanwhile (another
    service's listener, UCX's, a connection's local end) never takes it, as it could
    take one that binding port 0 here had found."""
    import random
    import socket
    low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    for _ in range(200):
        port = random.randrange(max(1024, low - 10000), low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port below the ephemeral range")


def wait_announced(proc: subprocess.Popen, announce: Path, log_path: Path, name: str) -> dict:
    """The announcement `proc` writes once it serves; kills it and raises with the tail
    of its log if it exits or takes longer than START_TIMEOUT."""
    deadline = time.monotonic() + START_TIMEOUT
    while not announce.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"{name} failed to start:\n{log_path.read_text()[-4000:]}")
        time.sleep(0.05)
    return json.loads(announce.read_text())


def spawn_service(tmp: Path, name: str, role: str, argv: list[str]) -> tuple[subprocess.Popen, dict]:
    """`pdserve <role> argv` logging to tmp/<name>.log; returns once it has announced
    its ports: (process, announcement)."""
    (started,) = spawn_services(tmp, [(name, role, argv)])
    return started


class ForkLauncher:
    """The tests' fork launcher (tests/fork_launcher.py), started once a test process."""

    def __init__(self) -> None:
        # It ends when its stdin closes, at this process's end however it comes (not by
        # a death signal, which would follow the thread that started it).
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.fork_launcher"], cwd=ROOT, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self._lock = threading.Lock()

    def ask(self, **request) -> dict:
        with self._lock:
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
            return json.loads(self.proc.stdout.readline())


@functools.cache
def fork_launcher() -> ForkLauncher:
    return ForkLauncher()


class LaunchedWorker(ForkedProcess):
    """A service the fork launcher started (a worker, or `up`), handled as `up` handles
    the workers it forks, but for its exit code: the launcher reaped it, and keeps that."""

    def __init__(self, launcher: ForkLauncher, pid: int, args: list[str]) -> None:
        super().__init__(pid, args)
        self.launcher = launcher

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.launcher.ask(poll=self.pid)["code"]
        return self.returncode


def start_service(role: str, argv: list[str], log_path: Path) -> subprocess.Popen | LaunchedWorker:
    """`pdserve <role> argv`: a worker forked by the fork launcher, as `up` forks its
    own, or `up` (which then forks its own fork server from itself: services/forkserver.py);
    the router (which loads no torch), or one the launcher cannot fork, by exec."""
    if role in ("prefill", "decode", "up"):
        answer = fork_launcher().ask(spawn=[role, *argv], env=dict(os.environ), output=str(log_path))
        if "pid" in answer:
            return LaunchedWorker(fork_launcher(), answer["pid"], [role, *argv])
    return subprocess.Popen([sys.executable, "-m", "services.cli", role, *argv], cwd=ROOT,
                            stdout=open(log_path, "ab"), stderr=subprocess.STDOUT)


def spawn_services(tmp: Path, services: list[tuple[str, str, list[str]]]) -> list[tuple[subprocess.Popen, dict]]:
    """Several `spawn_service`s (name, role, argv) started at once, so their imports and
    model loads overlap; returns once every one has announced its ports."""
    started = []
    for name, role, argv in services:
        announce, log_path = tmp / f"{name}.json", tmp / f"{name}.log"
        announce.unlink(missing_ok=True)
        proc = start_service(role, [*argv, "--announce-file", str(announce)], log_path)
        started.append((name, proc, announce, log_path))
    try:
        return [(proc, wait_announced(proc, announce, log_path, name)) for name, proc, announce, log_path in started]
    except BaseException:                    # one failed to start: stop the others, by PID
        for _, proc, _, _ in started:
            terminate(proc)
        raise


def wait_ready(http: str, workers: dict[str, int], timeout: float = 60.0) -> None:
    """Until the router at `http` counts `workers` healthy workers of each role (the
    probe `pdserve up` itself waits on)."""
    from services.local_processes import wait_router_sees
    wait_router_sees(http, workers, timeout, lambda: None)


def terminate(proc: subprocess.Popen, timeout: float = 20.0, sig: int = signal.SIGTERM) -> int:
    """`sig` (SIGTERM: the service drains), then SIGKILL if it outlives `timeout`;
    returns the exit code."""
    if proc.poll() is None:
        proc.send_signal(sig)
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


class Services:
    """Router, prefill and decode started one by one, so tests can kill and restart
    any of them (on the same port, as a supervisor would)."""

    def __init__(self, dtype: str = "float32", transport: str = TRANSPORT) -> None:
        from services.common.security import new_secret_file
        self.tmp = Path(tempfile.mkdtemp(prefix="pdserve-svc-"))
        self.secret_file = str(new_secret_file(self.tmp / "cluster-secret"))
        self.common = ["--dtype", dtype, "--threads", "1", "--kv-transport", transport, "--log-level", "warning",
                       "--cluster-secret-file", self.secret_file]
        self.ports = {"decode": free_port(), "prefill": free_port()}
        self.procs: dict[str, subprocess.Popen] = {}
        self.info: dict[str, dict] = {}

    def _spawn(self, role: str, argv: list[str]) -> dict:
        self.procs[role], self.info[role] = spawn_service(self.tmp, role, role, argv)
        return self.info[role]

    def _worker_argv(self, role: str, *extra: str) -> list[str]:
        argv = [*self.common, "--port", str(self.ports[role]), *extra]
        return argv + ["--kv-cache-tokens", "16384"] if role == "decode" else argv

    def _router_argv(self, *extra: str) -> list[str]:
        return ["--http-port", "0", "--grpc-port", "0", "--log-level", "warning",
                "--cluster-secret-file", self.secret_file, "--local-prefill-max-tokens", "0",
                "--decode", self.addr("decode"), "--prefill", self.addr("prefill"), *extra]

    def start_worker(self, role: str, *extra: str) -> dict:
        return self._spawn(role, self._worker_argv(role, *extra))

    def start_router(self, *extra: str) -> dict:
        return self._spawn("router", self._router_argv(*extra))

    def start_all(self) -> "Services":
        """All three at once (the workers' ports are fixed, so the router knows them
        before they listen); returns once the router has seen both."""
        roles = ("decode", "prefill", "router")
        argvs = [self._worker_argv("decode"), self._worker_argv("prefill"), self._router_argv()]
        for role, (proc, info) in zip(roles, spawn_services(self.tmp, [(r, r, a) for r, a in zip(roles, argvs)])):
            self.procs[role], self.info[role] = proc, info
        wait_ready(self.http, {"prefill": 1, "decode": 1})
        return self

    def addr(self, role: str) -> str:
        return f"127.0.0.1:{self.ports[role]}"

    @property
    def http(self) -> str:
        return f"http://127.0.0.1:{self.info['router']['http_port']}"

    def kill(self, role: str, sig: int = signal.SIGKILL) -> None:
        proc = self.procs.pop(role)
        proc.send_signal(sig)
        proc.wait(timeout=30)

    def stats(self, role: str) -> worker_pb2.WorkerStats:
        return worker_stats(self.addr(role), role, self.secret_file)

    def channel(self, role: str) -> grpc.Channel:
        return worker_channel(self.addr(role), self.secret_file)

    def wait_idle(self, timeout: float = 30.0) -> worker_pb2.WorkerStats:
        return wait_decode_idle(self.stats, timeout)

    def wait_routable(self, timeout: float = 30.0) -> None:
        """Until the router routes a request remotely again (its refresh saw the workers)."""
        import httpx
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            r = httpx.post(f"{self.http}/v1/completions", timeout=60, json={"prompt": "ping", "max_tokens": 1})
            if r.status_code == 200 and "decision=remote" in r.headers.get("x-pdserve-route", ""):
                return
            time.sleep(0.3)
        raise AssertionError("router did not route remotely again in time")

    def stop(self) -> None:
        for role in ("router", "prefill", "decode"):
            proc = self.procs.pop(role, None)
            if proc is not None:
                terminate(proc)
