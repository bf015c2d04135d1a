"""A decoder's sizes from its Hugging Face config (a `config.json` as a dict, or the
config object): what the scheduler's cost model and the benchmarks' FLOP counts share."""
from __future__ import annotations

from typing import Any


def _get(config: Any, name: str, default: Any = None) -> Any:
    return config.get(name, default) if isinstance(config, dict) else getattr(config, name, default)


def head_dim(config: Any) -> int:
    return _get(config, "head_dim") or _get(config, "hidden_size") // _get(config, "num_attention_heads")


def layer_matmul_weights(config: Any) -> int:
    """Weights of one decoder layer's matmuls: q, k, v and o, gate, up and down."""
    hidden, heads = _get(config, "hidden_size"), _get(config, "num_attention_heads")
    kv_heads = _get(config, "num_key_value_heads") or heads
    return hidden * head_dim(config) * (2 * heads + 2 * kv_heads) + 3 * hidden * _get(config, "intermediate_size")


def prefill_flops(config: Any, tokens: int) -> int:
    """Matmul FLOPs of a prompt of `tokens` computed whole: every token through every
    layer's linear layers, causal attention's two matmuls (each token over those up to
    it), and the vocabulary projection of its last token."""
    layers, heads = _get(config, "num_hidden_layers"), _get(config, "num_attention_heads")
    vocabulary = 2 * _get(config, "hidden_size") * _get(config, "vocab_size")
    return (2 * layers * layer_matmul_weights(config) * tokens + vocabulary
            + 4 * layers * heads * head_dim(config) * tokens * (tokens + 1) // 2)
