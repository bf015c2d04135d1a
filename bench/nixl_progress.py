"""NIXL progress across hosts: what the receiving agent's progress thread costs and buys
when UCX has to go over TCP, measured between two network namespaces on this machine.

    python -m bench.nixl_progress --json out.json [--progress 0,0.001,0.01,0.05]
        [--writer-progress 0,0.01] [--receiver-load idle,busy] [--sizes 1,16,64] [--repeats 5]

Needs root and iproute2. Two namespaces joined by a veth pair play two hosts: A
(10.77.0.1) writes as a prefill worker, B (10.77.0.2) receives as a decode worker. Each
side runs pdserve's NixlTransport with `host=` its own address (UCX confined to its veth).
UCX decides that two processes share a node from the boot id and their PID/IPC
namespaces, not the network namespace: left alone it still writes with CMA between the
namespaces. Both processes therefore get UCX_TLS=tcp (`--ucx-tls ''` leaves it unset)
and UCX_PROTO_INFO=y, whose tables name the transports UCX chose; they are reported.

For every (receiver progress, writer progress, receiver load) triple, `progress_interval`
in seconds (0 = no progress thread), a fresh receiver and writer, one core each, with the
workers' GIL switch interval (0.5 ms):
- first write: connect, then one 32 KiB write (one block of one layer) to DONE; this
  includes UCX's connection handshake.
- latency: `--latency-samples` such writes, post to DONE, waited for as the prefill worker
  waits (`wait_for`: polls backing off from 0.1 to 5 ms), after random pauses so that
  posts fall at every phase of the receiver's progress period.
- bandwidth: payloads of `--sizes` MiB (KV-shaped, as bench/kv_transfer.py: 32 layers of
  float32 blocks, 1 MiB per block across the layers) written layer by layer, 32 writes,
  then polled to DONE: bytes / (last completion - first post), median of `--repeats`
  rounds after a warm-up. A plain socket over the same veth is the reference.
- prefill tail: `--prefill-mib` payloads written as a prefill worker writes them: each
  layer after `--layer-ms` of torch matmuls on the writer's one thread (that layer's
  forward pass), no polling in between, then polled to DONE. The tail, last post -> DONE,
  is what a prefill waits for its KV after its compute.
- idle CPU: each process's CPU time over `--idle-seconds` with nothing to move (the
  progress thread's own cost), in % of one core.
- receiver load `busy`: the receiver also runs a decode-like loop in a thread the whole
  time (30 small matmuls and some Python per step), which holds the GIL the progress
  thread needs, as a decode worker's engine does; its steps/s while idle is reported.
Every destination region is zeroed before a write and its digest compared with the
source's right after DONE (and again until `--timeout` if it differs), so a setting whose
writes never land, or land after DONE, shows it; every wait is bounded by `--timeout`.
Namespaces and the veth pair are deleted on the way out, whatever happens.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import signal
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterator

import torch

from bench.kv_transfer import layout

MIB = 1 << 20
CONTROL_PORT = 17_700                  # the receiver's control socket, inside its own namespace
SMALL_WRITE = (range(0, 1), 1)         # (layers, blocks) of the latency probe: 32 KiB
HOST_A, HOST_B, PREFIX_LEN = "10.77.0.1", "10.77.0.2", 24
SWITCH_INTERVAL = 0.0005               # as services/worker/main.py sets it


# ---------------------------------------------------------------- the machine

def cpu_name() -> dict:
    from services.engine.model.hardware import cpu_flags, cpu_kind
    lines = Path("/proc/cpuinfo").read_text().splitlines()
    model = next((s.split(":", 1)[1].strip() for s in lines if s.startswith("model name")), "?")
    flags = cpu_flags()
    return {"model": model, "kind": cpu_kind(), "avx512_bf16": "avx512_bf16" in flags, "amx_bf16": "amx_bf16" in flags,
            "cores": os.cpu_count()}


@dataclass(frozen=True)
class Host:
    netns: str
    link: str                          # its end of the veth pair
    address: str


def _ip(*args: str, check: bool = True) -> None:
    subprocess.run(["ip", *args], check=check, capture_output=True, timeout=30)


@contextmanager
def two_hosts() -> Iterator[tuple[Host, Host]]:
    """Two namespaces with one veth link between them; deleted on exit, whatever happened
    (deleting a namespace deletes the veth end inside it, and with it the pair)."""
    tag = os.getpid()
    a, b = Host(f"pdsA-{tag}", f"pa{tag}", HOST_A), Host(f"pdsB-{tag}", f"pb{tag}", HOST_B)
    made: list[str] = []
    try:
        for h in (a, b):
            _ip("netns", "add", h.netns)
            made.append(h.netns)
        _ip("link", "add", a.link, "type", "veth", "peer", "name", b.link)
        for h in (a, b):
            _ip("link", "set", h.link, "netns", h.netns)
            _ip("-n", h.netns, "addr", "add", f"{h.address}/{PREFIX_LEN}", "dev", h.link)
            _ip("-n", h.netns, "link", "set", h.link, "up")
            _ip("-n", h.netns, "link", "set", "lo", "up")
        yield a, b
    finally:
        for ns in made:
            _ip("netns", "del", ns, check=False)
        _ip("link", "del", a.link, check=False)      # only still here if moving it failed


# ---------------------------------------------------------------- control channel

def _send(sock: socket.socket, msg: dict) -> None:
    data = json.dumps(msg).encode()
    sock.sendall(struct.pack("!I", len(data)) + data)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("control peer closed")
        buf += chunk
    return bytes(buf)


def _recv(sock: socket.socket) -> dict:
    (n,) = struct.unpack("!I", _recv_exact(sock, 4))
    return json.loads(_recv_exact(sock, n))


class Control:
    """The writer's end of the control socket: one request, one reply."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock

    def ask(self, op: str, **kw) -> dict:
        _send(self.sock, {"op": op, **kw})
        return _recv(self.sock)

    def sink(self, payload: memoryview) -> None:
        """Push `payload` as plain bytes over this socket (the raw TCP reference)."""
        _send(self.sock, {"op": "sink", "bytes": len(payload)})
        self.sock.sendall(payload)
        _recv(self.sock)


