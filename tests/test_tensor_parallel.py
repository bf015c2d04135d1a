"""Tensor parallelism: a worker split over rank processes (gloo on this CPU), and KV
resharded between prefill and decode workers of different degrees.

- the split itself (which heads and features each rank keeps, which shapes are
  refused) and who writes which KV heads where (`head_writes`), as plain functions;
- KV bytes: a TP-1 pool written into TP-2 pools and back, through every backend, layer
  by layer as a prefill does, gathered over the ranks: bitwise what was sent;
- a TP-2 worker's ranks against one process: logits within 1e-4 (the all-reduce sums
  in another order), the same greedy tokens;
- through the cluster, float32 greedy against `model.generate`: TP 2 -> TP 2 by
  default; TP 1 -> 2 and 2 -> 1 (head slices, shm/auto and tcp), TP 2 -> 2 through tcp
  and NIXL, aggregated TP 2, and the real default model at TP 3 (9 heads, 3 KV heads)
  in `make test-slow`; and a killed rank under load, and the features TP must leave
  unchanged (slow).

The model for most of these is random-initialised with the default model's tokenizer,
shaped so its heads divide: 8 attention heads, 2 KV heads (replicated at TP 4).
NCCL and CUDA graphs with the all-reduce inside need GPUs: docs/gpu.md has the command.
"""
from __future__ import annotations

import os
import shutil
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch

from kv_transfer.backends import create_transport
from kv_transfer.base import HeadSlice, IncompatiblePeer, TransferError, head_writes, wait_for
from services.engine.model.kv_cache import KVLayout, KVPoolMemory
from services.engine.model.parallel import (TensorParallel, check_split, decode_batch, encode_batch,
                                            kv_head_ranges)
from services.engine.model.runner import ForwardBatch, PrefillSegment
from services.local_processes import child_pids
from tests.parity_cases import CASES, chat_body, generate_expected, grpc_generate
from tests.processes import start_cluster, stop_cluster


