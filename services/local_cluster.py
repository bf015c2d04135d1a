"""`pdserve up`: the whole cluster on one machine, one OS process per service.

Start order: the registry (the --redis given, else a private redis-server on a unix
socket if one is installed, else none: the router is given the workers' addresses),
then M decode and N prefill workers (in parallel, each announces its ports when its
model is loaded), then the router. Stop order is the reverse. If any service dies, the
rest are stopped and `up` exits non-zero; children also get SIGTERM if `up` itself is
killed, so nothing is left running.
"""
from __future__ import annotations

import ctypes
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

START_TIMEOUT = 600.0
STOP_TIMEOUT = 45.0                 # workers drain up to --drain-timeout (30 s)
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


def _child_setup(cpus: set[int] | None):
    """Runs in the child before exec: die with `up`, and keep to `cpus` if given (every
    thread the service starts later inherits the mask)."""
    def setup() -> None:
        _die_with_parent()
        if cpus:
            os.sched_setaffinity(0, cpus)
    return setup


def plan_cpus(roles: list[str], available: list[int]) -> list[set[int] | None]:
    """One core of its own per worker when there are enough cores, else no pinning.
    Prefill and decode then never steal each other's core: that isolation is what
    disaggregation buys on one host."""
    if len(roles) > len(available):
        return [None] * len(roles)
    return [{cpu} for cpu in available[:len(roles)]]


