"""The systems compared, by name: how each starts on 127.0.0.1:PORT, what `pdserve bench`
must send it, and the process that is started, found ready and stopped by its PID.

Every system gets both cores and runs alone. pdserve serves its default model (bf16
weights cast from the float32 cache); the peers serve a bf16 safetensors copy of it.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import httpx

# transformers serve refuses ignore_eos (HTTP 422); an eos it can never meet is its way of
# not stopping early. Its `generation_config` field is a JSON object in a string.
TRANSFORMERS_NO_EOS = json.dumps({"generation_config": json.dumps({"eos_token_id": -1})})


@dataclass(frozen=True)
class Context:
    """What every launch may need: where the peers and the model copy live."""
    peers_dir: Path
    model_dir: Path | None              # the bf16 copy the peers serve (None: no peer is run)
    python: str                         # the project's interpreter
    ignore_eos: bool = True             # False when the bench flags say --no-ignore-eos
    vllm_max_model_len: int = 4096
    dtype: str = "bfloat16"             # what every system computes in: --dtype auto's pick for this CPU


@dataclass(frozen=True)
class Launch:
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    bench_args: list[str] = field(default_factory=list)   # what `pdserve bench` adds for this server
    model: str | None = None            # the name requests must carry (None: ask /v1/models)


@dataclass(frozen=True)
class System:
    name: str
    peer: str | None                    # the install it needs, None for pdserve itself
    launch: Callable[[Context, int, Path], Launch]


def _pdserve(mode: str, *flags: str) -> Callable[[Context, int, Path], Launch]:
    def launch(c: Context, port: int, workdir: Path) -> Launch:
        return Launch([c.python, "-m", "services.cli", "up", "--mode", mode, "--dtype", c.dtype, *flags,
                       "--host", "127.0.0.1",
                       "--http-port", str(port), "--grpc-port", "0", "--announce-file",
                       str(workdir / "announce.json"), "--log-level", "warning"])
    return launch


def _vllm(*flags: str) -> Callable[[Context, int, Path], Launch]:
    def launch(c: Context, port: int, workdir: Path) -> Launch:
        from bench.peers.install import vllm_venv
        env = {"VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "HF_HUB_OFFLINE": "1",
               "VLLM_CACHE_ROOT": str(c.peers_dir / "vllm-cache")}
        argv = [vllm_venv(c.peers_dir).bin("vllm"), "serve", str(c.model_dir), "--dtype", c.dtype,
                "--max-model-len", str(c.vllm_max_model_len), "--no-enable-prefix-caching",
                "--host", "127.0.0.1", "--port", str(port), *flags]
        return Launch(argv, env, ["--model", str(c.model_dir)], str(c.model_dir))
    return launch


# Speculative decoding, the same drafts asked of each system: prompt lookup of up to
# 4-grams, up to 4 tokens a step (vLLM's ngram); pdserve's suffix index beside it, in
# vLLM's defaults (up to its tree depth, 24 tokens a step).
NGRAM = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
                    "prompt_lookup_min": 2})
SUFFIX = json.dumps({"method": "suffix"})


def _transformers_serve(c: Context, port: int, workdir: Path) -> Launch:
    from bench.peers.install import transformers_venv
    argv = [transformers_venv(c.peers_dir).bin("transformers"), "serve", str(c.model_dir),
            "--continuous-batching", "--dtype", c.dtype, "--device", "cpu",
            "--host", "127.0.0.1", "--port", str(port)]
    bench = ["--model", str(c.model_dir)]
    if c.ignore_eos:                    # the same fixed output lengths, said its way
        bench += ["--no-ignore-eos", "--extra-body", TRANSFORMERS_NO_EOS]
    return Launch(argv, {"HF_HUB_OFFLINE": "1"}, bench, str(c.model_dir))


SYSTEMS = {s.name: s for s in (
    System("pdserve-disaggregated", None, _pdserve("disaggregated")),
    System("pdserve-aggregated", None, _pdserve("aggregated")),
    # Opt-in int8 weights (not in the default set: a quality trade, not the same model's output).
    System("pdserve-aggregated-int8", None, _pdserve("aggregated", "--quantization", "int8")),
    System("pdserve-disaggregated-int8", None, _pdserve("disaggregated", "--quantization", "int8")),
    System("vllm", "vllm", _vllm()),
    System("transformers-serve", "transformers", _transformers_serve),
    # Speculative decoding (not in the default set: measured on workloads that repeat their prompts).
    System("pdserve-disaggregated-ngram", None, _pdserve("disaggregated", "--speculative-config", NGRAM)),
    System("pdserve-disaggregated-suffix", None, _pdserve("disaggregated", "--speculative-config", SUFFIX)),
    System("pdserve-aggregated-ngram", None, _pdserve("aggregated", "--speculative-config", NGRAM)),
    System("pdserve-aggregated-suffix", None, _pdserve("aggregated", "--speculative-config", SUFFIX)),
    System("vllm-ngram", "vllm", _vllm("--speculative-config", NGRAM)),
)}
DEFAULT_SYSTEMS = tuple(name for name in SYSTEMS if not name.endswith(("-int8", "-ngram", "-suffix")))


def parse_systems(text: str) -> list[System]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in SYSTEMS]
    if unknown or not names:
        raise ValueError(f"--systems: unknown {', '.join(unknown) or '(none given)'}; "
                         f"choose from {', '.join(SYSTEMS)}")
    return [SYSTEMS[n] for n in dict.fromkeys(names)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerError(RuntimeError):
    """A system did not start, or did not answer a first request in time."""


class Server:
    """One system's process, in a session of its own so everything it forks can be
    stopped through its process group (found by PID, never by name)."""

    def __init__(self, name: str, launch: Launch, base_url: str, log: Path) -> None:
        self.name, self.launch, self.base_url, self.log = name, launch, base_url, log
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(self.launch.argv, env={**os.environ, **self.launch.env}, stdout=out,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True)

    def _log_tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def wait_ready(self, timeout: float) -> float:
        """Until one tiny chat request succeeds (some servers load the model on the first
        request); returns the seconds that took from start."""
        t0 = time.monotonic()
        deadline = t0 + timeout
        with httpx.Client(timeout=httpx.Timeout(30.0, read=max(timeout, 30.0))) as client:
            while True:
                if self.proc.poll() is not None:
                    raise ServerError(f"{self.name} exited with code {self.proc.returncode} before it served; "
                                      f"the end of {self.log}:\n{self._log_tail()}")
                if time.monotonic() > deadline:
                    raise ServerError(f"{self.name} did not serve within {timeout:g} s; see {self.log}")
                if self._answers(client):
                    return time.monotonic() - t0
                time.sleep(1.0)

    def _answers(self, client: httpx.Client) -> bool:
        try:
            model = self.launch.model
            if model is None:
                r = client.get(f"{self.base_url}/v1/models")
                if r.status_code != 200:
                    return False
                model = r.json()["data"][0]["id"]
            r = client.post(f"{self.base_url}/v1/chat/completions", json={
                "model": model, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 2,
                "temperature": 0, "stream": False})
            return r.status_code == 200
        except (httpx.HTTPError, ValueError, KeyError, IndexError):
            return False

    def stop(self, timeout: float = 60.0) -> None:
        """SIGTERM to the server, then to whatever it left in its process group; SIGKILL
        for what is still there after `timeout`."""
        if self.proc is None:
            return
        pgid = self.proc.pid                # its own session: the group id is its PID
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                pass
        _signal_group(pgid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        while _group_alive(pgid) and time.monotonic() < deadline:
            time.sleep(0.2)
        _signal_group(pgid, signal.SIGKILL)
        if self.proc.poll() is None:
            self.proc.wait()


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except (ProcessLookupError, PermissionError):
        return False
