"""Int8 weights for Llama-family decoder layers (`--quantization int8`, CPU): each
layer's four matmuls with int8 weights per output channel and activations quantized per
token as they enter, SmoothQuant-calibrated at load. An approximation, opt-in, like
vLLM's W8A8; the layers' element-wise work runs in the native kernels.
"""
from __future__ import annotations

import torch
from torch import nn

from services.engine.kernels.native import NativeLayers, NativeMatmul
from services.engine.model.fusion import LEAN_LAYERS, PACK_FOR_ROWS, LeanDecoderLayer, lean_compatible, replace
from services.engine.model.hardware import cpu_flags


class Int8Linear(nn.Module):
    """A linear layer with int8 weights: per output channel, symmetric (scale = max |w|
    / 127; / 63 on CPUs without VNNI, see below). Its input comes quantized per token
    (`NativeLayers.quantize_rows`: uint8 with zero point 128); a u8 x s8 matmul returns
    float32 products, which the caller scales back per row and adds `bias` to
    (`NativeLayers.dequant_rows`). The matmul is pdserve's own where `matmul` is given
    and runs int8 (AVX512-VNNI; ~2x oneDNN's speed at one row, about level from 64 rows
    up), else oneDNN's; both give the same products, bit for bit (exact int32 sums,
    scaled once)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype | None = None,
                 matmul: NativeMatmul | None = None) -> None:
        """`dtype`: the outputs' (and so the bias's) dtype, default the bias's own."""
        super().__init__()
        w = weight.detach().float()
        self.out_features, self.in_features = w.shape
        self.native = matmul is not None and matmul.int8 and self.in_features % 4 == 0
        # Without VNNI, oneDNN multiplies u8 x s8 with vpmaddubsw, which adds each pair of
        # products in int16 and saturates: 2 * 255 * 127 does not fit, 2 * 255 * 63 does.
        # There the weights take 7 bits (measured on an AVX2 EPYC: with 8, products were
        # off by up to 10 % of the largest).
        limit = 127 if self.native or {"avx512_vnni", "avx_vnni", "amx_int8"} & cpu_flags() else 63
        scale = w.abs().amax(dim=1) / limit
        self.scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        q = torch.round(w / self.scale[:, None]).clamp(-limit, limit).to(torch.int8)
        if self.native:
            self.packed, self.comp, self.native_scale = matmul.pack_int8(q, self.scale)
            object.__setattr__(self, "matmul", matmul)
        else:
            self.packed = torch.ops.onednn.qlinear_prepack(q, [PACK_FOR_ROWS, self.in_features])
            self.zero_points = torch.zeros(self.out_features, dtype=torch.int64)
        self.bias = None if bias is None else bias.detach().to(dtype or bias.dtype)

    def products(self, quantized: torch.Tensor) -> torch.Tensor:
        """[rows, in] uint8 (value + 128) -> [rows, out] float32, before the rows' scales."""
        if self.native:
            return self.matmul.products(quantized, self.packed, self.out_features, self.comp, self.native_scale,
                                        torch.get_num_threads())
        return torch.ops.onednn.qlinear_pointwise(quantized, 1.0, 128, self.packed, self.scale, self.zero_points,
                                                  None, 1.0, 0, torch.float32, "none", [], "")


def _cat_linear(weights: list[torch.Tensor], biases: list[torch.Tensor | None], dtype: torch.dtype,
                matmul: NativeMatmul | None = None) -> Int8Linear:
    """One int8 matmul for several projections of one input."""
    bias = None if biases[0] is None else torch.cat([b.float() for b in biases])
    return Int8Linear(torch.cat([w.float() for w in weights]), bias, dtype, matmul)


# SmoothQuant's migration strength: how much of an input channel's range moves into the
# weights (0: none, 1: all). 0.5 is the paper's default for most models.
SMOOTHING_ALPHA = 0.5
# What the int8 layers are calibrated on at load: where each input channel's range lies.
CALIBRATION_TEXT = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
    "combined movable metal type, oil-based ink and a wooden screw press. Within fifty years, "
    "presses were running in more than two hundred European cities, and the price of books fell "
    "sharply.\n\nQ: How do I reverse a list in Python?\nA: Use `items[::-1]` for a reversed copy, or "
    "`items.reverse()` to reverse it in place.\n\ndef fibonacci(n):\n    a, b = 0, 1\n    for _ in "
    "range(n):\n        a, b = b, a + b\n    return a\n\nPhotosynthesis converts light energy into "
    "chemical energy: plants take in carbon dioxide and water and release oxygen. Dear team, the "
    "meeting on Thursday moves to 3 pm; please send your slides by noon. 1, 2, 3, 5, 8, 13, 21. "
    "Paris, Tokyo, Nairobi, Lima and Sydney are capitals or large cities on five continents.")


