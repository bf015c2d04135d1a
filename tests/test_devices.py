"""Devices as GPU users expect, decided on the host: one GPU per worker in `pdserve up`,
the KV pool sized from the card's free memory, models by Hub id from the local Hugging
Face cache. No GPU is here: what needs one is in its own test, which says so and skips."""
from __future__ import annotations

import shutil

import pytest
import torch

from services.engine.model.kv_cache import CPU_KV_TOKENS, tokens_for_memory
from services.engine.text.model_store import resolve_model
from services.local_processes import assign_gpus, visible_devices

GiB = 2**30


def test_each_worker_gets_gpus_of_its_own_and_too_few_is_a_clear_error():
    held: list[tuple[int, ...]] = []
    for _ in range(4):
        held.append(assign_gpus(held, 4, 1, share=False))
    assert held == [(0,), (1,), (2,), (3,)]
    with pytest.raises(RuntimeError, match="5 workers at 1 GPU.*need 5 GPUs; this machine has 4.*--share-gpus"):
        assign_gpus(held, 4, 1, share=False)
    assert assign_gpus(held, 4, 1, share=True) == (0,)                   # the least used
    assert assign_gpus([(0, 1)], 4, 2, share=False) == (2, 3)
    with pytest.raises(RuntimeError, match="has 1 GPU"):
        assign_gpus([], 1, 2, share=True)
    assert assign_gpus([(1,)], 2, 1, share=False) == (0,)                # a freed GPU is handed out again


def test_a_workers_gpus_are_among_those_up_was_given():
    """`up` counts GPUs as torch does, under its own CUDA_VISIBLE_DEVICES (a Slurm job's
    4,5,6,7, or UUIDs): a worker handed ordinals 0 and 1 gets that list's first two."""
    assert visible_devices((0, 1), None) == "0,1"
    assert visible_devices((0, 1), "4,5,6,7") == "4,5"
    assert visible_devices((3,), "4, 5,6,7") == "7"
    uuids = "GPU-5a1c2f3e-0000-0000-0000-000000000001,GPU-5a1c2f3e-0000-0000-0000-000000000002"
    assert visible_devices((1,), uuids) == "GPU-5a1c2f3e-0000-0000-0000-000000000002"


def test_the_kv_pool_is_what_the_memory_share_leaves():
    # an 80 GiB card, 0.9 of it ours, 16 GiB in use (weights), 2 GiB of activations
    tokens = tokens_for_memory(free=64 * GiB, total=80 * GiB, utilization=0.9, bytes_per_token=128 * 1024,
                               reserve=2 * GiB)
    assert tokens == (int(80 * GiB * 0.9) - 16 * GiB - 2 * GiB) // (128 * 1024)
    # a second worker sharing the card: the first one's 30 GiB do not come off its share
    shared = tokens_for_memory(free=34 * GiB, total=80 * GiB, utilization=0.4, bytes_per_token=128 * 1024,
                               reserve=GiB, own=16 * GiB)
    assert shared == (int(80 * GiB * 0.4) - 16 * GiB - GiB) // (128 * 1024)
    assert tokens_for_memory(free=10 * GiB, total=80 * GiB, utilization=0.4, bytes_per_token=128 * 1024,
                             reserve=GiB, own=16 * GiB) == 9 * GiB // (128 * 1024)     # never more than is free
    with pytest.raises(ValueError, match="no memory is left for the KV cache.*--gpu-memory-utilization"):
        tokens_for_memory(free=7 * GiB, total=80 * GiB, utilization=0.9, bytes_per_token=128 * 1024, reserve=GiB)


def test_the_kv_pool_on_a_cpu(model_dir):
    from services.engine.model.runner import ModelRunner
    runner = ModelRunner(model_dir, "float32", "cpu", attention="torch")
    assert runner.kv_tokens(0, 0.9, 512, 64) == CPU_KV_TOKENS
    assert runner.kv_tokens(4096, 0.9, 512, 64) == 4096
    assert 0 < runner.activation_bytes(512, 64) < GiB


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_weights_load_onto_it_and_the_pool_fills_the_memory_share(model_dir):
    from services.engine.model.runner import ModelRunner
    runner = ModelRunner(model_dir, "bfloat16", "cuda", attention="torch")
    assert next(runner.model.parameters()).device.type == "cuda"
    free, total = torch.cuda.mem_get_info()
    tokens = runner.kv_tokens(0, 0.5, 2048, 64)
    per_token = 2 * runner.num_layers * runner.num_kv_heads * runner.head_dim * 2
    assert 0 < tokens * per_token <= total * 0.5