def shaped_model(path: Path, heads: int = 8, kv_heads: int = 2, layers: int = 3, tied: bool = True) -> Path:
    """A random-initialised Llama of the default model's vocabulary and tokenizer, with
    `heads` attention heads and `kv_heads` KV heads (weights large enough that greedy
    output varies from token to token); `tied`: the head is the embedding's weight."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from services.engine.text.model_store import ensure_default_model
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=49152, hidden_size=256, intermediate_size=512, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=4096,
                         initializer_range=0.1, tie_word_embeddings=tied, bos_token_id=1, eos_token_id=2,
                         pad_token_id=2)
    LlamaForCausalLM(config).save_pretrained(path)
    for f in ensure_default_model().iterdir():
        if "token" in f.name or f.suffix == ".jinja":
            shutil.copy(f, path / f.name)
    return path


@pytest.fixture(scope="module")
def shaped(tmp_path_factory) -> Path:
    return shaped_model(tmp_path_factory.mktemp("shaped"))


@pytest.fixture(scope="module")
def untied(tmp_path_factory) -> Path:
    """Its own head, as Llama-3-70B has."""
    return shaped_model(tmp_path_factory.mktemp("untied"), tied=False)


# ---- the split ----

def test_each_rank_keeps_its_heads_and_replicates_kv_heads_when_fewer_than_ranks():
    assert [TensorParallel(2, r).q_heads(8) for r in range(2)] == [range(0, 4), range(4, 8)]
    assert kv_head_ranges(2, 2) == [range(0, 1), range(1, 2)]
    assert kv_head_ranges(2, 4) == [range(0, 1), range(0, 1), range(1, 2), range(1, 2)]
    assert kv_head_ranges(3, 3) == [range(0, 1), range(1, 2), range(2, 3)]
    # a rank's query heads read exactly its KV heads (grouped-query attention)
    for size in (1, 2, 4, 8):
        for r in range(size):
            tp = TensorParallel(size, r)
            assert {h // 4 for h in tp.q_heads(8)} == set(tp.kv_heads(2))


def test_a_model_whose_heads_do_not_divide_is_refused_with_the_numbers(model_dir):
    from transformers import AutoConfig
    config = AutoConfig.from_pretrained(model_dir)          # 9 heads, 3 KV heads
    check_split(config, 3)
    with pytest.raises(ValueError, match="9 attention heads do not divide by 2"):
        check_split(config, 2)
    config.num_attention_heads, config.num_key_value_heads = 12, 3
    with pytest.raises(ValueError, match="3 KV heads neither divide by 4 nor divide it"):
        check_split(config, 4)


def test_the_step_plan_travels_as_integers():
    b = ForwardBatch(decode_tokens=[5, 6], decode_positions=[17, 3], decode_tables=[[4, 9], [1]],
                     prefill_tokens=[7, 8, 9], segments=[PrefillSegment(16, 3, [2, 3])], pending_rows=[1],
                     pending_sources=[0], sample_rows=[0, 1, 4], logprob_rows=[2, 3])
    again = decode_batch(encode_batch(b), ForwardBatch, PrefillSegment)
    for name in ("decode_tokens", "decode_positions", "decode_tables", "prefill_tokens", "segments",
                 "pending_rows", "pending_sources", "sample_rows", "logprob_rows"):
        assert getattr(again, name) == getattr(b, name), name


@pytest.mark.parametrize("ours,theirs", [
    ([range(0, 2)], [range(0, 1), range(1, 2)]),                     # prefill TP 1 -> decode TP 2
    ([range(0, 1), range(1, 2)], [range(0, 2)]),                     # TP 2 -> TP 1
    ([range(0, 1), range(1, 2)], [range(0, 1), range(1, 2)]),        # TP 2 -> TP 2: whole blocks
    ([range(0, 2)], kv_head_ranges(2, 4)),                           # TP 1 -> TP 4, heads replicated
    (kv_head_ranges(2, 4), [range(0, 2)]),                           # TP 4 (replicated) -> TP 1
    (kv_head_ranges(8, 4), kv_head_ranges(8, 2)),
])
def test_every_receiver_head_is_written_once_by_a_rank_that_holds_it(ours, theirs):
    writes = head_writes(ours, theirs)
    got: dict[tuple[int, int], int] = {}
    for p, d, hs in writes:
        hs = hs or HeadSlice(0, 0, len(theirs[d]))
        for i in range(hs.count):
            head = ours[p].start + hs.src + i
            assert theirs[d].start + hs.dst + i == head
            assert (d, head) not in got
            got[(d, head)] = p
    assert set(got) == {(d, h) for d, held in enumerate(theirs) for h in held}
    if ours == theirs:
        assert all(hs is None for _, _, hs in writes)


def test_a_receiver_head_nobody_holds_refuses_to_pair():
    with pytest.raises(IncompatiblePeer, match="head 1"):
        head_writes([range(0, 1)], [range(0, 2)])


# ---- KV bytes, resharded ----

LAYOUT = KVLayout(num_layers=3, num_blocks=12, block_size=4, num_kv_heads=2, head_dim=8, dtype="bfloat16")


def _pools(split: list[range], shared: bool, seed: int | None) -> list[KVPoolMemory]:
    pools = []
    for heads in split:
        pools.append(KVPoolMemory.allocate(KVLayout(**{**LAYOUT.__dict__, "num_kv_heads": len(heads)}),
                                           shared=shared, heads=heads))
    if seed is not None:                       # the model's KV, split as the ranks hold it
        whole = torch.randn(*LAYOUT.shape, generator=torch.Generator().manual_seed(seed)).to(LAYOUT.torch_dtype)
        for pool in pools:
            pool.tensor.copy_(whole[..., pool.heads.start:pool.heads.stop, :])
    return pools


def _gathered(pools: list[KVPoolMemory], blocks: list[int]) -> torch.Tensor:
    """The model's KV in `blocks`, its heads gathered from the pools that hold them."""
    out = torch.zeros(LAYOUT.num_layers, 2, len(blocks), LAYOUT.block_size, LAYOUT.num_kv_heads, LAYOUT.head_dim,
                      dtype=LAYOUT.torch_dtype)
    for pool in pools:
        out[..., pool.heads.start:pool.heads.stop, :] = pool.tensor[:, :, blocks]
    return out


@pytest.mark.parametrize("backend", ["shm", "tcp", "nixl", "fake"])
@pytest.mark.parametrize("writers,receivers", [(1, 2), (2, 1), (2, 2), (1, 4)],
                         ids=["tp1-to-tp2", "tp2-to-tp1", "tp2-to-tp2", "tp1-to-tp4-replicated"])
