"""pdserve's speed on one CUDA device against the device's own limits. No download.

    python -m bench.gpu_check --speed --json out.json        (python -m bench.gpu_speed ...)
    python -m bench.gpu_speed --device cpu --quick           (the script's own test, on a CPU)

Models are random-initialised Llama shapes (bfloat16, fixed seed) built on the device:
  1b   Llama-3.2-1B: hidden 2048, 16 layers, 32/8 heads, MLP 8192, tied embeddings
  8b   Llama-3.1-8B: hidden 4096, 32 layers, 32/8 heads, MLP 14336

Figures, each measured in this run:
  copy      a device-to-device copy's rate (bytes read + written per second): the
            memory roofline's rate
  gemm      a bf16 8192^3 matmul's FLOP/s: the compute roofline's rate
  decode    one decode step (host preparation, the forward, the logits' argmax read
            back) at batch 1/16/64/128 x context 512/2k/8k, against the memory roofline:
            (weight bytes + KV bytes read) / copy rate; where the KV does not fit, skipped
  graphs    the same step eagerly (no CUDA graph) at batch 64, context 2k
  engine    the engine core decoding 64 sequences over 2k cached tokens each (the decode
            worker's loop without its RPC: scheduling, the step, sampling, outputs),
            output tokens/s without and with async scheduling; and with ngram drafts
            (async, adaptive) at 1 and 64 sequences against the same without
  syncs     calls that made the host wait for the device (torch's sync debug mode) in the
            async engine's steps, with CUDA graphs and eagerly, over every kind of request
            whose steps overlap: none is expected (the read of a step's tokens waits on an
            event, which the mode does not count); CUDA only
  attention one layer's decode attention: the Triton paged kernel against torch's gather
            path (`--attention-kernel torch`), batch 64, context 2k; and a speculative
            step's (5 rows a sequence: 4 drafts and the token before them), the rows of
            each sequence attended as a group against each row alone
  prefill   one prompt of 512/2k/4k/8k tokens against the GEMM rate: (2 x linear
            weights x tokens + causal attention's matmul FLOPs) / GEMM rate
  sweep     (--sweep) the decode kernel's tile, warps, stages and split target, timed
            on one 8B-shaped layer: how services/engine/kernels/gpu_kernels.py's TILING
            were chosen
Each time is the median of its repeats.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

from services.engine.model.shapes import head_dim, layer_matmul_weights, prefill_flops

SEED = 1234
SHAPES = {
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True, rope_theta=500000.0),
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False, rope_theta=500000.0),
    "tiny": dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
                 num_key_value_heads=2, vocab_size=1024, tie_word_embeddings=True),
}
BATCHES = (1, 16, 64, 128)
CONTEXTS = (512, 2048, 8192)
PROMPTS = (512, 2048, 4096, 8192)
BLOCK_SIZE = 16
# rows a sequence in a speculative step: 4 drafts and the token before them
VERIFY_ROWS = 5
# the engine's speculation case: vLLM's ngram settings, adaptive
SPECULATION = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}'


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device, repeats: int, warmup: int = 2) -> float:
    """Median seconds of fn() over `repeats` calls, after `warmup`."""
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def copy_rate(device: torch.device, nbytes: int, repeats: int) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    seconds = timed(lambda: dst.copy_(src), device, repeats)
    return 2 * nbytes / seconds


def gemm_rate(device: torch.device, n: int, dtype: torch.dtype, repeats: int) -> float:
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    seconds = timed(lambda: a @ b, device, repeats)
    return 2 * n ** 3 / seconds


def build_model(shape: str, device: torch.device, dtype: torch.dtype, max_len: int):
    from transformers import AutoModelForCausalLM, LlamaConfig
    config = LlamaConfig(**SHAPES[shape], max_position_embeddings=max_len)
    torch.manual_seed(SEED)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def linear_params(c: dict) -> int:
    """Weights of every decoder layer's matmuls."""
    return c["num_hidden_layers"] * layer_matmul_weights(c)