def _fake_hub_cache(root, model_dir, repo="acme/tiny-chat", commit="0123456789abcdef0123456789abcdef01234567"):
    """The local Hugging Face cache's layout, holding `model_dir` as `repo`'s main."""
    repo_dir = root / f"models--{repo.replace('/', '--')}"
    snapshot = repo_dir / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for f in model_dir.iterdir():
        if f.is_file():
            shutil.copy(f, snapshot / f.name)
    (repo_dir / "refs").mkdir()
    (repo_dir / "refs" / "main").write_text(commit)
    return snapshot


def test_a_hub_id_comes_from_the_local_cache(model_dir, tmp_path):
    snapshot = _fake_hub_cache(tmp_path, model_dir)
    assert resolve_model("acme/tiny-chat", hub_cache=str(tmp_path)) == snapshot
    assert resolve_model("acme/tiny-chat", revision="0123456789abcdef0123456789abcdef01234567",
                         hub_cache=str(tmp_path)) == snapshot


def test_a_model_nowhere_is_a_clear_error(tmp_path, monkeypatch):
    import huggingface_hub.constants
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)      # never ask the network here
    with pytest.raises(FileNotFoundError, match="acme/absent.*not in the local Hugging Face cache"):
        resolve_model("acme/absent", hub_cache=str(tmp_path))
    with pytest.raises(FileNotFoundError, match="no config.json"):
        resolve_model(str(tmp_path))
    with pytest.raises(FileNotFoundError, match="no config.json"):
        resolve_model("a/b/c")


def test_a_chunk_over_a_cached_prefix_bounds_its_scores_on_a_gpu():
    """Where SDPA materialises a chunk's scores (float32 on a GPU), the chunk goes in
    blocks of query rows whose scores fit attention.PREFIX_SCORES_BYTES: an 8B model's 8k
    chunk over a 32k context needed ~34 GB in one call. The blocks give what one masked
    call gives (here on the CPU), and the pool's sizing counts their scratch."""
    from services.engine.model.attention import PREFIX_SCORES_BYTES, attend_over_prefix, prefix_rows
    heads, kv_heads, dim = 32, 8, 128
    rows = prefix_rows(heads, 32768, torch.float32, dim)
    assert rows == 32 and heads * rows * 32768 * 4 * 2 <= PREFIX_SCORES_BYTES
    assert prefix_rows(heads, 32768, torch.bfloat16, dim) is None      # flash attention: nothing materialised
    assert prefix_rows(heads, 10**9, torch.float32, dim) == 1
    gen = torch.Generator().manual_seed(0)
    prefix, n = 37, 29
    q = torch.randn(1, heads, n, dim, generator=gen)
    k, v = (torch.randn(1, kv_heads, prefix + n, dim, generator=gen) for _ in range(2))
    mask = torch.ones(n, prefix + n, dtype=torch.bool).tril(diagonal=prefix)
    whole = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.1, enable_gqa=True)
    for block in (None, 1, 4, 29):
        assert torch.allclose(attend_over_prefix(q, k, v, prefix, 0.1, block), whole, atol=1e-5), block
    # no prefix (a prompt's first chunk, blocked the same way on a GPU in float32)
    causal = torch.nn.functional.scaled_dot_product_attention(q, k[:, :, :n], v[:, :, :n], is_causal=True,
                                                              scale=0.1, enable_gqa=True)
    for block in (1, 4, 29):
        assert torch.allclose(attend_over_prefix(q, k[:, :, :n], v[:, :, :n], 0, 0.1, block), causal, atol=1e-5)


def test_the_pool_sizing_counts_the_prefix_scores_and_a_steps_prompt_logprobs(model_dir):
    from services.engine.core.scheduler import PROMPT_LOGPROB_ROWS
    from services.engine.model.attention import PREFIX_SCORES_BYTES
    from services.engine.model.runner import ModelRunner
    runner = ModelRunner(model_dir, "float32", "cpu", attention="torch")
    c = runner.config
    per_token = 2 * (4 * c.hidden_size + 3 * c.intermediate_size) * 4
    logprobs = PROMPT_LOGPROB_ROWS * runner.vocab_size * (4 + 8)       # the head's output, float32, log-softmax
    assert runner.activation_bytes(512, 64) == (512 * per_token + 64 * runner.vocab_size * 8 + logprobs
                                                + PREFIX_SCORES_BYTES)