def test_resharded_kv_is_bitwise_what_the_writer_holds(backend, writers, receivers):
    if backend == "nixl":
        pytest.importorskip("nixl")
    from kv_transfer.fake import FakeFabric
    options = {"fabric": FakeFabric()} if backend == "fake" else {}
    ours, theirs = kv_head_ranges(2, writers), kv_head_ranges(2, receivers)
    sources = _pools(ours, shared=False, seed=3)
    targets = _pools(theirs, shared=backend == "shm", seed=None)
    opened = []
    try:
        receiving = []
        for pool in targets:
            t = create_transport(backend, **options)
            opened.append(t)
            receiving.append(t.register(pool, "hash"))
        src, dst = [0, 1, 2, 7], [5, 6, 9, 1]
        for p, pool in enumerate(sources):
            t = create_transport(backend, **options)
            opened.append(t)
            t.register(pool, "hash")
            xfers = []
            for _, d, heads in [w for w in head_writes(ours, theirs) if w[0] == p]:
                peer = t.connect(receiving[d], "hash")
                xfers += [t.write(peer, src, dst, range(layer, layer + 1), heads) for layer in range(3)]
            wait_for(t, xfers, time.monotonic() + 30)
        assert torch.equal(_gathered(targets, dst).view(torch.uint8), _gathered(sources, src).view(torch.uint8))
        untouched = [b for b in range(LAYOUT.num_blocks) if b not in dst]
        assert all(torch.count_nonzero(pool.tensor[:, :, untouched]) == 0 for pool in targets)
    finally:
        for t in opened:
            t.shutdown()
        for pool in sources + targets:
            pool.close()


def test_a_head_slice_outside_either_pool_is_refused():
    from kv_transfer.fake import FakeFabric
    fabric = FakeFabric()
    src, dst = _pools([range(0, 2)], False, 1)[0], _pools([range(1, 2)], False, None)[0]
    a, b = create_transport("fake", fabric=fabric), create_transport("fake", fabric=fabric)
    a.register(src, "h")
    peer = a.connect(b.register(dst, "h"), "h")
    with pytest.raises(TransferError, match="outside"):
        a.write(peer, [0], [0], heads=HeadSlice(1, 1, 1))
    with pytest.raises(TransferError, match="head slice"):
        a.write(peer, [0], [0])


# ---- a worker's ranks ----

def _ranks_against_one_process(model: Path, size: int) -> float:
    """Rank processes as a worker starts them and one process, the same steps through
    both: a prompt in two chunks, then decode steps of two sequences (one with a block
    copied, as a fork). The tokens must agree; returns the logits' largest difference."""
    from services.common.settings import WorkerSettings
    from services.engine.model.runner import ModelRunner
    from services.worker.ranks import start_ranks
    torch.set_num_threads(1)
    one = ModelRunner(model, "float32", "cpu")
    settings = WorkerSettings(role="decode", model=str(model), tensor_parallel_size=size, dtype="float32",
                              device="cpu", threads=1, kv_transport="tcp")
    ranks = start_ranks(settings, model)
    try:
        many = ModelRunner(model, "float32", "cpu", group=ranks.group)
        ranks.open_pools(64, 16, False, "h")
        pools = [KVPoolMemory.allocate(r.layout(64, 16)) for r in (one, many)]
        prompt = [(i * 7919) % 40000 + 100 for i in range(40)]
        steps, tokens = ([], []), ([], [])
        for k, (runner, pool) in enumerate(zip((one, many), pools)):
            runner.prefill(pool, prompt[:20], [0, 1, 2])
            logits = runner.prefill(pool, prompt[20:], [0, 1, 2], start=20)
            runner.copy_blocks(pool, [(1, 5)])           # the second sequence: blocks 0, 5 (a fork's copy)
            seqs = [[0, 1, 2], [0, 5, 6]]
            last = [int(logits.argmax())] * 2
            steps[k].append(logits[None])
            for i in range(6):
                logits = runner.decode(pool, last, [40 + i, 30 + i], seqs)
                steps[k].append(logits)
                last = logits.argmax(-1).tolist()
                tokens[k].append(last)
        assert tokens[0] == tokens[1]
        return max(float((a - b).abs().max()) for a, b in zip(*steps))
    finally:
        ranks.stop()