def _dial(address: str, patience: float) -> socket.socket:
    end = time.monotonic() + patience
    while True:
        try:
            return socket.create_connection((address, CONTROL_PORT), timeout=patience)
        except OSError:
            if time.monotonic() >= end:
                raise
            time.sleep(0.1)


# ---------------------------------------------------------------- both sides

def digest(pool, layers: range, blocks: int) -> str:
    region = pool.tensor[layers.start:layers.stop, :, :blocks].contiguous()
    return hashlib.blake2b(region.view(-1).view(torch.uint8).numpy()).hexdigest()


def _side() -> None:
    """One torch thread, and the GIL handed over as often as in a worker."""
    torch.set_num_threads(1)
    sys.setswitchinterval(SWITCH_INTERVAL)


# ---------------------------------------------------------------- receiver (decode side)

class DecodeLoad:
    """A decode engine's shape of work in a thread: per step, 30 layers of a small matmul
    with Python between them (which holds the GIL)."""

    def __init__(self) -> None:
        self.steps = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="decode-load", daemon=True)

    def start(self) -> "DecodeLoad":
        self._thread.start()
        return self

    def _run(self) -> None:
        torch.set_num_threads(1)                        # OpenMP's thread count is per thread
        x, w = torch.rand(8, 576), torch.rand(576, 576)
        while not self._stop.is_set():
            for _ in range(30):
                x @ w
                sum(i * i for i in range(200))          # bookkeeping in Python
            self.steps += 1

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)


def receiver(a: argparse.Namespace) -> None:
    from kv_transfer.backends import create_transport
    from services.engine.model.kv_cache import KVPoolMemory, compat_hash
    _side()
    lay = layout(a.blocks)
    pool = KVPoolMemory.allocate(lay)
    transport = create_transport("nixl", progress_interval=a.progress, host=a.address)
    meta = transport.register(pool, compat_hash("bench", lay))
    load = DecodeLoad().start() if a.receiver_load == "busy" else None
    try:
        srv = socket.create_server((a.address, CONTROL_PORT))
        srv.settimeout(a.timeout * 4)
        conn, _ = srv.accept()
        conn.settimeout(None)
        _serve(conn, pool, meta, load)
    finally:
        if load is not None:
            load.stop()
        transport.shutdown()


