"""Does pdserve work on this CUDA machine? Checks that need no download.

    python -m bench.gpu_check --json out.json          (make gpu-check)
    python -m bench.gpu_check --device cpu --quick     (the same checks on the CPU: the script's own test)

Models are random-initialised Llama shapes from configs with a fixed seed, saved with a
byte-level tokenizer built here, so nothing is fetched:
  tiny     4 layers, hidden 256: float32 parity through a real cluster
  1b, 8b   Llama-3.2-1B and Llama-3.1-8B KV shapes: transfer sizes only (no weights built)

Checks, each a row of the table and of the JSON:
  parity     `pdserve up` (one prefill and one decode worker on the device, KV through
             NIXL, every prompt prefilled remotely): greedy tokens for several prompts are
             token-for-token `model.generate`'s on the same weights and device, float32
  race       32 concurrent long prompts through the same cluster, each checked the same
             way: a layer shipped before its write finished changes the decode worker's
             KV and, in float32, the tokens (services/engine/model/device.py orders the push)
  bandwidth  NIXL writes between two agents' device pools, layer by layer as prefill
             sends, in GB/s and as a ratio to a torch device-to-device copy of the bytes
  api        on the same cluster: n=3 greedy choices forked on the decode worker all equal
             generate's, logprobs equal log_softmax of transformers' logits on the device
             (1e-3), and a JSON schema's masks keep the output to the schema's values
  host-only  a pool on the device offered through shm or tcp: refused at start
  spec       speculative decoding on the decode worker (the model drafting for itself,
             4 tokens a step, so nearly every draft is kept): the same parity check as
             `parity`, with verify steps of 5 rows a sequence through the CUDA graphs and
             the grouped decode kernel, and the drafts the worker counts as accepted
  tp         tensor parallelism through a cluster: prefill TP 2 into decode TP 1, KV
             resharded through NIXL, each rank on a GPU of its own from three cards on
             (on fewer they share, for correctness only): the same parity check as
             `parity`. A check that raises is reported and the ones after it still run
  pause      a prefill engine that yields (LLMEngine(yields=True)) on the device, a
             16-layer model, hidden 1,024: a short prompt more urgent than a long one
             whose pass has reached a quarter of its layers gets its first token in
             under half the long pass's time alone (launched whole, it would wait for
             the rest of the pass), and both first tokens are those each prompt gets
             alone, float32
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import signal
import string
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.kv_transfer import Paired

ROOT = Path(__file__).resolve().parents[1]
SEED = 1234
# (layers, kv heads, head dim) of real models, for transfer sizes
KV_SHAPES = {"1b": (16, 8, 64), "8b": (32, 8, 128)}


def build_tiny_model(folder: Path, seed: int = SEED, shape: dict | None = None,
                     dtype: torch.dtype = torch.float32, device: str = "cpu") -> Path:
    """A 4-layer Llama with random weights and a byte-level tokenizer, saved as a local
    Hugging Face folder the services load like any other. `shape`: other LlamaConfig
    sizes (bench/gpu_speed.py's 1B and 8B shapes), built on `device` in `dtype`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    for s in specials:
        vocab[s] = len(vocab)
    # A shaped model's every id decodes to text (a served answer of random weights is
    # then never empty): filler tokens up to its vocabulary, then word tokens (" bab",
    # " bac", ...: one length, none a prefix of another), which encode back to
    # themselves and which `pdserve bench` builds its prompts of exact lengths from.
    words = [f" {a}{b}{c}" for a in "bcdfghjklmnprstv" for b in "aeiou" for c in "bdgklmnprst"][:400]
    if shape is not None:
        fillers = ("\u0120" + "".join(p) for p in itertools.product(string.ascii_lowercase, repeat=4))
        while len(vocab) < shape["vocab_size"] - len(words):
            vocab[next(fillers)] = len(vocab)
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|im_end|>", bos_token="<|im_start|>",
                                  unk_token="<|endoftext|>", additional_special_tokens=specials)
    tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                         "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    if shape is not None:
        from tokenizers import AddedToken
        tok.add_tokens([AddedToken(w, normalized=False) for w in words])
    sizes = shape or dict(vocab_size=len(vocab), hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                          num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=True)
    config = LlamaConfig(**{"max_position_embeddings": 4096, **sizes}, eos_token_id=vocab["<|im_end|>"],
                         bos_token_id=vocab["<|im_start|>"])
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    if shape is None:
        with torch.no_grad():                               # sharper logits: fewer near-ties in greedy parity
            model.lm_head.weight.mul_(4.0)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def _prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab - 3, (length,), generator=g).tolist() for _ in range(n)]