def weight_bytes_read(c: dict, itemsize: int) -> int:
    """What a decode step reads of the weights: the layers' matmuls, the LM head, the
    norms (the embedding lookup reads a row per sequence: left out)."""
    h = c["hidden_size"]
    return itemsize * (linear_params(c) + c["vocab_size"] * h + (2 * c["num_hidden_layers"] + 1) * h)


def kv_bytes(c: dict, tokens: int, itemsize: int) -> int:
    return tokens * c["num_hidden_layers"] * 2 * c["num_key_value_heads"] * head_dim(c) * itemsize


def _release(runner, pool) -> None:
    """Give a case's pool (and graphs captured over it) back to the device."""
    runner.drop_graphs()
    pool.close()
    if runner.device.type == "cuda":
        torch.cuda.empty_cache()


def decode_case(runner, batch: int, context: int, repeats: int) -> float:
    """Seconds of one decode step of `batch` sequences, each over `context` cached tokens."""
    from services.engine.model.kv_cache import KVPoolMemory
    from services.engine.model.runner import ForwardBatch
    width = context // BLOCK_SIZE + 1
    pool = KVPoolMemory.allocate(runner.layout(batch * width, BLOCK_SIZE), device=str(runner.device))
    pool.tensor.normal_()
    g = torch.Generator().manual_seed(batch + context)
    tokens = torch.randint(0, runner.vocab_size, (batch,), generator=g).tolist()
    tables = [list(range(i * width, (i + 1) * width)) for i in range(batch)]
    step = ForwardBatch(decode_tokens=tokens, decode_positions=[context] * batch, decode_tables=tables,
                        sample_rows=list(range(batch)))
    try:
        return timed(lambda: runner.execute(pool, step).argmax(-1).tolist(), runner.device, repeats)
    finally:
        _release(runner, pool)