def _smoothing(act_max: torch.Tensor, weights: list[torch.Tensor]) -> torch.Tensor:
    """SmoothQuant's per-input-channel factors for matmuls that share one input: divide
    the input's channel j by s_j and multiply the weights' column j by it, so outlier
    channels of the activations (which per-token int8 quantizes badly) are tamed at
    the cost of the weights' (quantized per output channel, which takes it better)."""
    return _factors(act_max, torch.stack([w.float().abs().amax(dim=0) for w in weights]).amax(dim=0))


def _factors(act_max: torch.Tensor, w_max: torch.Tensor) -> torch.Tensor:
    s = act_max.clamp_min(1e-5).pow(SMOOTHING_ALPHA) / w_max.clamp_min(1e-5).pow(1 - SMOOTHING_ALPHA)
    return s.clamp_min(1e-5)


@torch.inference_mode()
def calibrate(model: nn.Module, input_ids: list[int]) -> dict[nn.Module, dict[str, torch.Tensor]]:
    """Each decoder layer's per-channel max |input| of its q, o, gate and down
    projections over `input_ids`, one forward pass with torch's SDPA attention."""
    stats: dict[nn.Module, dict[str, torch.Tensor]] = {}
    hooks = []

    def watch(layer: nn.Module, name: str, linear: nn.Module) -> None:
        def hook(_module, inputs, _output):
            x = inputs[0].detach().float().reshape(-1, inputs[0].shape[-1]).abs().amax(dim=0)
            seen = stats.setdefault(layer, {})
            seen[name] = torch.maximum(seen[name], x) if name in seen else x
        hooks.append(linear.register_forward_hook(hook))

    for layer in model.modules():
        if lean_compatible(layer):
            watch(layer, "qkv", layer.self_attn.q_proj)
            watch(layer, "gate_up", layer.mlp.gate_proj)
            watch(layer, "down", layer.mlp.down_proj)
            watch(layer, "o", layer.self_attn.o_proj)
    attention = model.config._attn_implementation
    model.set_attn_implementation("sdpa")
    try:
        model(input_ids=torch.tensor([input_ids], device=model.device), use_cache=False)
    finally:
        model.set_attn_implementation(attention)
        for h in hooks:
            h.remove()
    return stats


