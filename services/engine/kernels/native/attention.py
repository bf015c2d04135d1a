"""The attention kernels of attention.c, from Python."""
from __future__ import annotations

from pathlib import Path

import torch

from services.engine.kernels.native.library import DTYPES, load

# The shapes the kernels take (attention.c refuses the others): a head size up to MAX_DIM
# and up to MAX_HEADS query heads; for prefill, a head size of whole 32s and at most
# PREFILL_GROUP query heads a KV head.
MAX_DIM, MAX_HEADS, PREFILL_GROUP = 256, 64, 16


class NativeAttention:
    """The kernels of one loaded library: `decode` (one query token per sequence over
    its cached blocks) and, where `prefills` is true, `prefill` (causal, bfloat16)."""

    def __init__(self, library: Path) -> None:
        lib = load(library)
        self._decode = lib.function("pdserve_paged_decode_attention")
        self._prefill = lib.function("pdserve_prefill_attention")
        self.prefills = bool(lib.function("pdserve_prefill_supported")())
        self.library = library
        self._lib = lib

    @staticmethod
    def supports(dtype: torch.dtype, device: torch.device) -> bool:
        return device.type == "cpu" and dtype in DTYPES

    @staticmethod
    def takes_decode(q_heads: int, kv_heads: int, dim: int) -> bool:
        return 1 <= dim <= MAX_DIM and kv_heads >= 1 and q_heads <= MAX_HEADS and q_heads % kv_heads == 0

    @staticmethod
    def takes_prefill(q_heads: int, kv_heads: int, dim: int) -> bool:
        return (dim % 32 == 0 and 1 <= dim <= MAX_DIM and kv_heads >= 1 and q_heads % kv_heads == 0
                and q_heads // kv_heads <= PREFILL_GROUP)

    def prefill(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, offset: int, scale: float,
                threads: int = 1) -> torch.Tensor:
        """Causal attention for one sequence, bfloat16: query [q_len, q_heads, dim], key
        and value [k_len, kv_heads, dim] (any token and head strides, last dimension
        contiguous); query i sees keys 0 .. i + offset. Returns [q_len, q_heads, dim]."""
        q_len, q_heads, dim = query.shape
        k_len, kv_heads, _ = key.shape
        if not self.prefills or {query.dtype, key.dtype, value.dtype} != {torch.bfloat16}:
            raise ValueError("native prefill attention takes bfloat16 on CPUs with AVX512-BF16")
        if query.stride(-1) != 1 or key.stride(-1) != 1 or value.stride(-1) != 1:
            raise ValueError("the last dimension must be contiguous")
        if key.shape != value.shape or key.shape[-1] != dim:       # the kernel reads both as key's
            raise ValueError(f"key {tuple(key.shape)} and value {tuple(value.shape)} must agree, in the query's "
                             f"head size {dim}")
        out = torch.empty(q_len, q_heads, dim, dtype=query.dtype)
        rc = self._prefill(query.data_ptr(), query.stride(0), query.stride(1), key.data_ptr(), key.stride(0),
                           key.stride(1), value.data_ptr(), value.stride(0), value.stride(1), out.data_ptr(),
                           q_len, k_len, offset, q_heads, kv_heads, dim, scale, threads)
        if rc:
            raise ValueError(f"prefill attention refused its arguments (code {rc})")
        return out

    def decode(self, query: torch.Tensor, cache: torch.Tensor, table: torch.Tensor, lens: torch.Tensor,
               scale: float, threads: int = 1) -> torch.Tensor:
        """query [batch, q_heads, dim]; cache: one layer, [2, blocks, block_size, kv_heads,
        dim], contiguous; table int64 [batch, width] (block ids, row-major); lens int32
        [batch] (tokens to attend to, at most width * block_size). Returns [batch, q_heads,
        dim] in the query's dtype."""
        query = query.contiguous()
        batch, q_heads, dim = query.shape
        _, _, block_size, kv_heads, _ = cache.shape
        if cache.dtype != query.dtype or not cache.is_contiguous():
            raise ValueError("the cache must be contiguous and in the query's dtype")
        if table.dtype != torch.int64 or table.stride(1) != 1 or lens.dtype != torch.int32 or not lens.is_contiguous():
            raise ValueError("the block table must be int64 rows and the lengths contiguous int32")
        # what the kernel trusts that costs nothing to check here; block ids and lengths
        # against the table, the runner's (attention.check_block_ids, decode_widths)
        if cache.shape[-1] != dim or block_size < 1 or table.shape[0] < batch or lens.shape[0] < batch:
            raise ValueError("the cache's head size, the block table's rows and the lengths must match the query")
        out = torch.empty_like(query)
        rc = self._decode(query.data_ptr(), cache[0].data_ptr(), cache[1].data_ptr(), out.data_ptr(),
                          table.data_ptr(), table.stride(0), lens.data_ptr(), batch, q_heads, kv_heads, dim,
                          block_size, cache.stride(1), cache.stride(2), scale, DTYPES[query.dtype], threads)
        if rc:
            raise ValueError(f"paged decode attention refused its arguments (code {rc})")
        return out
