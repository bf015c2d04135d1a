"""How many tokens one forward pass of a worker holds, and how many of a prompt a
decode worker's step that also decodes takes, by role and device: the defaults behind
--max-num-batched-tokens and --mixed-prefill-tokens. Plain numbers, so the launcher
can read them without loading a worker."""
from __future__ import annotations

# Tokens in one forward pass when --max-num-batched-tokens is 0. A prefill worker runs
# only prompts: big passes use the matmul units best. A decode worker's pass holds the
# running batch's decode tokens, and a prompt chunk in it delays every one of them.
PREFILL_TOKEN_BUDGET = 1024
DECODE_TOKEN_BUDGET = 512
# On a GPU a forward pass of a few thousand tokens runs near the matmul peak and a short
# one does not (bench/gpu_speed.py on an H200: an 8B-shaped 2k-token prompt at 84 % of
# the GEMM rate, 512 tokens at 55 %): vLLM's and SGLang's chunk sizes.
PREFILL_TOKEN_BUDGET_GPU = 8192
DECODE_TOKEN_BUDGET_GPU = 2048
# Prompt tokens in a decode worker's step that also decodes, when --mixed-prefill-tokens
# is automatic. On one CPU core 64 tokens add ~85 ms to a step (1.3 ms a token here): the
# batch keeps a token every ~150 ms at most while a short prompt is computed alongside.
# Since such steps run in the one-call decoder (runner.py), 24-token chunks give long
# prompts a flat ITL and more output, but chat prompts a later first token (3.99 s against
# 3.14 s p50 on vLLM's chat preset): 64 stays (docs/benchmarks.md, "Long, Zen 4").
# A GPU computes 512 in a few milliseconds.
MIXED_PREFILL_CPU = 64
MIXED_PREFILL_GPU = 512
# An aggregated worker on a CPU computes every prompt itself. Its steps take a prompt of
# up to the token budget whole (a chat prompt costs one step, as in vLLM's chunked
# prefill: a 64-token cap on those served vLLM's chat benchmark ~9 % slower), and a
# longer one 64 tokens a step: with 1,024-token prompts every step then carries a chunk
# and the batch a token every ~100 ms, against steps of 25 ms and of 750 ms with whole
# budgets of prompt (ITL p99 / p50 1.47 against 32; bench/vllm_serve.py, docs/benchmarks.md).
# Disaggregated decode workers keep 64 and nothing whole: they meet the mixed preset's
# 150 ms ITL SLO.
MIXED_PREFILL_AGGREGATED_CPU = 64


def token_budget(max_num_batched_tokens: int, role: str, device: str = "cpu") -> int:
    """The tokens one forward pass of a `role` worker may hold: as set, or its default."""
    gpu = device != "cpu"
    return max_num_batched_tokens or (
        (PREFILL_TOKEN_BUDGET_GPU if gpu else PREFILL_TOKEN_BUDGET) if role == "prefill"
        else (DECODE_TOKEN_BUDGET_GPU if gpu else DECODE_TOKEN_BUDGET))