def test_a_rank_after_the_first_reads_only_its_slices_and_no_untied_head(untied, shaped):
    """Each weight's slice straight from the safetensors (the shapes a rank keeps), the
    head dropped on ranks after the first where it is not the embedding."""
    from transformers import AutoConfig

    from services.engine.model.parallel import NoHead, load_shard
    from services.engine.model.runner import ATTN_IMPL, _register_attention
    _register_attention()
    config = AutoConfig.from_pretrained(untied)
    one = load_shard(untied, config, TensorParallel(2, 1), torch.float32, torch.device("cpu"), lambda t: t, ATTN_IMPL)
    attn = one.model.layers[0].self_attn
    assert attn.q_proj.weight.shape == (4 * 32, 256) and attn.k_proj.weight.shape == (1 * 32, 256)
    assert attn.o_proj.weight.shape == (256, 4 * 32) and one.model.layers[0].mlp.down_proj.weight.shape == (256, 256)
    assert isinstance(one.lm_head, NoHead) and one.model.embed_tokens.weight.shape == (49152, 256)
    from safetensors import safe_open
    with safe_open(str(untied / "model.safetensors"), "pt") as f:
        whole = f.get_tensor("model.layers.0.self_attn.k_proj.weight")
    assert torch.equal(attn.k_proj.weight, whole[32:64])             # KV head 1 of 2
    zero = load_shard(untied, config, TensorParallel(2, 0), torch.float32, torch.device("cpu"), lambda t: t,
                      ATTN_IMPL)
    assert not isinstance(zero.lm_head, NoHead)
    tied = load_shard(shaped, AutoConfig.from_pretrained(shaped), TensorParallel(2, 1), torch.float32,
                      torch.device("cpu"), lambda t: t, ATTN_IMPL)
    assert tied.lm_head.weight is tied.model.embed_tokens.weight


@pytest.mark.slow       # the TP 2 cluster's test below checks the tokens by default
def test_tp2_ranks_give_tp1s_logits_within_1e4_and_its_tokens(untied):
    worst = _ranks_against_one_process(untied, 2)
    assert worst <= 1e-4, worst
    print(f"TP 2 vs TP 1: logits max |diff| {worst:.2e}")


@pytest.mark.slow
def test_the_default_models_tp3_ranks_give_tp1s_logits_within_1e4(model_dir):
    worst = _ranks_against_one_process(model_dir, 3)
    assert worst <= 1e-4, worst
    print(f"SmolLM2 TP 3 vs TP 1: logits max |diff| {worst:.2e}")


# ---- through the cluster ----

def _cluster_matches_generate(model: Path, *args: str, cases: int = len(CASES)) -> None:
    """`pdserve up` with `args` (tests calling it are marked `process`), the first
    `cases` parity cases through HTTP and two through gRPC against `generate`; no block
    left held."""
    expected = generate_expected(model)
    c = start_cluster("--model", str(model), "--threads", "1", *args)
    try:
        for case in CASES[:cases]:
            r = httpx.post(f"{c.http}/v1/chat/completions", json=chat_body(case), timeout=300)
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            assert choice["token_ids"] == expected[case.name].token_ids, case.name
            assert choice["message"]["content"] == expected[case.name].text, case.name
        for case in CASES[:2]:
            replies = grpc_generate(c.grpc, case)
            assert [t for r in replies for t in r.token_ids] == expected[case.name].token_ids, case.name
        route = httpx.post(f"{c.http}/v1/completions", json={"prompt": "ping", "max_tokens": 1},
                           timeout=60).headers.get("x-pdserve-route", "")
        assert ("decision=local" if "aggregated" in args else "decision=remote") in route, route
        stats = c.wait_idle()
        assert stats.info.free_blocks == stats.info.num_blocks
    finally:
        assert stop_cluster(c) == 0


@pytest.mark.process
def test_cluster_tp2_to_tp2_matches_generate(shaped):
    """Both pools split, through shared memory: the decode worker's ranks offer their
    pools and decode, the prefill worker's second rank writes its own heads. (Head
    slices between other degrees: the transport test above, and the slow ones below.)"""
    _cluster_matches_generate(shaped, "--prefill-tp", "2", "--decode-tp", "2", "--kv-transport", "shm", cases=3)