def _serve(conn: socket.socket, pool, meta: bytes, load: DecodeLoad | None) -> None:
    sink = bytearray()
    while True:
        msg = _recv(conn)
        op = msg["op"]
        if op == "meta":
            reply = {"meta": meta.decode()}
        elif op == "clear":
            pool.tensor[msg["l0"]:msg["l1"], :, :msg["blocks"]].zero_()
            reply = {}
        elif op == "digest":
            reply = {"digest": digest(pool, range(msg["l0"], msg["l1"]), msg["blocks"])}
        elif op == "cpu":
            reply = {"cpu": time.process_time(), "steps": load.steps if load else None}
        elif op == "sink":
            if len(sink) < msg["bytes"]:
                sink = bytearray(msg["bytes"])
            view, got = memoryview(sink), 0
            while got < msg["bytes"]:
                got += conn.recv_into(view[got:msg["bytes"]])
            reply = {}
        elif op == "stop":
            _send(conn, {})
            return
        else:
            reply = {"error": f"unknown op {op}"}
        _send(conn, reply)


# ---------------------------------------------------------------- writer (prefill side)

@dataclass
class Outcome:
    """One setting, as the writer saw it."""
    receiver_progress: float
    writer_progress: float
    receiver_load: str
    ok: bool = True
    error: str | None = None
    landed: bool | None = None         # after a failure: did the bytes arrive anyway?
    late_writes: int = 0               # writes DONE before their bytes had all landed
    first_write_s: float | None = None
    latency_ms: dict = field(default_factory=dict)
    bandwidth: dict = field(default_factory=dict)          # MiB -> {gbps, seconds, post_seconds}
    raw_socket: dict = field(default_factory=dict)         # MiB -> {gbps}
    prefill_tail_ms: dict = field(default_factory=dict)    # MiB -> {p50, max}
    idle: dict = field(default_factory=dict)               # CPU % of each side, decode-load steps/s