@dataclass
class Child:
    name: str
    proc: subprocess.Popen
    announce: Path

    def ports(self) -> dict | None:
        try:
            return json.loads(self.announce.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return None


class LocalCluster:
    def __init__(self, args) -> None:
        self.args = args
        self.workdir = Path(tempfile.mkdtemp(prefix="pdserve-up-"))
        self.children: list[Child] = []
        self._stop = False

    def _spawn(self, name: str, argv: list[str], threads: int, cpus: set[int] | None = None) -> Child:
        announce = self.workdir / f"{name}.json"
        env = dict(os.environ)
        if threads:
            env["OMP_NUM_THREADS"] = str(threads)
        cmd = [sys.executable, "-m", "services.cli", *argv, "--announce-file", str(announce)]
        proc = subprocess.Popen(cmd, env=env, preexec_fn=_child_setup(cpus))
        child = Child(name, proc, announce)
        self.children.append(child)
        return child

    def _registry(self) -> str | None:
        """The registry URL the services share, or None for static addresses."""
        if self.args.redis:
            print(f"pdserve: registry: {self.args.redis}", flush=True)
            return self.args.redis
        server = shutil.which("redis-server")
        if server is None:
            print("pdserve: registry: none (redis-server is not installed); "
                  "the router is given the workers' addresses", flush=True)
            return None
        sock = self.workdir / "redis.sock"
        proc = subprocess.Popen([server, "--port", "0", "--unixsocket", str(sock), "--unixsocketperm", "700",
                                 "--save", "", "--appendonly", "no", "--dir", str(self.workdir)],
                                stdout=subprocess.DEVNULL, preexec_fn=_die_with_parent)
        self.children.append(Child("redis", proc, sock))
        deadline = time.monotonic() + 30
        while not sock.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the private redis-server did not start")
            time.sleep(0.05)
        url = f"unix://{sock}"
        print(f"pdserve: registry: a private redis-server at {url}", flush=True)
        return url

    def _wait_ready(self, children: list[Child]) -> list[dict]:
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            if self._stop:
                raise KeyboardInterrupt
            for c in children:
                if c.proc.poll() is not None:
                    raise RuntimeError(f"{c.name} exited with code {c.proc.returncode} during start-up")
            ports = [c.ports() for c in children]
            if all(ports):
                return ports
            if time.monotonic() > deadline:
                raise RuntimeError("services did not become ready in time")
            time.sleep(0.05)

    def run(self) -> int:
        a = self.args
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._on_signal)
        aggregated = a.mode == "aggregated"
        num_prefill = 0 if aggregated else a.num_prefill
        cores = sorted(os.sched_getaffinity(0))
        workers = num_prefill + a.num_decode
        # Disaggregated: a core and one torch thread per worker when they fit. Aggregated:
        # each worker shares the cores (two threads here) and chunks its prefills.
        threads = a.threads or (max(1, len(cores) // workers) if aggregated else
                                max(1, len(cores) // max(2, workers)))
        pins = (plan_cpus(["decode"] * a.num_decode + ["prefill"] * num_prefill, cores)
                if a.pin_cpus and not aggregated else [None] * workers)
        common = ["--dtype", a.dtype, "--log-level", a.log_level, "--device", a.device,
                  "--kv-transport", a.kv_transport, "--block-size", str(a.block_size), "--threads", str(threads)]
        if a.model:
            common += ["--model", a.model]
        chunk = a.prefill_chunk_tokens if a.prefill_chunk_tokens is not None else (256 if aggregated else 0)
        try:
            if a.num_decode < 1 or (num_prefill < 1 and not aggregated):
                raise RuntimeError("--prefill and --decode need at least one worker each")
            redis = self._registry()
            if redis:
                common += ["--redis", redis]
            decodes = [self._spawn(f"decode-{i}", ["decode", *common, "--kv-cache-tokens", str(a.kv_cache_tokens),
                                                   "--max-batch", str(a.max_batch),
                                                   "--prefill-chunk-tokens", str(chunk)], threads, pins[i])
                       for i in range(a.num_decode)]
            prefills = [self._spawn(f"prefill-{i}", ["prefill", *common, "--prefix-cache-tokens",
                                                     str(a.prefix_cache_tokens)], threads, pins[a.num_decode + i])
                        for i in range(num_prefill)]
            print(f"pdserve: {a.mode}: {a.num_decode} decode + {num_prefill} prefill worker(s), {threads} torch "
                  f"thread(s) each" + (", one core each" if pins[0] else "")
                  + (f", local prefill in chunks of {chunk} tokens" if chunk else ""), flush=True)
            ports = self._wait_ready(decodes + prefills)
            dports, pports = ports[:len(decodes)], ports[len(decodes):]
            router_argv = ["router", "--host", a.host, "--http-port", str(a.http_port), "--grpc-port",
                           str(a.grpc_port), "--log-level", a.log_level, "--max-pending", str(a.max_pending),
                           "--local-prefill-max-tokens", str(a.local_prefill_max_tokens)]
            if aggregated:
                router_argv.append("--aggregated")
            if redis:
                router_argv += ["--redis", redis]
            else:
                for role, group in (("--decode", dports), ("--prefill", pports)):
                    for w in group:
                        router_argv += [role, f"127.0.0.1:{w['grpc_port']}"]
            if a.model:
                router_argv += ["--model", a.model]
            if a.served_model_name:
                router_argv += ["--served-model-name", a.served_model_name]
            router = self._spawn("router", router_argv, 1)
            (rports,) = self._wait_ready([router])
            self._banner(rports, pports, dports, redis)
            while not self._stop:
                for c in self.children:
                    if c.proc.poll() is not None:
                        print(f"pdserve: {c.name} exited with code {c.proc.returncode}; stopping", flush=True)
                        return 1
                time.sleep(0.2)
            return 0
        except KeyboardInterrupt:
            return 0
        except RuntimeError as exc:
            print(f"pdserve: {exc}", file=sys.stderr, flush=True)
            return 1
        finally:
            self.shutdown()

    def _banner(self, r: dict, prefills: list[dict], decodes: list[dict], redis: str | None) -> None:
        host = self.args.host
        summary = {"http": f"http://{host}:{r['http_port']}", "grpc": f"{host}:{r['grpc_port']}",
                   "router_pid": r["pid"], "prefill": prefills[0] if prefills else None, "decode": decodes[0],
                   "prefills": prefills, "decodes": decodes, "redis": redis,
                   "redis_pid": next((c.proc.pid for c in self.children if c.name == "redis"), None)}
        workers = [f"{role} worker pid {w['pid']} (gRPC :{w['grpc_port']}, metrics :{w['metrics_port']})"
                   for role, group in (("prefill", prefills), ("decode", decodes)) for w in group]
        print(f"pdserve is up: OpenAI-compatible HTTP on http://{host}:{r['http_port']}/v1, "
              f"gRPC on {host}:{r['grpc_port']}\n  " + "\n  ".join(workers) + "\n  Ctrl-C stops everything.",
              flush=True)
        if self.args.announce_file:
            tmp = Path(self.args.announce_file + ".tmp")
            tmp.write_text(json.dumps(summary))
            tmp.replace(self.args.announce_file)

    def _on_signal(self, signum, frame) -> None:
        self._stop = True

    def shutdown(self) -> None:
        for c in reversed(self.children):
            if c.proc.poll() is None:
                c.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_TIMEOUT
        for c in reversed(self.children):
            try:
                c.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                c.proc.kill()
                c.proc.wait()
        shutil.rmtree(self.workdir, ignore_errors=True)
