"""KV-transfer benchmark: bandwidth of every backend between two processes against an
in-process torch copy of the same bytes, and the time-to-first-token overhead of
disaggregation through a real local cluster.

    python -m bench.kv_transfer --json out.json [--sizes 1,16,256] [--repeats 5] [--no-ttft]

Payloads are KV-shaped: 32 layers x K/V x blocks of 16 tokens x 4 heads x 64 dims in
float32, so one block across all layers is exactly 1 MiB. A writer process sends every
block layer by layer (as prefill does) into a receiving pool in this process; the time
runs from the first write to the last completion. The machine's memory bandwidth drifts
by tens of percent from minute to minute, so each round first times an in-process copy
of the same bytes in the writer, and the ratio reported is the median of the per-round
ratios (over --repeats rounds after one warm-up).
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from kv_transfer.backends import PREFERENCE, create_transport
from kv_transfer.base import wait_for
from services.engine.model.kv_cache import KVLayout, KVPoolMemory, compat_hash

MIB = 1 << 20


def layout(blocks: int) -> KVLayout:
    return KVLayout(num_layers=32, num_blocks=blocks, block_size=16, num_kv_heads=4, head_dim=64, dtype="float32")


def _options(backend: str, tcp_streams: int) -> dict:
    return {"streams": tcp_streams} if backend == "tcp" else {}


def _timed_copy(dst: torch.Tensor, src: torch.Tensor) -> float:
    t0 = time.perf_counter()
    dst.copy_(src)
    return time.perf_counter() - t0


def _writer(backend: str, blocks: int, meta: bytes, compat: str, repeats: int, tcp_streams: int, q) -> None:
    """Each round times an in-process copy of the same bytes, then the transfer, so
    every transfer has a baseline taken a moment before it on the same core."""
    torch.set_num_threads(1)
    local = KVPoolMemory.allocate(layout(blocks))
    local.tensor.uniform_()
    scratch = torch.empty_like(local.tensor)
    t = create_transport(backend, **_options(backend, tcp_streams))
    t.register(local, compat)
    peer = t.connect(meta, compat)
    ids = list(range(blocks))
    rounds = []
    for _ in range(repeats + 1):                         # the first round warms the link up
        copy = _timed_copy(scratch, local.tensor)
        t0 = time.perf_counter()
        xfers = [t.write(peer, ids, ids, range(layer, layer + 1)) for layer in range(local.layout.num_layers)]
        wait_for(t, xfers, time.monotonic() + 120)
        rounds.append((time.perf_counter() - t0, copy))
    q.put((rounds[1:], float(local.tensor.sum())))
    t.shutdown()


@dataclass
class Paired:
    """Medians of `rounds` (transfer seconds, copy seconds) pairs."""
    seconds: float
    memcpy_seconds: float
    ratio: float                       # median of the per-round copy / transfer ratios

    @classmethod
    def of(cls, rounds: list[tuple[float, float]]) -> "Paired":
        return cls(statistics.median(x for x, _ in rounds), statistics.median(c for _, c in rounds),
                   statistics.median(c / x for x, c in rounds))

    def row(self, nbytes: int) -> dict:
        return {"seconds": self.seconds, "gbps": nbytes / self.seconds / 1e9,
                "memcpy_gbps": nbytes / self.memcpy_seconds / 1e9, "ratio_to_memcpy": self.ratio}


def transfer(backend: str, size_mib: int, repeats: int, tcp_streams: int = 2) -> Paired:
    """Move `size_mib` MiB from another process into this one, `repeats` times."""
    lay = layout(size_mib)
    pool = KVPoolMemory.allocate(lay, shared=backend == "shm")
    t = create_transport(backend)
    compat = compat_hash("bench", lay)
    try:
        meta = t.register(pool, compat)
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        p = ctx.Process(target=_writer, args=(backend, size_mib, meta, compat, repeats, tcp_streams, q))
        p.start()
        rounds, checksum = q.get(timeout=600)
        p.join(60)
        if abs(float(pool.tensor.sum()) - checksum) > 1e-3 * max(1.0, abs(checksum)):
            raise RuntimeError(f"{backend}: received bytes differ from the sent ones")
        return Paired.of(rounds)
    finally:
        t.shutdown()
        pool.close()


def memcpy(size_mib: int, repeats: int) -> float:
    src = torch.rand(size_mib * MIB // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    return statistics.median(_timed_copy(dst, src) for _ in range(repeats))


def _raw_receiver(nbytes: int, repeats: int, q) -> None:
    import socket
    srv = socket.create_server(("127.0.0.1", 0))
    q.put(srv.getsockname()[1])
    conn, _ = srv.accept()
    view = memoryview(bytearray(nbytes))
    for _ in range(repeats + 1):
        got = 0
        while got < nbytes:
            got += conn.recv_into(view[got:])
        conn.sendall(b"k")


def raw_tcp(size_mib: int, repeats: int) -> Paired:
    """The kernel's loopback ceiling: one plain socket stream between two processes."""
    import socket
    nbytes = size_mib * MIB
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_raw_receiver, args=(nbytes, repeats, q))
    p.start()
    sock = socket.create_connection(("127.0.0.1", q.get(timeout=60)))
    src = torch.rand(nbytes // 4)
    scratch = torch.empty_like(src)
    data = memoryview(src.view(torch.uint8).numpy())
    rounds = []
    for _ in range(repeats + 1):
        copy = _timed_copy(scratch, src)
        t0 = time.perf_counter()
        sock.sendall(data)
        sock.recv(1)
        rounds.append((time.perf_counter() - t0, copy))
    sock.close()
    p.join(60)
    return Paired.of(rounds[1:])


def available_backends() -> list[str]:
    out = []
    for name in PREFERENCE:
        try:
            create_transport(name).shutdown()
            out.append(name)
        except Exception as exc:
            print(f"  {name}: not available here ({exc})", file=sys.stderr)
    return out


def bandwidth(sizes: list[int], repeats: int, tcp_streams: int = 2) -> dict:
    torch.set_num_threads(1)
    result: dict = {"memcpy": {}, "backends": {}, "raw_tcp_socket": {}}
    backends = available_backends()
    print(f"{'backend':<8} {'MiB':>5} {'GB/s':>8} {'memcpy GB/s':>12} {'x memcpy':>9}")

    def show(name: str, size: int, row: dict, note: str = "") -> None:
        print(f"{name:<8} {size:>5} {row['gbps']:>8.2f} {row['memcpy_gbps']:>12.2f} "
              f"{row['ratio_to_memcpy']:>9.2f}{note}")
    for size in sizes:
        base = memcpy(size, repeats)
        gbps = size * MIB / base / 1e9
        result["memcpy"][str(size)] = {"seconds": base, "gbps": gbps}
        show("memcpy", size, {"gbps": gbps, "memcpy_gbps": gbps, "ratio_to_memcpy": 1.0})
        row = raw_tcp(size, repeats).row(size * MIB)
        result["raw_tcp_socket"][str(size)] = row
        show("raw-tcp", size, row, "  (plain socket, reference)")
        for name in backends:
            row = transfer(name, size, repeats, tcp_streams).row(size * MIB)
            result["backends"].setdefault(name, {})[str(size)] = row
            show(name, size, row)
    return result


def _first_token_seconds(url: str, prompt: list[int]) -> float:
    """Time to the first streamed chunk carrying a token."""
    import httpx
    body = {"prompt": prompt, "max_tokens": 2, "temperature": 0, "stream": True, "return_token_ids": True}
    t0 = time.perf_counter()
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: {") and any(c.get("token_ids") for c in json.loads(line[6:])["choices"]):
                return time.perf_counter() - t0
    raise RuntimeError("the stream carried no token")


def _transport_used(url: str) -> str:
    import httpx
    route = httpx.post(f"{url}/v1/completions", timeout=600,
                       json={"prompt": [100] * 8, "max_tokens": 1}).headers.get("x-pdserve-route", "")
    return dict(p.split("=", 1) for p in route.split(";")).get("transport", "?")


def _worker_compute_seconds(metrics_url: str) -> float:
    """The prefill worker's forward-pass time so far: its prefill step time minus the
    KV-transfer tail it waited for after the last layer (both from its /metrics)."""
    import re

    import httpx
    text = httpx.get(metrics_url, timeout=30).text

    def total(pattern: str) -> float:
        return sum(float(v) for v in re.findall(pattern + r" ([0-9.eE+-]+)", text))
    return (total(r'pdserve_engine_step_seconds_sum\{kind="prefill"\}')
            - total(r'pdserve_kv_transfer_seconds_sum\{backend="[a-z]+"\}'))


def ttft_overhead(prompt_lens: list[int], repeats: int, transport: str, up_args: list[str] = ()) -> dict:
    """TTFT through a local cluster (HTTP, router, prefill worker, KV transfer, first
    token) minus the same prefill done by the engine in this process, one thread each.

    The forward pass itself varies by several percent from one run to the next on a
    shared machine, which swamps a difference of a few percent; so each cluster request
    is also split into the prefill worker's own forward-pass time (from its /metrics)
    and everything else, which is what disaggregation adds."""
    from services.engine.text.model_store import ensure_default_model
    from services.engine.model.runner import ModelRunner

    model_dir = ensure_default_model()
    torch.set_num_threads(1)
    runner = ModelRunner(model_dir, "bfloat16")
    lay = runner.layout(2 * max(prompt_lens) // 16 + 2, 16)
    pool = KVPoolMemory.allocate(lay)
    tmp = Path(tempfile.mkdtemp(prefix="pdserve-bench-"))
    announce = tmp / "up.json"
    # Every prompt through a prefill worker and nothing from the prefix cache: the same
    # prompt is sent again and again, and each time must be a full prefill.
    proc = subprocess.Popen([sys.executable, "-m", "services.cli", "up", "--http-port", "0", "--grpc-port", "0",
                             "--announce-file", str(announce), "--log-level", "warning", "--kv-transport", transport,
                             "--prefix-cache-tokens", "0", "--local-prefill-max-tokens", "0", *up_args],
                            stdout=open(tmp / "up.log", "wb"), stderr=subprocess.STDOUT)
    out: dict = {}
    try:
        while not announce.exists():
            if proc.poll() is not None:
                raise RuntimeError((tmp / "up.log").read_text()[-2000:])
            time.sleep(0.1)
        cluster = json.loads(announce.read_text())
        url = cluster["http"]
        # The in-process prefill runs on the core(s) the prefill worker is pinned to, so
        # the two passes it compares differ only in where they run, not on which core.
        worker_cores = os.sched_getaffinity(cluster["prefill"]["pid"])
        own_cores = os.sched_getaffinity(0)
        metrics_url = f"http://127.0.0.1:{cluster['prefill']['metrics_port']}/metrics"
        print(f"{'prompt':>7} {'in-process ms':>14} {'cluster ms':>11} {'overhead':>9} "
              f"{'added outside the forward pass':>31}  transport")
        for n in prompt_lens:
            prompt = [(i * 7919) % 40000 + 100 for i in range(n)]
            local, remote, added = [], [], []
            for _ in range(repeats + 1):
                os.sched_setaffinity(0, worker_cores)
                t0 = time.perf_counter()
                runner.prefill(pool, prompt, list(range(-(-n // 16))))
                local.append(time.perf_counter() - t0)
                os.sched_setaffinity(0, own_cores)
                before = _worker_compute_seconds(metrics_url)
                seconds = _first_token_seconds(url, prompt)
                remote.append(seconds)
                added.append(seconds - (_worker_compute_seconds(metrics_url) - before))
            # Pairs run back to back, so the median of per-pair overheads resists the
            # machine's slow drifts better than the difference of two medians.
            lo, re_ = statistics.median(local[1:]), statistics.median(remote[1:])
            pct = statistics.median(100 * (r - l) / l for l, r in zip(local[1:], remote[1:]))
            add = statistics.median(added[1:])
            used = _transport_used(url)
            out[str(n)] = {"in_process_s": lo, "cluster_s": re_, "overhead_s": re_ - lo, "overhead_pct": pct,
                           "added_outside_forward_s": add, "added_outside_forward_pct": 100 * add / lo,
                           "transport": used}
            print(f"{n:>7} {lo * 1000:>14.1f} {re_ * 1000:>11.1f} {pct:>8.1f}% "
                  f"{add * 1000:>16.1f} ms ({100 * add / lo:4.1f} %)  {used}")
    finally:
        proc.send_signal(2)
        proc.wait(60)
        pool.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="1,16,256", help="payload sizes in MiB")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--prompts", default="128,1024,4096", help="prompt lengths for the TTFT overhead")
    ap.add_argument("--no-ttft", action="store_true")
    ap.add_argument("--tcp-streams", type=int, default=2, help="connections per peer for the tcp backend")
    ap.add_argument("--ttft-transport", default="auto", help="--kv-transport of the cluster for the TTFT part")
    ap.add_argument("--up-args", default="", help="more `pdserve up` flags for the TTFT part, e.g. '--no-pin-cpus'")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    result = {"bandwidth": bandwidth([int(s) for s in a.sizes.split(",")], a.repeats, a.tcp_streams)}
    if not a.no_ttft:
        result["ttft_overhead"] = ttft_overhead([int(s) for s in a.prompts.split(",")], a.repeats,
                                                a.ttft_transport, a.up_args.split())
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