class Writer:
    def __init__(self, a: argparse.Namespace, ctrl: Control) -> None:
        from kv_transfer.backends import create_transport
        from services.engine.model.kv_cache import KVPoolMemory, compat_hash
        self.a, self.ctrl = a, ctrl
        lay = layout(a.blocks)
        self.pool = KVPoolMemory.allocate(lay)
        self.pool.tensor.uniform_()
        self.layers = lay.num_layers
        self.compat = compat_hash("bench", lay)
        self.transport = create_transport("nixl", progress_interval=a.writer_progress, host=a.address)
        self.transport.register(self.pool, self.compat)
        self.peer = None
        self.late = 0
        self.writing: tuple[range, int] | None = None     # the region written since the last clear
        self._matmul = torch.rand(96, 96)

    # -- one write, checked --
    def _clear(self, layers: range, blocks: int) -> None:
        self.writing = None
        self.ctrl.ask("clear", l0=layers.start, l1=layers.stop, blocks=blocks)

    def _post(self, layers: range, blocks: int) -> int:
        if self.writing is None:
            self.writing = (layers, blocks)
        else:
            done, _ = self.writing
            self.writing = (range(min(done.start, layers.start), max(done.stop, layers.stop)), blocks)
        ids = list(range(blocks))
        return self.transport.write(self.peer, ids, ids, layers)

    def _wait(self, xfers: list[int]) -> None:
        from kv_transfer.base import wait_for
        wait_for(self.transport, xfers, time.monotonic() + self.a.timeout)

    def verify(self, layers: range, blocks: int, patience: float = 0.0, after_done: bool = True) -> bool:
        """True if the receiver holds our bytes now; else look again until `patience`
        seconds have passed, counting a write that landed after its DONE."""
        want = digest(self.pool, layers, blocks)
        end = time.monotonic() + patience
        first = True
        while True:
            if self.ctrl.ask("digest", l0=layers.start, l1=layers.stop, blocks=blocks)["digest"] == want:
                self.late += after_done and not first
                return True
            first = False
            if time.monotonic() >= end:
                return False
            time.sleep(0.01)

    def _checked(self, layers: range, blocks: int) -> None:
        if not self.verify(layers, blocks, patience=self.a.timeout):
            raise RuntimeError(f"DONE, but the bytes of {blocks} block(s) x {len(layers)} layer(s) never landed")

    # -- the measurements --
    def first_write(self) -> float:
        layers, blocks = SMALL_WRITE
        self._clear(layers, blocks)
        t0 = time.perf_counter()
        self.peer = self.transport.connect(self.ctrl.ask("meta")["meta"].encode(), self.compat)
        self._wait([self._post(layers, blocks)])
        seconds = time.perf_counter() - t0
        self._checked(layers, blocks)
        return seconds

    def idle(self) -> dict:
        r0, w0 = self.ctrl.ask("cpu"), time.process_time()
        t0 = time.monotonic()
        time.sleep(self.a.idle_seconds)
        elapsed = time.monotonic() - t0
        r1, w1 = self.ctrl.ask("cpu"), time.process_time()
        out = {"receiver_cpu_pct": 100 * (r1["cpu"] - r0["cpu"]) / elapsed, "writer_cpu_pct": 100 * (w1 - w0) / elapsed}
        if r0["steps"] is not None:
            out["decode_load_steps_per_s"] = (r1["steps"] - r0["steps"]) / elapsed
        return out

    def latency(self) -> dict:
        layers, blocks = SMALL_WRITE
        rng = random.Random(7)
        samples = []
        for _ in range(self.a.latency_samples):
            self._clear(layers, blocks)
            time.sleep(rng.uniform(0.0, 0.06))        # any phase of a progress period up to 60 ms
            t0 = time.perf_counter()
            self._wait([self._post(layers, blocks)])
            samples.append(time.perf_counter() - t0)
            self._checked(layers, blocks)
        return {"p50": 1000 * statistics.median(samples), "p90": 1000 * statistics.quantiles(samples, n=10)[-1],
                "max": 1000 * max(samples), "samples": [round(1000 * x, 3) for x in samples]}

    def bandwidth(self, mib: int) -> dict:
        everything = range(self.layers)
        rounds = []
        for _ in range(self.a.repeats + 1):           # the first round warms the link up
            self._clear(everything, mib)
            t0 = time.perf_counter()
            xfers = [self._post(range(layer, layer + 1), mib) for layer in everything]
            posted = time.perf_counter()
            self._wait(xfers)
            rounds.append((time.perf_counter() - t0, posted - t0))
            self._checked(everything, mib)
        seconds = statistics.median(s for s, _ in rounds[1:])
        return {"gbps": mib * MIB / seconds / 1e9, "seconds": seconds,
                "post_seconds": statistics.median(p for _, p in rounds[1:])}

    def raw_socket(self, mib: int) -> dict:
        payload = memoryview(self.pool.tensor[:, :, :mib].contiguous().view(-1).view(torch.uint8).numpy())
        times = []
        for _ in range(self.a.repeats + 1):
            t0 = time.perf_counter()
            self.ctrl.sink(payload)
            times.append(time.perf_counter() - t0)
        return {"gbps": mib * MIB / statistics.median(times[1:]) / 1e9}

    def _compute(self, seconds: float) -> None:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            self._matmul @ self._matmul

    def prefill_tail(self, mib: int) -> dict:
        everything = range(self.layers)
        tails = []
        for _ in range(self.a.repeats + 1):
            self._clear(everything, mib)
            xfers = []
            for layer in everything:
                self._compute(self.a.layer_ms / 1000)
                xfers.append(self._post(range(layer, layer + 1), mib))
            t0 = time.perf_counter()
            self._wait(xfers)
            tails.append(time.perf_counter() - t0)
            self._checked(everything, mib)
        return {"p50": 1000 * statistics.median(tails[1:]), "max": 1000 * max(tails[1:])}

    def run(self, out: Outcome) -> None:
        try:
            out.first_write_s = self.first_write()
        finally:
            out.idle = self.idle()                     # measured even when the link never comes up
        out.latency_ms = self.latency()
        for mib in self.a.sizes:
            out.bandwidth[str(mib)] = self.bandwidth(mib)
            out.raw_socket[str(mib)] = self.raw_socket(mib)
        for mib in self.a.prefill_mib:
            out.prefill_tail_ms[str(mib)] = self.prefill_tail(mib)

    def failed(self, out: Outcome, exc: BaseException) -> None:
        """Say what went wrong and whether the bytes being written got there anyway."""
        out.ok, out.error = False, f"{type(exc).__name__}: {exc}"
        try:
            out.landed = (self.verify(*self.writing, patience=1.0, after_done=False)
                          if self.writing is not None else None)
        except (OSError, ConnectionError) as e:
            out.error += f" (and the receiver did not answer: {e})"