def test_a_draft_model_and_the_decode_graphs_come_off_the_kv_budget(monkeypatch):
    """A draft model keeps a KV pool as long as the target's: on a card, the target's pool
    is sized with the draft's bytes per token and activations beside its own (the draft's
    weights, loaded first, are in what the worker holds); the captured decode graphs'
    logits come off it too. Memory torch's allocator holds cached but unused (the weights'
    copies from before their fusion) is given back first: it is neither the worker's
    nor lost. The card is a double here: device_memory, memory_reserved, empty_cache."""
    from services.engine.model import runner as runner_module
    from services.engine.model.runner import ModelRunner
    cached = [7 * GiB]
    monkeypatch.setattr(runner_module, "device_memory", lambda device: (60 * GiB - cached[0], 80 * GiB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 20 * GiB + cached[0])
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: cached.__setitem__(0, 0))

    class Model:
        device = torch.device("cuda")

        graph_sizes: list[int] = []
        vocab_size = 32000

        def __init__(self, per_token: int, activations: int) -> None:
            self.per_token, self.activations = per_token, activations

        def kv_bytes_per_token(self) -> int:
            return self.per_token

        def activation_bytes(self, tokens: int, rows: int) -> int:
            return self.activations

    target, draft = Model(128 * 1024, 2 * GiB), Model(32 * 1024, GiB // 2)
    share = int(80 * GiB * 0.9) - 20 * GiB
    assert ModelRunner.kv_tokens(target, 0, 0.9, 2048, 64) == (share - 2 * GiB) // (128 * 1024)
    assert ModelRunner.kv_tokens(target, 0, 0.9, 2048, 64, draft) == (share - 2 * GiB - GiB // 2) // (160 * 1024)
    # Captured decode graphs each keep their logits (float32, rows x vocab) in their pool.
    target.graph_sizes = [1, 2, 4, 8, 16, 32, 64]
    assert ModelRunner.kv_tokens(target, 0, 0.9, 2048, 64) == (share - 2 * GiB - 127 * 32000 * 4) // (128 * 1024)


def test_a_prefill_workers_prefix_cache_shrinks_to_its_share_of_the_card():
    """A prefill worker's pool (its working blocks and the prefix cache) comes out of
    --gpu-memory-utilization's share on a GPU: the cache shrinks to what is left, and no
    room for the working blocks is an error at start. The card is a double here."""
    from types import SimpleNamespace

    from services.prefill.worker import pool_blocks_that_fit

    class Runner:
        def __init__(self, device: str) -> None:
            self.device = torch.device(device)

        def kv_tokens(self, requested: int, utilization: float, batched_tokens: int, rows: int) -> int:
            return 1000 * 16                    # what the card's share leaves after weights and activations

    settings = SimpleNamespace(block_size=16, gpu_memory_utilization=0.5)
    config = SimpleNamespace(max_num_batched_tokens=8192, max_num_seqs=64)
    gpu = Runner("cuda")
    assert pool_blocks_that_fit(gpu, settings, config, working=600, cached=300) == 300
    assert pool_blocks_that_fit(gpu, settings, config, working=600, cached=1024) == 400
    with pytest.raises(ValueError, match="needs 19200 tokens.*room for 16000"):
        pool_blocks_that_fit(gpu, settings, config, working=1200, cached=0)
    assert pool_blocks_that_fit(Runner("cpu"), settings, config, working=1200, cached=1024) == 1024


def test_a_model_too_large_for_its_cards_is_refused_before_it_loads(model_dir, monkeypatch):
    """On a GPU, a rank's share of the weights alone past what --gpu-memory-utilization
    allows is said at once, with the tensor-parallel size that would leave room, instead
    of after minutes of loading (as "the KV pool cannot hold one context"). The card is
    a double: 256 MiB, and the default model's ~270 MB of bfloat16 weights."""
    from services.common.settings import WorkerSettings
    from services.engine.text.model_store import checkpoint_parameters
    from services.worker import main
    monkeypatch.setattr(main, "pick_device", lambda requested: torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (200 * 2**20, 256 * 2**20))
    assert 130e6 < checkpoint_parameters(model_dir) < 140e6
    with pytest.raises(ValueError, match="--tensor-parallel-size 2 or more"):
        main.check_fits_the_card(model_dir, WorkerSettings(role="decode", device="cuda"))
    main.check_fits_the_card(model_dir, WorkerSettings(role="decode", device="cuda", tensor_parallel_size=2))
    main.check_fits_the_card(model_dir, WorkerSettings(role="decode", device="cuda", quantization="int8"))