def engine_case(runner, batch: int, context: int, steps: int, async_scheduling: bool, repeats: int,
                speculation: str | None = None, stats: dict | None = None) -> float:
    """Output tokens/s of the engine core decoding `batch` greedy sequences `steps`
    tokens each, over `context` cached tokens apiece (random KV, as a prefill worker
    would have handed it over). `speculation`: a --speculative-config, whose drafts'
    totals go into `stats`."""
    from services.engine.core.block_manager import BlockManager
    from services.engine.core.block_pool import BlockPool
    from services.engine.engine import LLMEngine
    from services.engine.model.kv_cache import KVPoolMemory
    from services.engine.core.sampling import SamplingParams
    from services.engine.core.scheduler import Scheduler, SchedulerConfig
    from services.engine.core.sequence import Sequence
    num_blocks = batch * ((context + steps) // BLOCK_SIZE + 1)
    pool = KVPoolMemory.allocate(runner.layout(num_blocks, BLOCK_SIZE), device=str(runner.device))
    pool.tensor.normal_()
    blocks = BlockManager(BlockPool(num_blocks, BLOCK_SIZE))
    speculator = None
    if speculation:
        from services.engine.core.speculation import SpeculativeConfig, Speculator
        speculator = Speculator(SpeculativeConfig.parse(speculation))
    engine = LLMEngine(runner, pool, Scheduler(blocks, SchedulerConfig(max_num_seqs=batch,
                                                                       max_num_batched_tokens=max(batch, 256)),
                                               speculator),
                       async_scheduling=async_scheduling)
    g = torch.Generator().manual_seed(batch)
    params = SamplingParams(max_tokens=steps + 1, temperature=0, ignore_eos=True)

    def run() -> float:
        for i in range(batch):
            prompt = torch.randint(3, runner.vocab_size, (context + 1,), generator=g).tolist()
            seq = Sequence(f"s{i}", prompt, context, params, frozenset())
            engine.scheduler.reserve(seq.request_id, context, float("inf"))      # as a handoff's blocks
            engine.add_prefilled(seq)
        _sync(runner.device)
        t0 = time.perf_counter()
        while engine.has_work():
            engine.step()
        _sync(runner.device)
        return time.perf_counter() - t0
    try:
        run()                                   # the graphs are captured over this pool here
        rate = batch * steps / statistics.median(run() for _ in range(repeats))
        if speculator is not None and stats is not None:
            st = speculator.stats
            stats.update(drafts=st.drafts, draft_tokens=st.draft_tokens, accepted_tokens=st.accepted_tokens)
        return rate
    finally:
        _release(runner, pool)


def host_syncs(runner, batch: int, context: int, steps: int) -> dict:
    """Calls that made the host wait for the device while the async engine stepped, under
    torch's sync debug mode ("warn": each such call is a warning from the Python line that
    made it), with CUDA graphs and eagerly: greedy, seeded top-p, min_tokens, logit_bias
    and logprobs rows handed over prefilled, and a prompt computed here with prompt
    logprobs and a second choice (a block copy). {path: count, path_first: "file:line"}."""
    from services.engine.core.block_manager import BlockManager
    from services.engine.core.block_pool import BlockPool
    from services.engine.engine import LLMEngine
    from services.engine.model.kv_cache import KVPoolMemory
    from services.engine.core.sampling import SamplingParams
    from services.engine.core.scheduler import Scheduler, SchedulerConfig
    from services.engine.core.sequence import Sequence
    if runner.device.type != "cuda":
        return {"skipped": "no CUDA device"}
    kinds = [dict(temperature=0), dict(temperature=0.8, top_p=0.9, seed=7), dict(temperature=0, min_tokens=steps),
             dict(temperature=0, logit_bias=((5, 3.0), (9, -100.0))), dict(temperature=0.7, logprobs=2, seed=3)]
    g = torch.Generator().manual_seed(batch)
    found, sizes = {}, runner.graph_sizes
    for path in (["graphs"] if sizes else []) + ["eager"]:
        runner.graph_sizes = sizes if path == "graphs" else []
        num_blocks = (batch + 3) * ((context + steps) // BLOCK_SIZE + 2)
        pool = KVPoolMemory.allocate(runner.layout(num_blocks, BLOCK_SIZE), device=str(runner.device))
        pool.tensor.normal_()
        blocks = BlockManager(BlockPool(num_blocks, BLOCK_SIZE))
        engine = LLMEngine(runner, pool, Scheduler(blocks, SchedulerConfig(
            max_num_seqs=batch + 2, max_num_batched_tokens=max(batch + 2, 256))), async_scheduling=True)
        for i in range(batch):
            prompt = torch.randint(3, runner.vocab_size, (context + 1,), generator=g).tolist()
            seq = Sequence(f"s{i}", prompt, context, SamplingParams(max_tokens=steps, **kinds[i % len(kinds)]),
                           frozenset({2}))
            engine.scheduler.reserve(seq.request_id, context, float("inf"))      # as a handoff's blocks
            engine.add_prefilled(seq)
        prompt = torch.randint(3, runner.vocab_size, (200,), generator=g).tolist()
        params = SamplingParams(max_tokens=steps, temperature=0, prompt_logprobs=1, logprobs=1)
        engine.add(Sequence("p", prompt, len(prompt), params, frozenset(),
                            forks=[Sequence("p#1", [], len(prompt), params, frozenset())]))
        runner.capture_graphs(pool)             # capturing synchronizes: not part of a step
        _sync(runner.device)
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    while engine.has_work():
                        engine.step()
                finally:
                    torch.cuda.set_sync_debug_mode("default")
        finally:
            runner.graph_sizes = sizes
            _release(runner, pool)
        syncs = [w for w in caught if "synchronizing" in str(w.message)]
        found[path] = len(syncs)
        if syncs:
            found[f"{path}_first"] = f"{syncs[0].filename}:{syncs[0].lineno}"
    return found


def prefill_case(runner, tokens: int, repeats: int) -> float:
    from services.engine.model.kv_cache import KVPoolMemory
    width = tokens // BLOCK_SIZE + 1
    pool = KVPoolMemory.allocate(runner.layout(width, BLOCK_SIZE), device=str(runner.device))
    g = torch.Generator().manual_seed(tokens)
    ids = torch.randint(0, runner.vocab_size, (tokens,), generator=g).tolist()
    try:
        return timed(lambda: runner.prefill(pool, ids, list(range(width))).argmax().item(), runner.device, repeats,
                     warmup=1)
    finally:
        _release(runner, pool)


def attention_case(runner, batch: int, context: int, repeats: int) -> dict:
    """One layer's decode attention, Triton paged kernel against torch's gather path."""
    from services.engine.kernels import gpu_kernels
    from services.engine.model.attention import Workspace, decode_attention
    c = runner.config
    dim = runner.head_dim
    width = context // BLOCK_SIZE + 1
    dev = runner.device
    kv = torch.randn(2, batch * width, BLOCK_SIZE, runner.num_kv_heads, dim, dtype=runner.model.dtype, device=dev)
    q = torch.randn(batch, c.num_attention_heads, dim, dtype=kv.dtype, device=dev)
    table = torch.arange(batch * width, device=dev).view(batch, width)
    lens = torch.full((batch,), context + 1, dtype=torch.int32, device=dev)
    mask = torch.arange(width * BLOCK_SIZE, device=dev)[None, :] <= context
    mask = mask.expand(batch, -1)
    scratch, ws = gpu_kernels.DecodeScratch(), Workspace()
    splits = gpu_kernels.splits_for(batch, runner.num_kv_heads)
    out = {}
    if gpu_kernels.available() and dev.type == "cuda":
        t32 = table.int()
        out["triton_s"] = timed(lambda: gpu_kernels.paged_decode(q, kv, t32, lens, dim ** -0.5, splits, scratch),
                                dev, repeats)
        out.update(verify_case(runner, kv, table, context, repeats))
    out["torch_gather_s"] = timed(lambda: decode_attention(q, kv, table, mask, dim ** -0.5, ws), dev, repeats)
    out["kv_bytes"] = kv_bytes({"hidden_size": dim * c.num_attention_heads,
                                "num_attention_heads": c.num_attention_heads, "num_hidden_layers": 1,
                                "num_key_value_heads": runner.num_kv_heads}, batch * (context + 1), kv.element_size())
    return out


def verify_case(runner, kv: torch.Tensor, table: torch.Tensor, context: int, repeats: int,
                rows: int = VERIFY_ROWS) -> dict:
    """One layer's attention in a speculative step: each sequence's `rows` next
    positions (k drafts and the token before them), attended in groups
    (gpu_kernels.decode_groups) and each row alone, over the same blocks."""
    import numpy as np
    from services.engine.kernels import gpu_kernels
    batch, width = table.shape
    context = min(context, width * BLOCK_SIZE - rows)
    dim, heads = runner.head_dim, runner.config.num_attention_heads
    q = torch.randn(batch * rows, heads, dim, dtype=kv.dtype, device=kv.device)
    tables = table.int().repeat_interleave(rows, 0)
    lens = torch.arange(context + 1, context + 1 + rows, dtype=torch.int32).repeat(batch)
    groups = gpu_kernels.decode_groups(lens.numpy().astype(np.int64) - 1, tables.cpu().numpy(),
                                       (lens.numpy() - 1) // BLOCK_SIZE + 1,
                                       gpu_kernels.rows_per_program(heads // runner.num_kv_heads))
    lens, groups = lens.to(kv.device), torch.from_numpy(groups).to(kv.device)
    splits = gpu_kernels.splits_for(batch * rows, runner.num_kv_heads)
    scratch = gpu_kernels.DecodeScratch()
    out = {"verify_rows": rows}
    for name, g in (("grouped", groups), ("alone", None)):
        out[f"triton_verify_{name}_s"] = timed(
            lambda: gpu_kernels.paged_decode(q, kv, tables, lens, dim ** -0.5, splits, scratch, groups=g),
            kv.device, repeats)
    return out


def sweep_attention(device: torch.device, quick: bool, log) -> list[dict]:
    """The split kernel's tile, warps, stages and split target, timed on one 8B-shaped
    layer (32 query heads, 8 KV heads of 128) at several batch sizes and contexts."""
    from services.engine.kernels import gpu_kernels as gk
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    heads, kv_heads, dim = (32, 8, 128) if not quick else (8, 2, 32)
    cases = ((64, 2048), (128, 2048), (16, 8192), (1, 8192)) if not quick else ((2, 64),)
    tilings = [gk.DecodeTiling(n, w, st, t) for n in (32, 64, 128) for w in (4, 8) for st in (2, 3)
               for t in (1024, 4096)]
    if quick:
        tilings = tilings[:2]
    rows = []
    for batch, context in cases:
        width = context // BLOCK_SIZE + 1
        kv = torch.randn(2, batch * width, BLOCK_SIZE, kv_heads, dim, dtype=dtype, device=device)
        q = torch.randn(batch, heads, dim, dtype=dtype, device=device)
        table = torch.arange(batch * width, device=device, dtype=torch.int32).view(batch, width)
        lens = torch.full((batch,), context + 1, dtype=torch.int32, device=device)
        nbytes = 2 * batch * (context + 1) * kv_heads * dim * kv.element_size()
        scratch = gk.DecodeScratch()
        for tiling in tilings:
            splits = gk.splits_for(batch, kv_heads, tiling)
            seconds = timed(lambda: gk.paged_decode(q, kv, table, lens, dim ** -0.5, splits, scratch, tiling=tiling),
                            device, 3 if quick else 20)
            rows.append({"batch": batch, "context": context, "block_n": tiling.block_n, "warps": tiling.warps,
                         "stages": tiling.stages, "target_programs": tiling.target_programs, "us": seconds * 1e6,
                         "gbps": nbytes / seconds / 1e9})
            log(f"sweep {rows[-1]}")
        del kv
    return rows


def speed(shape: str, device: torch.device, quick: bool, copy_bps: float, gemm_flops: float, log) -> dict:
    from services.engine.model.runner import ModelRunner
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    c = dict(SHAPES[shape])
    contexts = (64, 256) if quick else CONTEXTS
    batches = (1, 4) if quick else BATCHES
    prompts = (64, 256) if quick else PROMPTS
    repeats = 3 if quick else 10
    max_len = max(max(contexts), max(prompts)) + BLOCK_SIZE
    model = build_model(shape, device, dtype, max_len)
    runner = ModelRunner(Path(f"random-{shape}"), "bfloat16" if dtype == torch.bfloat16 else "float32",
                         str(device), model=model, max_model_len=max_len, max_batch=max(batches))
    item = dtype.itemsize
    result = {"shape": shape, "config": c, "runner": runner.describe(), "decode": [], "prefill": []}
    log(f"{shape}: {runner.describe()}")
    free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else 1 << 62
    for batch in batches:
        for context in contexts:
            kv = kv_bytes(c, batch * (context + 1), item)
            row = {"batch": batch, "context": context, "kv_bytes": kv}
            if kv > 0.85 * free:
                row["skipped"] = f"KV {kv / 2**30:.0f} GiB > 85 % of the {free / 2**30:.0f} GiB free"
            else:
                seconds = decode_case(runner, batch, context, repeats)
                moved = weight_bytes_read(c, item) + kv
                row.update(step_ms=seconds * 1e3, bytes=moved, roofline_ms=moved / copy_bps * 1e3,
                           roofline_pct=100 * moved / copy_bps / seconds, tokens_per_s=batch / seconds)
            result["decode"].append(row)
            log(f"{shape} decode {row}")
    if runner.graph_sizes:
        batch, context = (64, 2048) if not quick else (4, 256)
        sizes, runner.graph_sizes = runner.graph_sizes, []
        try:
            seconds = decode_case(runner, batch, context, repeats)
        finally:
            runner.graph_sizes = sizes
        moved = weight_bytes_read(c, item) + kv_bytes(c, batch * (context + 1), item)
        result["eager"] = {"batch": batch, "context": context, "step_ms": seconds * 1e3,
                           "roofline_pct": 100 * moved / copy_bps / seconds}
        log(f"{shape} eager {result['eager']}")
    batch, context = (64, 2048) if not quick else (4, 256)
    steps = 8 if quick else 32
    rates = [engine_case(runner, batch, context, steps, overlap, max(2, repeats // 3)) for overlap in (False, True)]
    result["engine"] = {"batch": batch, "context": context, "steps": steps, "sync_tok_s": rates[0],
                        "async_tok_s": rates[1], "async_ratio": rates[1] / rates[0]}
    log(f"{shape} engine {result['engine']}")
    # Speculation (ngram, adaptive), async as a GPU decode worker runs it, at one sequence
    # and at the batch above, against the same without drafts: the adaptive cut must
    # never make a step slower (a random model's greedy text repeats itself, so drafts
    # are found; the acceptance says how many were kept).
    result["speculation"] = []
    for n in (1, batch):
        plain = rates[1] if n == batch else engine_case(runner, n, context, steps, True, max(2, repeats // 3))
        seen: dict = {}
        drafted = engine_case(runner, n, context, steps, True, max(2, repeats // 3), SPECULATION, seen)
        result["speculation"].append({"batch": n, "context": context, "off_tok_s": plain, "ngram_tok_s": drafted,
                                      "ratio": drafted / plain, **seen})
        log(f"{shape} speculation {result['speculation'][-1]}")
    result["host_syncs"] = host_syncs(runner, 16 if not quick else 4, context, steps)
    log(f"{shape} host syncs in async steps {result['host_syncs']}")
    result["attention"] = {"batch": batch, "context": context, **attention_case(runner, batch, context, repeats)}
    log(f"{shape} attention {result['attention']}")
    for tokens in prompts:
        seconds = prefill_case(runner, tokens, max(3, repeats // 3))
        flops = prefill_flops(c, tokens)
        row = {"tokens": tokens, "ms": seconds * 1e3, "flops": flops, "tflops": flops / seconds / 1e12,
               "gemm_pct": 100 * flops / gemm_flops / seconds}
        result["prefill"].append(row)
        log(f"{shape} prefill {row}")
    del runner, model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def describe(device: torch.device) -> str:
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        return f"{p.name}, {p.total_memory / 2**30:.0f} GiB, CUDA {torch.version.cuda}, torch {torch.__version__}"
    from services.engine.model.hardware import cpu_kind
    return f"{cpu_kind()} CPU, torch {torch.__version__}"


def table(results: dict) -> str:
    lines = [f"device: {results['device']}",
             f"copy rate {results['copy_gbps']:.0f} GB/s (read + written), bf16 GEMM {results['gemm_tflops']:.0f} "
             "TFLOP/s"]
    for r in results["models"]:
        lines.append(f"\n{r['shape']}: {r['runner']}")
        lines.append("| batch | context | step ms | roofline ms | % of the memory roofline | tok/s |")
        lines.append("|---|---|---|---|---|---|")
        for d in r["decode"]:
            if "skipped" in d:
                lines.append(f"| {d['batch']} | {d['context']} | skipped: {d['skipped']} | | | |")
            else:
                lines.append(f"| {d['batch']} | {d['context']} | {d['step_ms']:.2f} | {d['roofline_ms']:.2f} | "
                             f"{d['roofline_pct']:.0f} % | {d['tokens_per_s']:.0f} |")
        if "eager" in r:
            e = r["eager"]
            lines.append(f"eager (no CUDA graph), batch {e['batch']}, context {e['context']}: {e['step_ms']:.2f} ms "
                         f"= {e['roofline_pct']:.0f} % of the memory roofline")
        e = r["engine"]
        lines.append(f"engine core, {e['batch']} sequences over {e['context']} tokens, {e['steps']} steps: "
                     f"{e['sync_tok_s']:.0f} output tok/s, with async scheduling {e['async_tok_s']:.0f} "
                     f"({e['async_ratio']:.2f}x)")
        for sp in r.get("speculation", ()):
            lines.append(f"engine core with ngram drafts (async), {sp['batch']} sequences: {sp['ngram_tok_s']:.0f} "
                         f"output tok/s against {sp['off_tok_s']:.0f} without ({sp['ratio']:.2f}x), "
                         f"{sp.get('accepted_tokens', 0)} of {sp.get('draft_tokens', 0)} drafted tokens kept")
        lines.append(f"calls that made the host wait in the async engine's steps (expected: none): "
                     + ", ".join(f"{k} {v}" for k, v in r["host_syncs"].items()))
        a = r["attention"]
        lines.append(f"one layer's decode attention, batch {a['batch']}, context {a['context']}: "
                     + ", ".join(f"{k[:-2]} {v * 1e3:.3f} ms" for k, v in a.items() if k.endswith("_s")))
        lines.append("| prompt tokens | ms | TFLOP/s | % of the GEMM rate |")
        lines.append("|---|---|---|---|")
        for p in r["prefill"]:
            lines.append(f"| {p['tokens']} | {p['ms']:.1f} | {p['tflops']:.0f} | {p['gemm_pct']:.0f} % |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.gpu_speed", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--shapes", default="1b,8b", help="comma-separated: 1b, 8b (tiny: for --device cpu)")
    p.add_argument("--quick", action="store_true", help="small batches, contexts and prompts (the script's test)")
    p.add_argument("--sweep", action="store_true", help="also time the decode kernel's tile choices first")
    p.add_argument("--json", default=None, metavar="OUT.json")
    a = p.parse_args(argv)
    device = torch.device(a.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu_speed: no CUDA device here; --device cpu --quick --shapes tiny tests the script", file=sys.stderr)
        return 2

    def log(msg: str) -> None:
        print(msg, flush=True)
    big = device.type == "cuda" and not a.quick
    results = {"device": describe(device), "when": time.strftime("%Y-%m-%d %H:%M:%S"),
               "copy_gbps": copy_rate(device, (1 << 30) if big else (1 << 24), 10) / 1e9,
               "gemm_tflops": gemm_rate(device, 8192 if big else 256,
                                        torch.bfloat16 if device.type == "cuda" else torch.float32, 10) / 1e12,
               "models": []}
    log(f"{results['device']}: copy {results['copy_gbps']:.0f} GB/s, GEMM {results['gemm_tflops']:.1f} TFLOP/s")
    if a.sweep:
        results["sweep"] = sweep_attention(device, a.quick, log)
        best = {}
        for r in results["sweep"]:
            key = (r["batch"], r["context"])
            if key not in best or r["us"] < best[key]["us"]:
                best[key] = r
        for r in best.values():
            log(f"best at batch {r['batch']}, context {r['context']}: {r}")
    for shape in a.shapes.split(","):
        results["models"].append(speed(shape, device, a.quick, results["copy_gbps"] * 1e9,
                                       results["gemm_tflops"] * 1e12, log))
        if a.json:
            Path(a.json).write_text(json.dumps(results, indent=1) + "\n")
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