def writer(a: argparse.Namespace) -> None:
    _side()
    ctrl = Control(_dial(a.peer, a.timeout * 4))
    out = Outcome(a.progress, a.writer_progress, a.receiver_load)
    w = Writer(a, ctrl)
    try:
        w.run(out)
    except Exception as exc:                          # the outcome says what failed; the next setting goes on
        w.failed(out, exc)
    finally:
        out.late_writes = w.late
        Path(a.result).write_text(json.dumps(asdict(out)))
        try:
            ctrl.ask("stop")
        except OSError:
            pass
        w.transport.shutdown()


# ---------------------------------------------------------------- orchestration

@dataclass(frozen=True)
class Setting:
    receiver_progress: float
    writer_progress: float
    receiver_load: str

    @property
    def tag(self) -> str:
        return f"{self.receiver_progress}-{self.writer_progress}-{self.receiver_load}"


def _pinned(core: int):
    """One core each, as `pdserve up` pins its workers: before exec, so that torch's
    OpenMP sizes itself to that core (pinned later, a thread's matmuls spin two OpenMP
    threads on one core and run ~100x slower)."""
    cores = sorted(os.sched_getaffinity(0))
    return (lambda: os.sched_setaffinity(0, {cores[core]})) if len(cores) >= 2 else None


def _child(host: Host, role: str, a: argparse.Namespace, s: Setting, core: int, extra: list[str], env: dict,
           log: Path) -> subprocess.Popen:
    cmd = ["ip", "netns", "exec", host.netns, sys.executable, "-m", "bench.nixl_progress", "--role", role,
           "--address", host.address, "--timeout", str(a.timeout), "--blocks", str(a.blocks),
           "--progress", str(s.receiver_progress), "--writer-progress", str(s.writer_progress),
           "--receiver-load", s.receiver_load, *extra]
    return subprocess.Popen(cmd, env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT,
                            cwd=Path(__file__).resolve().parents[1], preexec_fn=_pinned(core))


def _stop(proc: subprocess.Popen, grace: float) -> None:
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        proc.kill()                                   # the child this run started, by its own PID
        proc.wait(10)


def ucx_transports(log_text: str) -> set[str]:
    """Transport names in UCX_PROTO_INFO's tables ('tcp/pb123', 'cma/memory', ...)."""
    known = ("tcp", "cma", "posix", "sysv", "xpmem", "knem", "rc_mlx5", "ud_mlx5", "dc_mlx5", "rc_verbs")
    found = set()
    for line in log_text.splitlines():
        if "|" in line:
            found |= {w.split("/")[0] for w in line.replace("|", " ").split() if w.split("/")[0] in known and "/" in w}
    return found


