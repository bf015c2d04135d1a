"""Workers keep freed heap memory (`keep_freed_memory`): a prefill run again in a worker
thread reuses the memory of the last one instead of faulting in fresh pages. With
glibc's defaults the earlier engine took ~60,000-85,000 page faults on every 1,024-token
prefill in a thread; the present one allocates less per pass, and the default may fault
little too, so the test holds the worker's setting to an absolute bound rather than
to a ratio. This machine's kernel also pages out idle memory on its own (a DAMON
`pageout` scheme), which can add faults to any single pass, so each mode is judged by
its best of three passes."""
import subprocess
import sys

import pytest

PROBE = r"""
import resource, sys, threading
import torch
from services.engine.model.kv_cache import KVPoolMemory
from services.common.lifecycle import keep_freed_memory
from services.engine.model.runner import ModelRunner
torch.set_num_threads(1)
if sys.argv[2] == "keep":
    assert keep_freed_memory()
runner = ModelRunner(sys.argv[1], sys.argv[3], "cpu")
pool = KVPoolMemory.allocate(runner.layout(72, 16))
prompt = [(i * 7919) % 40000 + 100 for i in range(1024)]

def passes():
    for _ in range(2):                   # the arena reaches its working set
        runner.prefill(pool, prompt, list(range(64)))
    faults = []
    for _ in range(3):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        runner.prefill(pool, prompt, list(range(64)))
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    print(min(faults))

t = threading.Thread(target=passes)      # as a worker runs its model: in an executor thread
t.start()
t.join()
"""


def _fewest_faults(model_dir, mode: str) -> int:
    # dtype auto: what this CPU computes fast (bfloat16 on AVX2 alone takes ~25 s a pass)
    out = subprocess.run([sys.executable, "-c", PROBE, str(model_dir), mode, "auto"], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return int(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow          # a memory-use property, measured over many prefills
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc tuning is Linux-only")
def test_a_repeated_prefill_in_a_worker_thread_reuses_its_memory(model_dir):
    kept = _fewest_faults(model_dir, "keep")
    assert kept < 1000, kept            # a pass that faulted its activations in would take tens of thousands