@pytest.mark.process
@pytest.mark.slow
@pytest.mark.parametrize("transport", ["auto", "tcp"])
@pytest.mark.parametrize("prefill_tp,decode_tp", [(1, 2), (2, 1)], ids=["tp1-to-tp2", "tp2-to-tp1"])
def test_cluster_of_other_degrees_matches_generate(shaped, prefill_tp, decode_tp, transport):
    _cluster_matches_generate(shaped, "--prefill-tp", str(prefill_tp), "--decode-tp", str(decode_tp),
                              "--kv-transport", transport)


@pytest.mark.process
@pytest.mark.slow
@pytest.mark.parametrize("transport", ["tcp", "nixl"])
def test_cluster_tp2_to_tp2_matches_generate_through_each_backend(shaped, transport):
    if transport == "nixl":
        pytest.importorskip("nixl")
    _cluster_matches_generate(shaped, "--prefill-tp", "2", "--decode-tp", "2", "--kv-transport", transport)


@pytest.mark.process
@pytest.mark.slow
def test_aggregated_tp2_matches_generate(shaped):
    _cluster_matches_generate(shaped, "--mode", "aggregated", "--tensor-parallel-size", "2")


@pytest.mark.process
@pytest.mark.slow
def test_the_default_model_at_tp3_matches_generate(model_dir):
    """SmolLM2's 9 heads and 3 KV heads split three ways, prefill TP 3 -> decode TP 1
    and the other way round in one cluster each."""
    _cluster_matches_generate(model_dir, "--prefill-tp", "3", "--decode-tp", "1")
    _cluster_matches_generate(model_dir, "--prefill-tp", "1", "--decode-tp", "3")


def _ranks_of(pid: int) -> list[int]:
    """A worker's rank processes (not multiprocessing's resource tracker)."""
    return [k for k in child_pids(pid) if b"spawn_main" in Path(f"/proc/{k}/cmdline").read_bytes()]


@pytest.mark.slow
def test_a_killed_decode_rank_takes_its_worker_down_cleanly_and_it_comes_back(shaped):
    """Two TP-2 decode workers under streaming load; one's rank 1 is SIGKILLed. The
    worker exits with it; no request fails before its first token (the router sends
    those to the other worker), only streams already decoding there end with an
    error; the prefill worker leaks no block; `up` starts the worker again, ranks and
    all, and it serves."""
    from tests.processes import worker_stats
    from tests.test_supervision import decoded_tokens, stream
    c = start_cluster("--model", str(shaped), "--threads", "1", "--decode", "2", "--decode-tp", "2",
                      "--prefill-tp", "1")
    try:
        victim = c.info["decodes"][0]["pid"]
        rank = _ranks_of(victim)
        assert len(rank) == 1, rank
        before = child_pids(c.proc.pid)
        results: dict[int, dict] = {}
        stop = threading.Event()
        serial = iter(range(10**6))

        def load() -> None:
            while not stop.is_set():
                stream(c.http, next(serial), results)
        threads = [threading.Thread(target=load) for _ in range(3)]
        for t in threads:
            t.start()
        time.sleep(4)
        os.kill(rank[0], signal.SIGKILL)
        deadline = time.monotonic() + 90
        while not (new := child_pids(c.proc.pid) - before) or not all(_ranks_of(p) for p in new):
            assert time.monotonic() < deadline, "the decode worker was not started again"
            time.sleep(0.5)
        assert not os.path.exists(f"/proc/{victim}/cmdline") or victim not in child_pids(c.proc.pid)
        time.sleep(8)                                 # requests reach the new worker too
        stop.set()
        for t in threads:
            t.join(130)
        done = [r for r in results.values() if r["events"] and r["events"][-1] == "[DONE]"]
        errors = [r for r in done if any(isinstance(e, dict) and "error" in e for e in r["events"])]
        assert len(done) == len(results), [r for r in results.values() if r not in done]
        assert all(decoded_tokens(r["events"]) > 0 for r in errors), "a request failed before its first token"
        assert len(results) - len(errors) >= 5 and len(errors) <= 3, (len(results), len(errors))
        prefill = worker_stats(f"127.0.0.1:{c.info['prefills'][0]['grpc_port']}", "prefill", c.secret_file)
        assert prefill.info.free_blocks == prefill.info.num_blocks
        print(f"killed rank: {len(results)} streams, {len(errors)} ended with an error mid-stream, "
              f"none before its first token")
    finally:
        stop_cluster(c)


