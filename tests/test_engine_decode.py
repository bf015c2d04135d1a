"""The decode step over the paged cache, in one process, float32: a batch of sequences
of very different lengths gives each sequence the logits it gets when decoded alone,
in the caller's order, through the native kernel and through the torch path (length
groups in sorted order)."""
import pytest
import torch

from services.engine.model.kv_cache import KVPoolMemory
from services.engine.model.attention import length_groups
from services.engine.model.runner import ModelRunner

BLOCK = 16


@pytest.fixture(scope="module", params=["native", "torch"])
def runner(model_dir, request):
    torch.set_num_threads(1)
    return ModelRunner(model_dir, "float32", "cpu", attention=request.param)


def test_length_groups_bound_the_padding():
    assert length_groups([1, 2, 3, 5, 8, 9, 17, 17, 130]) == [(0, 5), (5, 8), (8, 9)]
    assert length_groups([17, 17, 17]) == [(0, 3)]
    widths = [1, 4, 9, 12, 30, 31, 64, 200, 201]
    for start, stop in length_groups(widths):
        assert widths[stop - 1] <= max(2 * widths[start], 8)


def test_mixed_length_batch_matches_each_sequence_alone(runner):
    lengths = [300, 5, 70, 33, 1]                    # deliberately not sorted
    tables, cursor = [], 0
    for n in lengths:
        blocks = -(-(n + 1) // BLOCK)
        tables.append(list(range(cursor, cursor + blocks)))
        cursor += blocks
    pool = KVPoolMemory.allocate(runner.layout(cursor, BLOCK))
    torch.manual_seed(0)
    prompts = [torch.randint(100, 20000, (n,)).tolist() for n in lengths]
    firsts = []
    for prompt, table in zip(prompts, tables):
        firsts.append(int(runner.prefill(pool, prompt, table).argmax()))
    snapshot = pool.tensor.clone()

    batched = runner.decode(pool, firsts, lengths, tables)
    for i, (first, n, table) in enumerate(zip(firsts, lengths, tables)):
        pool.tensor.copy_(snapshot)
        alone = runner.decode(pool, [first], [n], [table])[0]
        assert torch.allclose(batched[i], alone, atol=1e-4, rtol=1e-4), i
        assert int(batched[i].argmax()) == int(alone.argmax())
    pool.close()