class Int8DecoderLayer(LeanDecoderLayer):
    """`LeanDecoderLayer` with int8 weights in its four matmuls (q|k|v, o, gate|up,
    down), activations quantized per token as they enter each, in the native kernels:
    RMSNorm and quantize in one pass, scale back plus bias plus residual in one, and
    SiLU-and-multiply between gate|up and down on the float32 products. Attention, the
    KV cache and the vocabulary projection keep the model's dtype. With `stats` from
    `calibrate`, SmoothQuant's factors are folded into the RMSNorm weights (for q|k|v
    and gate|up), into up's rows (for down) and into v's rows (for o: the KV cache
    then holds V / s) before quantizing. An approximation, like vLLM's W8A8
    (per-channel weights, dynamic per-token activations): opt-in."""

    def __init__(self, layer: nn.Module, kernels: NativeLayers, stats: dict[str, torch.Tensor] | None = None,
                 matmul: NativeMatmul | None = None) -> None:
        nn.Module.__init__(self)                     # none of LeanDecoderLayer's matmuls
        self._take_shape(layer)
        attn, mlp = layer.self_attn, layer.mlp
        self.dtype = attn.q_proj.weight.dtype
        qkv = [attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]
        gate_up = [mlp.gate_proj.weight, mlp.up_proj.weight]
        down, o, v_bias = mlp.down_proj.weight, attn.o_proj.weight, attn.v_proj.bias
        if stats:
            norms = []
            for i, (name, weights) in enumerate((("qkv", qkv), ("gate_up", gate_up))):
                s = _smoothing(stats[name], weights)
                norms.append((self.norm_weights[i].float() / s).to(self.dtype))
                weights[:] = [w.float() * s for w in weights]
            self.norm_weights = tuple(norms)
            s = _smoothing(stats["down"], [down])
            gate_up[1] = gate_up[1] / s[:, None]             # silu(gate) * up / s = the input / s
            down = down.float() * s
            # o's input is attention's output, a mix of V rows: V / s gives input / s. One
            # factor per V channel, shared by the query heads that read that KV head.
            kv, dim = self.num_kv_heads, self.head_dim
            per_head = (kv, self.num_heads // kv, dim)
            s = _factors(stats["o"].view(per_head).amax(dim=1),
                         o.float().abs().amax(dim=0).view(per_head).amax(dim=1)).reshape(-1)
            qkv[2] = qkv[2].float() / s[:, None]
            v_bias = None if v_bias is None else v_bias / s
            o = o.float() * s.view(kv, 1, dim).expand(per_head).reshape(-1)
        self.qkv = _cat_linear(qkv, [attn.q_proj.bias, attn.k_proj.bias, v_bias], self.dtype, matmul)
        self.qkv_sizes = [w.shape[0] for w in qkv]
        self.o_proj = Int8Linear(o, attn.o_proj.bias, self.dtype, matmul)
        self.gate_up = _cat_linear(gate_up, [None, None], self.dtype, matmul)
        self.down_proj = Int8Linear(down, mlp.down_proj.bias, self.dtype, matmul)
        object.__setattr__(self, "kernels", kernels)

    def forward(self, hidden_states: torch.Tensor, position_embeddings=None, pdserve_batch=None, **_):
        k, threads, shape = self.kernels, torch.get_num_threads(), hidden_states.shape
        x, scales = k.rms_norm_quantize(hidden_states, self.norm_weights[0], self.eps[0], threads)
        qkv = k.dequant_rows(self.qkv.products(x), scales, self.qkv.bias, None, self.dtype, threads)
        q, key, value = qkv.view(1, shape[1], -1).split(self.qkv_sizes, dim=-1)
        x, scales = k.quantize_rows(self._attention(q, key, value, position_embeddings, pdserve_batch), threads)
        hidden_states = k.dequant_rows(self.o_proj.products(x), scales, self.o_proj.bias, hidden_states, self.dtype,
                                       threads)
        x, scales = k.rms_norm_quantize(hidden_states, self.norm_weights[1], self.eps[1], threads)
        x, scales = k.silu_mul_quantize(self.gate_up.products(x), scales, threads)
        return k.dequant_rows(self.down_proj.products(x), scales, self.down_proj.bias, hidden_states, self.dtype,
                              threads).view(shape)


def quantize_layers(model: nn.Module, kernels: NativeLayers | None, calibration_ids: list[int] | None,
                    matmul: NativeMatmul | None = None) -> list[str]:
    """Every decoder layer as an `Int8DecoderLayer` (smoothed where `calibration_ids`
    are given; in pdserve's own int8 matmul where `matmul` runs int8), or ValueError
    saying why not. Returns what was applied."""
    if model.device.type != "cpu" or kernels is None or not hasattr(torch.ops.onednn, "qlinear_pointwise"):
        raise ValueError("--quantization int8 runs on CPU in float32 or bfloat16, with the native layer kernels "
                         "and torch's oneDNN int8 matmul (not in float16, with --attention-kernel torch, or on GPUs)")
    layers = [m for m in model.modules() if type(m).__name__.endswith("DecoderLayer")]
    unfit = sorted({type(m).__name__ for m in layers if not lean_compatible(m)
                    or m.mlp.gate_proj.bias is not None or m.mlp.up_proj.bias is not None})
    if not layers or unfit:
        raise ValueError(f"--quantization int8 takes Llama-family decoder layers ({', '.join(LEAN_LAYERS)}) "
                         f"without MLP biases; this model has {', '.join(unfit) or 'none found'}")
    stats = calibrate(model, calibration_ids) if calibration_ids else {}
    for layer in layers:
        replace(model, layer, Int8DecoderLayer(layer, kernels, stats.get(layer), matmul))
    applied = ["int8 decoder layers" + (" (smoothed)" if calibration_ids else "")]
    return applied + (["native int8 matmul"] if matmul is not None and matmul.int8 else [])