def _features(http: str) -> list:
    """Answers that exercise what TP must leave unchanged: n > 1 forks with seeded
    sampling, logprobs and prompt logprobs, a JSON schema, and the prefix cache (the
    same long prompt twice)."""
    long_prompt = "The lighthouse keeper wrote in the log: " + "wind, rain, calm. " * 40
    bodies = [
        {"prompt": "Once upon a time", "max_tokens": 12, "n": 2, "temperature": 1.0, "seed": 7},
        {"prompt": "The list:", "max_tokens": 8, "temperature": 0, "logprobs": 3, "prompt_logprobs": 2},
        {"prompt": long_prompt, "max_tokens": 6, "temperature": 0},
        {"prompt": long_prompt, "max_tokens": 6, "temperature": 0},
        {"messages": [{"role": "user", "content": "JSON:"}], "max_tokens": 24, "temperature": 0,
         "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
             "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}},
    ]
    out = []
    for body in bodies:
        chat = "messages" in body
        r = httpx.post(f"{http}/v1/{'chat/completions' if chat else 'completions'}",
                       json={"return_token_ids": True, **body}, timeout=120)
        assert r.status_code == 200, r.text
        j = r.json()
        out.append([(c.get("token_ids"), c["message"]["content"] if chat else c["text"],
                     None if chat else (c.get("logprobs") or {}).get("top_logprobs")) for c in j["choices"]]
                   + [j.get("prompt_logprobs"), j["usage"].get("prompt_tokens_details")])
    return out


@pytest.mark.slow
@pytest.mark.process
def test_forks_logprobs_schemas_prefix_cache_and_async_scheduling_are_unchanged_under_tp(shaped):
    """The same requests, aggregated, against TP 1 and TP 2 with async scheduling on:
    the same tokens, text and top logprobs (to 1e-4), and the second long prompt found
    in the prefix cache on both."""
    answers = []
    for tp in ("1", "2"):
        c = start_cluster("--model", str(shaped), "--threads", "1", "--mode", "aggregated", "--decode", "1",
                          "--tensor-parallel-size", tp, "--async-scheduling", "on")
        try:
            answers.append(_features(c.http))
        finally:
            assert stop_cluster(c) == 0
    one, two = answers
    for a, b in zip(one, two):
        for x, y in zip(a[:-2], b[:-2]):
            assert x[0] == y[0] and x[1] == y[1]
            for p, q in zip(x[2] or [], y[2] or []):
                assert p.keys() == q.keys() and all(abs(p[k] - q[k]) < 1e-4 for k in p)
        assert a[-1] == b[-1]
    assert one[3][-1]["cached_tokens"] > 0


@pytest.mark.slow
@pytest.mark.process
def test_speculative_decoding_at_tp3_drafts_verifies_and_matches_generate(model_dir):
    """SmolLM2 at TP 3 with ngram drafts, on a prompt whose answer copies it: drafts are
    made and accepted, and the tokens are generate's."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from services.engine.text.tokenizer import encode_chat
    code = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n"
    messages = [{"role": "user", "content": "Repeat this code exactly, then stop:\n" + code}]
    tok = AutoTokenizer.from_pretrained(model_dir)
    ids = encode_chat(tok, messages)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    want = model.generate(torch.tensor([ids]), max_new_tokens=48, do_sample=False)[0, len(ids):].tolist()
    c = start_cluster("--threads", "1", "--mode", "aggregated", "--decode", "1", "--tensor-parallel-size", "3",
                      "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 4, "adaptive": false}')
    try:
        r = httpx.post(f"{c.http}/v1/chat/completions", timeout=300, json={
            "messages": messages, "max_tokens": 48, "temperature": 0, "return_token_ids": True})
        assert r.json()["choices"][0]["token_ids"] == want
        metrics = httpx.get(c.metrics_url("decode"), timeout=10).text
        accepted = next(float(line.split()[-1]) for line in metrics.splitlines()
                        if line.startswith("vllm:spec_decode_num_accepted_tokens_total"))
        assert accepted > 0
    finally:
        assert stop_cluster(c) == 0


def test_shared_memory_ranks_sum_alike_hear_rank_0_and_give_up_on_a_missing_peer(tmp_path):
    """Two ranks' ends of one segment, in two threads: an all-reduce gives both the same
    sum, rank 0's messages arrive in order, and a rank whose peer never comes to an
    all-reduce raises instead of waiting forever."""
    from concurrent.futures import ThreadPoolExecutor

    from services.engine.model.shm_comm import PeerTimeout, SharedMemoryComm
    path = tmp_path / "segment"
    zero = SharedMemoryComm(0, 2, path, create=True)
    one = SharedMemoryComm(1, 2, path, create=False)
    a = torch.randn(3, 512, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    b = torch.randn(3, 512, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    want = a + b
    with ThreadPoolExecutor(2) as pool:
        for _ in range(3):                          # both slot sets, and back to the first
            x, y = a.clone(), b.clone()
            done = [pool.submit(zero.all_reduce, x), pool.submit(one.all_reduce, y)]
            for f in done:
                f.result(timeout=30)
            assert torch.equal(x, want) and torch.equal(y, want)
        heard = pool.submit(lambda: [one.receive() for _ in range(2)])
        assert zero.send(b"first") and zero.send(b"second")
        assert heard.result(timeout=30) == [b"first", b"second"]
    zero.peer_timeout = 0.2
    with pytest.raises(PeerTimeout):
        zero.all_reduce(a.clone())
    zero.close()
    one.close()


def _idle_rank(rank: int, address: str, out) -> None:
    from services.engine.model import parallel, shm_comm
    shm_comm.usable = lambda device, size: False            # commands through gloo, as on GPUs
    group = parallel.RankGroup(parallel.TensorParallel(2, rank), torch.device("cpu"), address, timeout_s=1)
    try:
        if rank == 0:
            time.sleep(3)                                    # no request for three compute timeouts
            group.send(parallel.Command.STEP, [1, 2, 3])
            out.put((0, "sent"))
        else:
            command, ints, _ = group.receive()
            out.put((1, f"{command.name} {ints}"))
    except Exception as exc:                               # noqa: BLE001 - reported to the test
        out.put((rank, repr(exc)))


def test_an_idle_rank_waits_for_its_next_command_past_the_compute_timeout():
    """Ranks after the first wait for rank 0's commands as long as it sends none (an
    idle worker): with commands through gloo (GPUs, CPUs without the shared-memory
    path), a wait bounded by the all-reduces' timeout ended every idle rank."""
    import multiprocessing
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_idle_rank, args=(rank, address, out)) for rank in (0, 1)]
    for p in procs:
        p.start()
    try:
        got = dict(out.get(timeout=60) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    assert got == {0: "sent", 1: "STEP [1, 2, 3]"}


class _Group:
    """A RankGroup double that records what is sent and whether the ranks were lost."""

    def __init__(self, commands=()) -> None:
        self.sent, self.why = [], None
        self.commands = list(commands)

    def send(self, command, ints=(), data=b"") -> None:
        self.sent.append(command)

    def receive(self):
        return self.commands.pop(0)

    def lost(self, why: str) -> None:
        self.why = why


def test_a_step_that_fails_on_one_rank_takes_the_worker_down_and_a_bad_batch_fails_before_any_starts(model_dir):
    """A forward pass, block copy or graph capture that fails on one rank leaves the
    others waiting in (or past) its all-reduces: every later step would sum two steps'
    partial results. Whichever rank it fails on, the worker exits (`RankGroup.lost`).
    A batch with bad block tables is refused on rank 0 before it is sent, and fails
    alone."""
    from services.common.settings import WorkerSettings
    from services.engine.model.parallel import Command
    from services.engine.model.runner import ModelRunner
    from services.worker.ranks import Follower
    runner = ModelRunner(model_dir, "float32", "cpu")
    pool = KVPoolMemory.allocate(runner.layout(8, 16))
    runner.tp, runner.group = TensorParallel(2, 0), _Group()

    def out_of_memory(*_):
        raise MemoryError("rank 0 alone")
    runner._execute = out_of_memory
    with pytest.raises(ValueError, match="block ids"):
        runner.decode(pool, [5], [3], [[9]])
    assert runner.group.sent == [] and runner.group.why is None
    with pytest.raises(MemoryError):
        runner.decode(pool, [5], [3], [[1]])
    assert runner.group.sent == [Command.STEP] and "MemoryError" in runner.group.why
    runner.tp = TensorParallel(1, 0)
    group = _Group([(Command.COPY, [1, 99], b""), (Command.STOP, [], b"")])
    group.tp = TensorParallel(2, 1)
    follower = Follower(runner, group, WorkerSettings(role="decode", dtype="float32"))
    follower.pool = pool
    follower.run()                                          # block 99 is outside this rank's pool
    assert group.why is not None and "COPY" in group.why
    pool.close()


def test_other_prefill_ranks_write_through_the_backend_rank_0_fell_back_to():
    """The receiver offers shared memory that is not there (another host) and TCP: rank
    0 falls back to TCP, and the plan for rank 1 pairs through TCP too, not through the
    shared memory that failed; and again for the next request."""
    import json as _json

    from services.rpc import worker_pb2
    from services.worker.kv_export import KVExporter
    receivers = _pools([range(0, 1), range(1, 2)], shared=False, seed=None)
    tcp = [create_transport("tcp") for _ in receivers]
    offers = []
    for rank, (pool, t) in enumerate(zip(receivers, tcp)):
        gone = {"backend": "shm", "compat_hash": "h", "layout": pool.layout.__dict__, "heads": [rank, rank + 1],
                "path": f"/dev/shm/pdserve-kv-gone-{rank}"}
        offers += [worker_pb2.TransportOffer(backend="shm", meta=_json.dumps(gone).encode(), rank=rank),
                   worker_pb2.TransportOffer(backend="tcp", meta=t.register(pool, "h"), rank=rank)]
    ours = _pools([range(0, 1)], shared=False, seed=1)[0]
    writers = {"shm": create_transport("shm"), "tcp": create_transport("tcp")}
    for t in writers.values():
        t.register(ours, "h")
    exporter = KVExporter(writers, "h", ours.layout, heads=[range(0, 1), range(1, 2)])
    handle = worker_pb2.KVHandle(request_id="r", block_ids=[1], num_tokens=3, write_deadline=time.time() + 30,
                                 offers=offers, compat_hash="h")
    try:
        export = exporter.open("r", handle)
        assert [t.transport.name for t in export.targets] == ["tcp"] and export.fell_back
        assert [r.rank for r in export.ranks] == [1]
        assert [data.split(b"\0")[0] for data in exporter._connects.values()] == [b"tcp"]
        # every export pairs that rank again (free on a live link; a failed one is made anew)
        connects = dict(exporter._connects)
        exporter._connects.clear()
        exporter.open("r2", worker_pb2.KVHandle(request_id="r2", block_ids=[2], num_tokens=3, offers=offers,
                                                write_deadline=time.time() + 30, compat_hash="h"))
        assert exporter._connects == connects
        # the lease counts from the handle's arrival, not from after the worker's checks
        late = exporter.open("r3", worker_pb2.KVHandle(request_id="r3", block_ids=[3], num_tokens=3, offers=offers,
                                                       write_seconds=10, compat_hash="h"), time.monotonic() - 4)
        assert 5 < late.deadline - time.monotonic() <= 6
    finally:
        for t in [*tcp, *writers.values()]:
            t.shutdown()


@pytest.mark.slow
@pytest.mark.process
def test_a_prefill_ranks_failed_writes_fail_their_requests_alone(shaped):
    """A TP-2 prefill worker whose transports drop half the writes midway (each rank's
    own): a request whose KV did not all land, by either rank, falls back to a local
    prefill on the decode worker, every answer is still generate's, and no block is
    left held on either side."""
    from tests.processes import Services
    expected = generate_expected(shaped)
    svc = Services()
    try:
        model = ("--model", str(shaped))
        svc.start_worker("decode", *model)
        svc.start_worker("prefill", *model, "--tensor-parallel-size", "2", "--fault-drop-transfers", "0.5")
        svc.start_router(*model)
        svc.wait_routable()
        decisions = []
        for case in CASES:
            r = httpx.post(f"{svc.http}/v1/chat/completions", json=chat_body(case), timeout=300)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["token_ids"] == expected[case.name].token_ids, case.name
            decisions.append(dict(p.split("=", 1) for p in r.headers["x-pdserve-route"].split(";"))["decision"])
        assert "local_fallback" in decisions, decisions
        d = svc.wait_idle()
        assert d.info.free_blocks == d.info.num_blocks and d.active_handoffs == 0
        p = svc.stats("prefill")
        assert p.info.free_blocks == p.info.num_blocks
    finally:
        svc.stop()