def _reference(model_dir: Path, device: str, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p], device=device)
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                                 do_sample=False, eos_token_id=None, pad_token_id=0)
            out.append(gen[0, len(p):].tolist())
    del model
    return out


class Cluster:
    """`pdserve up` on `device` with the tiny model; stopped by PID."""

    # the parity checks' cluster: float32, every prompt prefilled remotely
    PARITY = ("--dtype", "float32", "--prefill", "1", "--decode", "1", "--local-prefill-max-tokens", "0",
              "--kv-cache-tokens", "65536", "--gpu-memory-utilization", "0.4")

    def __init__(self, model_dir: Path, device: str, work: Path, args: tuple[str, ...] = PARITY,
                 share: bool | None = None) -> None:
        """`share`: workers may share a GPU (default: when there is only one)."""
        self.announce = work / "cluster.json"
        self.announce.unlink(missing_ok=True)
        self.log = work / "up.log"
        cmd = [sys.executable, "-m", "services.cli", "up", "--model", str(model_dir), "--device", device,
               "--kv-transport", "nixl", *args, "--http-port", "0",
               "--grpc-port", "0", "--announce-file", str(self.announce), "--log-level", "warning"]
        if device.startswith("cuda") and (torch.cuda.device_count() < 2 if share is None else share):
            cmd += ["--share-gpus"]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=open(self.log, "wb"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 600
        while not self.announce.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the cluster did not start:\n{self.log.read_text()[-3000:]}")
            time.sleep(0.2)
        self.info = json.loads(self.announce.read_text())

    def complete(self, prompts: list[list[int]], max_tokens: int) -> list[dict]:
        import asyncio

        import httpx

        async def one(client, p):
            r = await client.post(f"{self.info['http']}/v1/completions", json={
                "prompt": p, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True})
            r.raise_for_status()
            route = dict(x.split("=", 1) for x in r.headers["x-pdserve-route"].split(";"))
            return {"tokens": r.json()["choices"][0]["token_ids"], "route": route}

        async def run():
            async with httpx.AsyncClient(timeout=600) as client:
                return await asyncio.gather(*(one(client, p) for p in prompts))
        return asyncio.run(run())

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def check_parity(cluster: Cluster, model_dir: Path, device: str, vocab: int, n: int, length: int,
                 max_tokens: int, seed: int) -> dict:
    prompts = _prompts(n, length, vocab, seed)
    got = cluster.complete(prompts, max_tokens)
    want = _reference(model_dir, device, prompts, max_tokens)
    same = sum(g["tokens"] == w for g, w in zip(got, want))
    transports = sorted({g["route"].get("transport", "") for g in got})
    remote = sum(g["route"]["decision"] == "remote" for g in got)
    return {"prompts": n, "prompt_tokens": length, "max_tokens": max_tokens, "identical": same,
            "remote": remote, "transports": transports, "ok": same == n and remote == n and transports == ["nixl"]}


def check_tensor_parallel(model_dir: Path, device: str, work: Path, vocab: int, quick: bool) -> dict:
    """Prefill TP 2 into decode TP 1 (each decode rank takes two prefill ranks' KV heads),
    through NIXL: on three GPUs or more each rank has its own, on fewer they share."""
    cards = torch.cuda.device_count() if device.startswith("cuda") else 0
    prefill_tp, decode_tp = 2, 1
    shared = 0 < cards < prefill_tp + decode_tp
    cluster = Cluster(model_dir, device, work, Cluster.PARITY + ("--prefill-tp", str(prefill_tp), "--decode-tp",
                                                                 str(decode_tp)), share=shared)
    try:
        out = check_parity(cluster, model_dir, device, vocab, n=4, length=64 if quick else 300,
                           max_tokens=8 if quick else 32, seed=3)
    finally:
        cluster.stop()
    return {**out, "prefill_tp": prefill_tp, "decode_tp": decode_tp, "shared": shared}


def check_api(cluster: Cluster, model_dir: Path, device: str, vocab: int) -> dict:
    """What runs on the device for the API's features: logprobs against transformers'
    forward pass on the same device, n choices forked on the decode worker (greedy: all
    the reference answer), and a JSON schema's masks (the output is one of its values)."""
    import httpx
    from transformers import AutoModelForCausalLM
    prompt = _prompts(1, 48, vocab, 3)[0]
    url = f"{cluster.info['http']}/v1/completions"
    body = {"prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    r = httpx.post(url, json={**body, "logprobs": 3, "n": 3}, timeout=600).json()
    want = _reference(model_dir, device, [prompt], 6)[0]
    choices_ok = all(c["token_ids"] == want for c in r["choices"])
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt + want], device=device)).logits[0, len(prompt) - 1:-1].float()
    expected = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(want, device=device)[:, None])[:, 0]
    got = torch.tensor(r["choices"][0]["logprobs"]["token_logprobs"], device=device)
    worst = float((got - expected).abs().max())
    del model
    schema = {"enum": ["yes", "no", "maybe"]}
    j = httpx.post(f"{cluster.info['http']}/v1/chat/completions", timeout=600, json={
        "messages": [{"role": "user", "content": "?"}], "max_tokens": 8, "temperature": 1.0, "seed": 5,
        "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}}).json()
    # an error answer (a worker without xgrammar, say) fails the check and says why
    answer = j["choices"][0]["message"]["content"] if "choices" in j else f"error: {j.get('error', j)}"
    json_ok = answer in {json.dumps(v) for v in schema["enum"]}
    return {"choices_identical": choices_ok, "logprob_max_error": worst, "json_output": answer,
            "ok": choices_ok and worst < 1e-3 and json_ok}


def check_speculation(model_dir: Path, device: str, work: Path, vocab: int, quick: bool) -> dict:
    """Greedy output with drafts verified on the device equals generate's."""
    import httpx
    from services.bench.server_metrics import acceptance, parse
    config = {"method": "draft", "model": str(model_dir), "num_speculative_tokens": 4, "adaptive": False}
    cluster = Cluster(model_dir, device, work, Cluster.PARITY + ("--speculative-config", json.dumps(config)))
    try:
        out = check_parity(cluster, model_dir, device, vocab, n=4, length=64 if quick else 300,
                           max_tokens=12 if quick else 48, seed=4)
        seen = acceptance({}, parse(httpx.get(f"http://127.0.0.1:{cluster.info['decode']['metrics_port']}/metrics",
                                              timeout=30).text))
    finally:
        cluster.stop()
    drafts, accepted = (seen.drafts, seen.accepted_tokens) if seen else (0, 0)
    return {**out, "drafts": drafts, "accepted_tokens": accepted, "ok": out["ok"] and accepted > 0}


def check_bandwidth(device: str, shape: tuple[int, int, int], blocks: int, repeats: int) -> dict:
    """Two NIXL agents in this process, device pools, every layer written as prefill sends it."""
    from kv_transfer.base import wait_for
    from kv_transfer.nixl import NixlTransport
    from services.engine.model.kv_cache import KVLayout, KVPoolMemory, compat_hash
    layers, heads, dim = shape
    layout = KVLayout(layers, blocks, 16, heads, dim, "bfloat16")
    src, dst = (KVPoolMemory.allocate(layout, device=device) for _ in range(2))
    src.tensor.normal_()
    compat = compat_hash("gpu-check", layout)
    writer, receiver = NixlTransport(progress_interval=0.0), NixlTransport(progress_interval=0.01)
    try:
        meta = receiver.register(dst, compat)
        writer.register(src, compat)
        peer = writer.connect(meta, compat)
        ids = list(range(blocks))
        rounds = []
        for _ in range(repeats + 1):
            scratch = torch.empty_like(src.tensor)
            _sync(device)
            t0 = time.perf_counter()
            scratch.copy_(src.tensor)
            _sync(device)
            copy = time.perf_counter() - t0
            t0 = time.perf_counter()
            xfers = [writer.write(peer, ids, ids, range(layer, layer + 1)) for layer in range(layers)]
            wait_for(writer, xfers, time.monotonic() + 300)
            rounds.append((time.perf_counter() - t0, copy))
        exact = bool(torch.equal(src.tensor, dst.tensor))
    finally:
        writer.shutdown()
        receiver.shutdown()
    nbytes = src.tensor.numel() * src.tensor.element_size()
    row = Paired.of(rounds[1:]).row(nbytes)
    return {"kv_shape": f"{layers} layers x {heads} kv heads x {dim}", "bytes": nbytes, "gbps": row["gbps"],
            "copy_gbps": row["memcpy_gbps"], "ratio_to_copy": row["ratio_to_memcpy"], "bitwise": exact, "ok": exact}


def check_host_only_refused(device: str) -> dict:
    from kv_transfer.backends import open_transports
    from kv_transfer.base import TransferError
    if device == "cpu":
        device = "cuda:0"                     # the decision needs no GPU: it is made from the pool's device
    out = {}
    for name in ("shm", "tcp"):
        try:
            opened = open_transports(name, device=device)
            for t in opened.values():
                t.shutdown()
            out[name] = "offered (wrong)"
        except TransferError as exc:
            out[name] = f"refused: {exc}"
    return {**out, "ok": all(v.startswith("refused") for v in out.values())}


def check_pause(device: str, work: Path, quick: bool) -> dict:
    from services.engine.core.block_manager import BlockManager
    from services.engine.core.block_pool import BlockPool
    from services.engine.core.sampling import SamplingParams
    from services.engine.core.scheduler import Scheduler, SchedulerConfig
    from services.engine.core.sequence import Sequence
    from services.engine.engine import LLMEngine
    from services.engine.model.kv_cache import KVPoolMemory
    from services.engine.model.runner import ModelRunner
    # Big enough that a GPU computes a layer in well over the host's time to launch one
    # (~2 ms against ~0.2 on an H100, float32): launched whole, the pass runs far ahead.
    layers, hidden = (12, 256) if quick else (16, 1024)
    model_dir = build_tiny_model(work / "pause", shape=dict(
        vocab_size=1024, hidden_size=hidden, intermediate_size=hidden * 11 // 4, num_hidden_layers=layers,
        num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=True), device=device)
    runner = ModelRunner(model_dir, "float32", device, cuda_graphs=False)
    long_prompt, short_prompt = _prompts(1, 768 if quick else 4000, 1024, seed=5)[0], _prompts(1, 32, 1024, 6)[0]
    blocks = 2 * (len(long_prompt) // 16 + 2)
    added: dict[str, float] = {}

    def hook(layer: int, plan) -> None:             # once the layer's KV is written
        if (plan.chunks[0].seq.request_id == "long" and layer == layers // 4 and "urgent" in pending
                and "short" not in added):
            added["short"] = time.perf_counter()
            engine.add(pending.pop("urgent"))
    memory = KVPoolMemory.allocate(runner.layout(blocks, 16), device=device)
    engine = LLMEngine(runner, memory, Scheduler(BlockManager(BlockPool(blocks, 16)), SchedulerConfig(
        max_num_seqs=4, max_num_batched_tokens=4096, prefill_only=True, retain_finished=True)),
        layer_hook=hook, yields=True)
    out: dict[str, tuple[list[int], float]] = {}
    engine.interjected = lambda outputs, stats: out.update((o.request_id, (o.token_ids, time.perf_counter()))
                                                            for o in outputs)
    pending: dict[str, Sequence] = {}

    def run(name: str, prompt: list[int], priority: int, urgent: list[int] | None = None) -> float:
        if urgent is not None:
            pending["urgent"] = Sequence("short", list(urgent), len(urgent), SamplingParams(max_tokens=1,
                                         temperature=0), frozenset(), priority=0)
        engine.add(Sequence(name, list(prompt), len(prompt), SamplingParams(max_tokens=1, temperature=0),
                            frozenset(), priority=priority))
        t0 = time.perf_counter()
        while engine.has_work():
            out.update((o.request_id, (o.token_ids, time.perf_counter())) for o in engine.step())
        seconds = time.perf_counter() - t0
        for request_id in list(out):
            engine.release(request_id)
        engine.step()
        return seconds

    try:
        run("short", short_prompt, 0)
        alone_short = out.pop("short")[0]
        run("long", long_prompt, 1)                 # warm-up
        out.clear()
        long_seconds = min(run("long", long_prompt, 1) for _ in range(2))
        alone_long = out.pop("long")[0]
        out.clear()
        added.clear()
        run("long", long_prompt, 1, urgent=short_prompt)
        tokens, at = out["short"]
        urgent_seconds = at - added["short"]
        identical = tokens == alone_short and out["long"][0] == alone_long
        free = engine.scheduler.blocks.num_available == blocks
    finally:
        memory.close()
    return {"layers": layers, "long_tokens": len(long_prompt), "long_pass_seconds": round(long_seconds, 4),
            "urgent_first_token_seconds": round(urgent_seconds, 4), "first_tokens_identical": identical,
            "ok": identical and free and urgent_seconds < 0.5 * long_seconds}


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def describe(device: str) -> str:
    if device.startswith("cuda"):
        p = torch.cuda.get_device_properties(torch.device(device))
        return f"{p.name}, {p.total_memory / 2**30:.0f} GiB, CUDA {torch.version.cuda}, torch {torch.__version__}"
    from services.engine.model.hardware import cpu_kind
    return f"{cpu_kind()} CPU ({platform.machine()}), torch {torch.__version__}"


def _failed(result: dict) -> str:
    """A check's error, for its row, or "" when it ran."""
    return f"ERROR {result['error']}" if "error" in result else ""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.gpu_check", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", help="cuda (default), cuda:N, or cpu (checks the script itself)")
    p.add_argument("--quick", action="store_true", help="fewer and shorter prompts, small transfers")
    p.add_argument("--json", default=None, metavar="OUT.json")
    a = p.parse_args(argv)
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here (torch.cuda.is_available() is False); "
              "--device cpu runs the same checks on the CPU", file=sys.stderr)
        return 2
    results: dict = {"device": describe(a.device), "when": time.strftime("%Y-%m-%d %H:%M:%S")}
    work = Path(tempfile.mkdtemp(prefix="pdserve-gpu-check-"))
    model_dir = build_tiny_model(work / "tiny")
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    results["host_only"] = check_host_only_refused(a.device)
    cluster = Cluster(model_dir, a.device, work)
    try:
        results["parity"] = check_parity(cluster, model_dir, a.device, vocab, n=4, length=64 if a.quick else 300,
                                         max_tokens=8 if a.quick else 32, seed=1)
        print("parity", json.dumps(results["parity"]), flush=True)
        results["race"] = check_parity(cluster, model_dir, a.device, vocab, n=8 if a.quick else 32,
                                       length=256 if a.quick else 2048, max_tokens=4 if a.quick else 16, seed=2)
        print("race", json.dumps(results["race"]), flush=True)
        results["api"] = check_api(cluster, model_dir, a.device, vocab)
        print("api", json.dumps(results["api"]), flush=True)
    finally:
        cluster.stop()
    for name, check in (("spec", lambda: check_speculation(model_dir, a.device, work, vocab, a.quick)),
                        ("tp", lambda: check_tensor_parallel(model_dir, a.device, work, vocab, a.quick)),
                        ("pause", lambda: check_pause(a.device, work, a.quick))):
        try:
            results[name] = check()
        except Exception as exc:        # reported, and the checks after it still run
            results[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[-2000:]}
        print(name, json.dumps(results[name]), flush=True)
    blocks = 8 if a.quick else 256
    results["bandwidth"] = {name: check_bandwidth(a.device, shape, blocks, 2 if a.quick else 5)
                            for name, shape in KV_SHAPES.items()}
    ok = all(results[k]["ok"] for k in ("parity", "race", "api", "host_only", "spec", "tp", "pause")) and all(
        b["ok"] for b in results["bandwidth"].values())
    results["ok"] = ok
    rows = [("device", results["device"]),
            ("parity (float32 greedy, remote prefill, NIXL)",
             f"{results['parity']['identical']}/{results['parity']['prompts']} identical"),
            ("race (concurrent long prompts)",
             f"{results['race']['identical']}/{results['race']['prompts']} identical"),
            ("API: n=3 forks, logprobs, JSON-schema masks",
             f"choices identical {results['api']['choices_identical']}, logprob error "
             f"{results['api']['logprob_max_error']:.1e}, JSON {results['api']['json_output']}"),
            *((f"NIXL {n} KV ({b['bytes'] / 2**20:.0f} MiB)", f"{b['gbps']:.1f} GB/s = {b['ratio_to_copy']:.2f}x a "
               f"device copy ({b['copy_gbps']:.1f} GB/s), bitwise {b['bitwise']}")
              for n, b in results["bandwidth"].items()),
            ("host-only transports for a device pool", "refused" if results["host_only"]["ok"] else "OFFERED"),
            ("speculative decoding (draft model, 4 tokens)", _failed(results["spec"]) or
             f"{results['spec']['identical']}/{results['spec']['prompts']} identical, "
             f"{results['spec']['accepted_tokens']} drafted tokens accepted in {results['spec']['drafts']} drafts"),
            ("tensor parallel", _failed(results["tp"]) or
             f"prefill TP {results['tp']['prefill_tp']} -> decode TP {results['tp']['decode_tp']}"
             + (" (ranks sharing a GPU)" if results["tp"]["shared"] else "")
             + f": {results['tp']['identical']}/{results['tp']['prompts']} identical"),
            ("prefill pause", _failed(results["pause"]) or
             f"a 32-token prompt inside a {results['pause']['long_tokens']}-token pass: first token in "
             f"{results['pause']['urgent_first_token_seconds'] * 1000:.1f} ms against the pass's "
             f"{results['pause']['long_pass_seconds'] * 1000:.1f} ms alone; first tokens identical "
             f"{results['pause']['first_tokens_identical']}")]
    print("\n".join(f"| {k} | {v} |" for k, v in rows))
    print("gpu_check: " + ("all checks passed" if ok else "FAILED"))
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
