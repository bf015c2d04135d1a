"""Chaos under load: steady traffic through a local cluster while its parts are killed.

    python -m bench.chaos --minutes 10 --json build/chaos.json

Starts `pdserve up --prefill 1 --decode 2` (Redis registry), then for --minutes sends
streamed chat completions at --rate requests/s (Poisson arrivals) with the official
`openai` client, which retries a request that failed before anything was streamed (as
its users get by default). Meanwhile, every 30-60 s, a random prefill or decode worker is
SIGKILLed (`up` starts it again), and once each the Redis server and the router.

Each request ends one way: succeeded; failed before its first token (after the client's
retries: the target is 0); failed after it with a clear error event; or cut short with no
error and no finish reason (silent truncation: must never happen). After the load, the
KV blocks still held by workers (leaked), the shared-memory segments left by dead
processes, and the growth of open files and memory of the processes that lived
throughout are measured. Prints a table and writes JSON.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORDS = ("river tide lantern harbour meadow signal engine orbit copper willow falcon ember quartz "
         "compass glacier thunder velvet marble canyon beacon").split()


@dataclass
class Tally:
    sent: int = 0
    succeeded: int = 0
    failed_before_first_token: int = 0
    failed_after_first_token: int = 0
    silently_truncated: int = 0
    retried_by_client: int = 0
    errors: dict[str, int] = field(default_factory=dict)

    def note(self, kind: str, why: str) -> None:
        setattr(self, kind, getattr(self, kind) + 1)
        self.errors[why] = self.errors.get(why, 0) + 1


def _prompt(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 400)))


async def _request(client, rng: random.Random, tally: Tally, model: str) -> None:
    import openai
    tally.sent += 1
    got_token, finished = False, None
    try:
        stream = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": _prompt(rng)}], stream=True,
            max_tokens=rng.randint(8, 96), temperature=0.7, seed=rng.randrange(2**31))
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                got_token = True
            if chunk.choices and chunk.choices[0].finish_reason:
                finished = chunk.choices[0].finish_reason
    except (openai.APIError, openai.APIConnectionError) as exc:
        tally.note("failed_after_first_token" if got_token else "failed_before_first_token",
                   f"{type(exc).__name__}: {str(exc)[:80]}")
        return
    if finished:
        tally.succeeded += 1
    else:
        tally.note("silently_truncated", "stream ended without an error or a finish reason")


async def _load(base_url: str, model: str, minutes: float, rate: float, seed: int) -> Tally:
    import httpx
    import openai
    tally = Tally()
    rng = random.Random(seed)

    class Counting(httpx.AsyncHTTPTransport):
        async def handle_async_request(self, request):
            tally.retried_by_client += 1
            return await super().handle_async_request(request)

    http = httpx.AsyncClient(transport=Counting(), timeout=httpx.Timeout(300, connect=10))
    client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="chaos", max_retries=6, http_client=http)
    tasks, end = set(), time.monotonic() + minutes * 60
    while time.monotonic() < end:
        task = asyncio.create_task(_request(client, random.Random(rng.random()), tally, model))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        await asyncio.sleep(rng.expovariate(rate))
    await asyncio.gather(*tasks)
    await http.aclose()
    tally.retried_by_client -= tally.sent               # transport calls beyond the first per request
    return tally


def _announce(path: Path) -> dict:
    while True:
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            time.sleep(0.2)


def _proc_stats(pid: int) -> dict | None:
    try:
        rss = int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        return {"fds": len(os.listdir(f"/proc/{pid}/fd")), "rss_mib": rss / 2**20}
    except OSError:
        return None


def _chaos(announce: Path, minutes: float, seed: int, log: list) -> None:
    """Runs in a thread: kill a random worker every 30-60 s; Redis and the router once each."""
    rng = random.Random(seed + 1)
    end = time.monotonic() + minutes * 60 - 45
    once = ["redis", "router"]
    rng.shuffle(once)
    while time.monotonic() < end:
        time.sleep(rng.uniform(30, 60))
        if time.monotonic() >= end:
            break
        info = _announce(announce)
        if once and rng.random() < 0.3:
            what = once.pop()
            pid = info["redis_pid"] if what == "redis" else info["router_pid"]
        else:
            role = rng.choice(["prefills", "decodes"])
            worker = rng.choice(info[role])
            what, pid = f"{role[:-1]} on :{worker.get('grpc_port')}", worker.get("pid")
        if pid:
            try:
                os.kill(pid, signal.SIGKILL)
                log.append({"at": time.time(), "killed": what, "pid": pid})
                print(f"chaos: killed {what} (pid {pid})", flush=True)
            except ProcessLookupError:
                pass


def _leaked_blocks(info: dict) -> int:
    import grpc

    from services.rpc import worker_pb2, worker_pb2_grpc
    from services.common.security import ClusterSecret
    credential = ClusterSecret.from_file(info["cluster_secret_file"]).call_metadata()
    leaked = 0
    for role, stub_cls in (("decodes", worker_pb2_grpc.DecodeWorkerStub),
                           ("prefills", worker_pb2_grpc.PrefillWorkerStub)):
        for w in info[role]:
            with grpc.insecure_channel(f"127.0.0.1:{w['grpc_port']}") as ch:
                deadline = time.monotonic() + 60
                while True:
                    s = stub_cls(ch).Stats(worker_pb2.InfoRequest(), timeout=10, metadata=credential)
                    held = s.info.num_blocks - s.info.free_blocks
                    if held == 0 or time.monotonic() > deadline:
                        break
                    time.sleep(0.5)
            leaked += held
    return leaked


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.chaos", description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--rate", type=float, default=1.0, help="requests per second")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    from services.common.shm import live_segments
    work = Path(tempfile.mkdtemp(prefix="pdserve-chaos-"))
    announce = work / "cluster.json"
    up = subprocess.Popen([sys.executable, "-m", "services.cli", "up", "--prefill", "1", "--decode", "2",
                           "--http-port", "0", "--grpc-port", "0", "--announce-file", str(announce),
                           "--log-level", "warning"], cwd=ROOT, stdout=open(work / "up.log", "wb"),
                          stderr=subprocess.STDOUT)
    try:
        info = _announce(announce)
        before = {pid: _proc_stats(pid) for pid in [up.pid, info["router_pid"]]
                  + [w["pid"] for w in info["prefills"] + info["decodes"]]}
        kills: list = []
        chaos = threading.Thread(target=_chaos, args=(announce, a.minutes, a.seed, kills), daemon=True)
        chaos.start()
        t0 = time.monotonic()
        import httpx
        model = httpx.get(f"{info['http']}/v1/models", timeout=30).json()["data"][0]["id"]
        tally = asyncio.run(_load(info["http"], model, a.minutes, a.rate, a.seed))
        chaos.join()
        info = _announce(announce)
        leaked = _leaked_blocks(info)
        after = {pid: _proc_stats(pid) for pid in before}
        lived = {pid: (before[pid], after[pid]) for pid in before if before[pid] and after[pid]}
        dead_segments = [str(s) for s in live_segments() if not Path(f"/proc/{s.name.split('-')[2]}").exists()]
        result = {"minutes": a.minutes, "rate": a.rate, "wall_seconds": time.monotonic() - t0, "kills": kills,
                  **asdict(tally), "kv_blocks_leaked": leaked, "shm_segments_left": len(dead_segments),
                  "fd_growth": {str(pid): b["fds"] - a_["fds"] for pid, (a_, b) in lived.items()},
                  "rss_growth_mib": {str(pid): round(b["rss_mib"] - a_["rss_mib"], 1)
                                     for pid, (a_, b) in lived.items()}}
    finally:
        up.send_signal(signal.SIGINT)
        try:
            up.wait(timeout=90)
        except subprocess.TimeoutExpired:
            up.kill()
    result["shm_segments_after_stop"] = len(live_segments())
    rows = [("requests sent", tally.sent), ("succeeded", tally.succeeded),
            ("failed before their first token", tally.failed_before_first_token),
            ("failed after it, with an error event", tally.failed_after_first_token),
            ("cut short silently", tally.silently_truncated), ("client retries", tally.retried_by_client),
            ("kills", ", ".join(k["killed"] for k in kills)), ("KV blocks leaked", leaked),
            ("shm segments of dead processes", result["shm_segments_left"]),
            ("fd growth (survivors)", result["fd_growth"]), ("RSS growth MiB (survivors)", result["rss_growth_mib"])]
    print(f"\nchaos: {a.minutes:g} min at {a.rate:g} req/s\n" + "\n".join(f"| {k} | {v} |" for k, v in rows))
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1) + "\n")
    ok = (tally.failed_before_first_token == 0 and tally.silently_truncated == 0 and leaked == 0
          and result["shm_segments_left"] == 0)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