def one_setting(a: argparse.Namespace, hosts: tuple[Host, Host], s: Setting, tmp: Path) -> tuple[dict, set[str]]:
    a_host, b_host = hosts
    env = dict(os.environ, UCX_PROTO_INFO="y")
    env.pop("UCX_NET_DEVICES", None)                  # each side confines UCX to its own address
    if a.ucx_tls:
        env["UCX_TLS"] = a.ucx_tls
    else:
        env.pop("UCX_TLS", None)
    result = tmp / f"result-{s.tag}.json"
    logs = tmp / f"receiver-{s.tag}.log", tmp / f"writer-{s.tag}.log"
    result.unlink(missing_ok=True)                   # a setting may be listed twice
    recv = _child(b_host, "receiver", a, s, 1, [], env, logs[0])
    send = None
    try:
        send = _child(a_host, "writer", a, s, 0, [
            "--peer", b_host.address, "--result", str(result),
            "--sizes", ",".join(map(str, a.sizes)), "--repeats", str(a.repeats),
            "--latency-samples", str(a.latency_samples), "--prefill-mib", ",".join(map(str, a.prefill_mib)),
            "--layer-ms", str(a.layer_ms), "--idle-seconds", str(a.idle_seconds)], env, logs[1])
        _stop(send, a.setting_timeout)
        _stop(recv, 10)
    finally:
        for proc in (send, recv):                     # still running only if this run is being stopped
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait(10)
    text = "".join(p.read_text(errors="replace") for p in logs)
    if not result.exists():
        tail = "\n".join(text.splitlines()[-15:])
        return {**asdict(Outcome(s.receiver_progress, s.writer_progress, s.receiver_load)), "ok": False,
                "error": f"the writer left no result (exit {send.returncode if send else None}):\n{tail}"}, \
            ucx_transports(text)
    return json.loads(result.read_text()), ucx_transports(text)


# ---------------------------------------------------------------- report

def _fmt(v: float | None, spec: str = ".2f") -> str:
    return "—" if v is None else format(v, spec)


def _interval(p: float) -> str:
    return "none" if p == 0 else f"{p * 1000:g} ms"


def _verdict(r: dict) -> str:
    if r["ok"]:
        return "all landed" + (f" ({r['late_writes']} after DONE)" if r.get("late_writes") else "")
    landed = {True: "landed anyway", False: "never landed", None: "nothing written"}[r.get("landed")]
    return f"FAILED ({landed})"


def table(rows: list[dict], a: argparse.Namespace) -> str:
    busy = any(r["receiver_load"] == "busy" for r in rows)
    head = (["receiver progress", "writer progress"] + (["receiver load"] if len(a.receiver_load) > 1 else [])
            + ["first write ms", "32 KiB write ms p50 / p90"] + [f"{s} MiB GB/s" for s in a.sizes]
            + [f"prefill tail ms, {s} MiB" for s in a.prefill_mib]
            + ["idle CPU % receiver / writer"] + (["decode-load steps/s"] if busy else []) + ["bytes"])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        lat, idle, first = r.get("latency_ms") or {}, r.get("idle") or {}, r.get("first_write_s")
        cells = [_interval(r["receiver_progress"]), _interval(r["writer_progress"])]
        cells += [r["receiver_load"]] if len(a.receiver_load) > 1 else []
        cells += [_fmt(first * 1000 if first is not None else None, ".1f"),
                  f"{_fmt(lat.get('p50'), '.1f')} / {_fmt(lat.get('p90'), '.1f')}" if lat else "—"]
        cells += [_fmt((r["bandwidth"].get(str(s)) or {}).get("gbps")) for s in a.sizes]
        cells += [_fmt((r["prefill_tail_ms"].get(str(s)) or {}).get("p50"), ".1f") for s in a.prefill_mib]
        receiver_cpu = "busy" if r["receiver_load"] == "busy" else _fmt(idle.get("receiver_cpu_pct"), ".1f")
        cells += [f"{receiver_cpu} / {_fmt(idle.get('writer_cpu_pct'), '.1f')}" if idle else "—"]
        cells += [_fmt(idle.get("decode_load_steps_per_s"), ".0f")] if busy else []
        lines.append("| " + " | ".join(cells + [_verdict(r)]) + " |")
    raw = {s: [x["raw_socket"][str(s)]["gbps"] for x in rows if str(s) in x.get("raw_socket", {})] for s in a.sizes}
    if any(raw.values()):
        ref = ["plain TCP socket, same veth"] + [""] * (len(head) - 1)
        first_size = head.index(f"{a.sizes[0]} MiB GB/s")
        for i, s in enumerate(a.sizes):
            ref[first_size + i] = _fmt(statistics.median(raw[s]) if raw[s] else None)
        lines.append("| " + " | ".join(ref) + " |")
    return "\n".join(lines)


def orchestrate(a: argparse.Namespace) -> dict:
    if os.geteuid() != 0:
        raise SystemExit("needs root: it creates network namespaces")
    cpu = cpu_name()
    settings = [Setting(p, w, load) for load in a.receiver_load for p in a.progress for w in a.writer_progress]
    seen: set[str] = set()
    rows = []
    tmp = Path(a.logs) if a.logs else Path(tempfile.mkdtemp(prefix="pdserve-nixl-progress-"))
    tmp.mkdir(parents=True, exist_ok=True)
    print(f"CPU: {cpu['model']} ({cpu['kind']}), {cpu['cores']} cores; "
          f"UCX_TLS={a.ucx_tls or '(unset)'}; writer {HOST_A} -> receiver {HOST_B} over a veth pair", flush=True)
    try:
        with two_hosts() as hosts:
            for s in settings:
                t0 = time.monotonic()
                row, tls = one_setting(a, hosts, s, tmp)
                seen |= tls
                rows.append(row)
                print(f"  receiver {_interval(s.receiver_progress)} ({s.receiver_load}), writer "
                      f"{_interval(s.writer_progress)}: {'ok' if row['ok'] else 'FAILED: ' + row['error']} "
                      f"({time.monotonic() - t0:.0f} s)", flush=True)
    finally:
        if not a.logs:
            for p in tmp.iterdir():
                p.unlink()
            tmp.rmdir()
    print(f"UCX transports chosen (UCX_PROTO_INFO): {', '.join(sorted(seen)) or 'none reported'}")
    print(table(rows, a))
    return {"cpu": cpu, "ucx_tls": a.ucx_tls or None, "ucx_transports_seen": sorted(seen),
            "hosts": {"writer": HOST_A, "receiver": HOST_B, "link": "veth pair between two network namespaces"},
            "params": {"sizes_mib": a.sizes, "repeats": a.repeats, "latency_samples": a.latency_samples,
                       "prefill_mib": a.prefill_mib, "layer_ms": a.layer_ms, "timeout_s": a.timeout,
                       "idle_seconds": a.idle_seconds},
            "settings": rows}


def _list(kind):
    return lambda s: [kind(x) for x in s.split(",") if x]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--progress", type=_list(float), default=[0, 0.001, 0.01, 0.05],
                    help="receiver progress_interval values, seconds (0: no progress thread)")
    ap.add_argument("--writer-progress", type=_list(float), default=[0.0], help="writer progress_interval values")
    ap.add_argument("--receiver-load", type=_list(str), default=["idle"], help="idle and/or busy (decode-like loop)")
    ap.add_argument("--sizes", type=_list(int), default=[1, 16, 64], help="payloads in MiB")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--latency-samples", type=int, default=30)
    ap.add_argument("--prefill-mib", type=_list(int), default=[16, 64], help="payloads of the prefill-like writes")
    ap.add_argument("--layer-ms", type=float, default=8.0, help="writer compute before each layer's write")
    ap.add_argument("--idle-seconds", type=float, default=3.0)
    ap.add_argument("--timeout", type=float, default=10.0, help="deadline of each wait, seconds")
    ap.add_argument("--ucx-tls", default="tcp", help="UCX_TLS for both processes ('' leaves it unset)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--logs", default=None, help="keep both processes' output (UCX_PROTO_INFO's tables) here")
    # The two processes inside the namespaces.
    ap.add_argument("--role", choices=("orchestrator", "receiver", "writer"), default="orchestrator",
                    help=argparse.SUPPRESS)
    for name in ("--address", "--peer", "--result"):
        ap.add_argument(name, help=argparse.SUPPRESS)
    ap.add_argument("--blocks", type=int, default=0, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if any(load not in ("idle", "busy") for load in a.receiver_load):
        ap.error("--receiver-load takes idle and/or busy")
    if a.repeats < 1 or a.latency_samples < 2:
        ap.error("--repeats must be at least 1 and --latency-samples at least 2")
    if a.role != "orchestrator":
        a.progress, a.writer_progress, a.receiver_load = a.progress[0], a.writer_progress[0], a.receiver_load[0]
        return receiver(a) if a.role == "receiver" else writer(a)
    a.blocks = max(a.sizes + a.prefill_mib)
    a.setting_timeout = 180 + a.timeout * 6
    # SIGTERM runs the finally blocks too: the namespaces go whatever stops the run.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    result = orchestrate(a)
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
