"""Faster forms of a model's own layers, swapped in where they compute the same thing.

The model keeps running its own modelling code; only modules are replaced:

- a Llama-family decoder layer (Llama, Mistral, Qwen2: pre-norm, rotary, SiLU MLP) runs
  as `LeanDecoderLayer`: the same math as its own forward in a dozen calls instead of
  some sixty (every module call and element-wise op costs Python and dispatch time,
  ~0.6 ms a layer here, a third of a small decode step); in float32 it uses torch's
  ops in the model's own order, so the output is bit for bit the model's (but see the
  native float32 matmul below);
- q/k/v and gate/up projections of one input become one matmul each (`FusedLinear`):
  one pass over the activations and one wider GEMM instead of two or three narrow
  ones. In float32 this is done only where the fused product equals the separate ones
  bit for bit on this machine (checked at load), or where the native matmul runs (it
  sums each output column alone, so fused columns are the separate ones exactly).
- float32 on a CPU with AVX2 and FMA but no AVX-512 (where `--dtype auto` picks
  float32): every linear layer runs in pdserve's own float32 matmul (`NativeLinear`):
  1.1-2.3x torch's at decode's 1-32 rows, level with it at prefill's hundreds
  (`python -m bench.matmul`). Its sums are float32 sums in k order, a few ulps from
  torch's, not bit for bit: greedy output through the cluster still matches
  `generate` token for token (tests/test_parity.py); `--attention-kernel torch`
  keeps torch's own matmul everywhere.
- bfloat16 on CPU: every linear layer's weight is packed once, for pdserve's own matmul
  on CPUs with AVX512-BF16 and no AMX (`NativeLinear`, `services/engine/kernels/native/matmul.c`:
  1.4-1.8x oneDNN's speed at decode's 1-4 rows, level from 64 up), else for oneDNN
  (`PackedLinear`; torch otherwise re-lays it out on every call), and RMSNorm, SiLU-and-multiply and
  rotary embedding run in native one-pass kernels (`services/engine/kernels/native/layers.c`)
  instead of a chain of element-wise ops. Float32 keeps torch's own ops there, for
  exact parity.
- bfloat16 or float16 on a CUDA device: the same three element-wise steps in Triton
  kernels (`gpu_kernels.TritonLayers`), one launch each.

Which of these a model gets is its execution backend's choice (backends.py), which
hands `apply` its kernels; int8 layers are in int8.py. Where every decoder layer ends up
in the native kernels, the CPU backend also runs them as one native call for decode
steps (`services/engine/kernels/native/decoder.c`).

What was applied is returned as a list of words for the start-up log.
"""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from services.engine.kernels.native import NativeLayers, NativeMatmul
from services.engine.model.attention import paged_attention

log = logging.getLogger(__name__)

# Modules whose forward is Llama's RMSNorm: x * rsqrt(mean(x^2) + eps) * weight.
RMS_NORMS = ("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm")
# Decoder layers whose forward is Llama's (checked further in `lean_compatible`).
LEAN_LAYERS = ("LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer")
# Models whose forward is embed -> rotary angles -> decoder layers -> norm, nothing else
# (what the CPU backend's one-call decode step stands in for).
DECODER_MODELS = ("LlamaModel", "MistralModel", "Qwen2Model")
# Modules whose forward is down(silu(gate(x)) * up(x)).
SILU_MLPS = ("LlamaMLP", "MistralMLP", "Qwen2MLP", "Qwen3MLP")
FUSED_PROJECTIONS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
# The row count oneDNN lays packed weights out for. Measured on a Sapphire Rapids core
# over a whole model's layers: packed for 32 rows ran 1.2x faster at 32 rows and 1.4x at
# 512 than packed for 1, and no slower at 1.
PACK_FOR_ROWS = 32


def packs_bf16() -> bool:
    """Whether oneDNN takes packed bfloat16 weights here (it refuses on AVX2-only CPUs)."""
    return (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
            and torch.ops.mkldnn._is_mkldnn_bf16_supported())


class PackedLinear(nn.Module):
    """A bfloat16 linear layer whose weight is laid out once for oneDNN's kernels, with
    oneDNN's fused epilogues: an activation, or an element-wise op with another tensor
    (a residual add), applied as each output tile is written instead of in another pass."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_FOR_ROWS)
        self.bias = None if bias is None else bias.detach()

    def forward(self, x: torch.Tensor, activation: str = "none") -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, activation, [], "")

    def then(self, x: torch.Tensor, other: torch.Tensor, op: str) -> torch.Tensor:
        """linear(x) `op` other, op being "add" or "mul"."""
        return torch.ops.mkldnn._linear_pointwise.binary(x, other, self.packed, self.bias, op)


class NativeLinear(nn.Module):
    """A bfloat16 or float32 linear layer in pdserve's own matmul (`NativeMatmul`), its
    weight packed once; with `up` (a second linear of the same input), gate|up as one matmul that
    writes silu(gate) * up. A residual add, like `PackedLinear.then`, is applied as each
    output tile is written."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, matmul: NativeMatmul,
                 up: nn.Linear | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.gated = up is not None
        self.packed, self.bias = matmul.pack(weight, bias, None if up is None else (up.weight, up.bias),
                                             dtype=weight.dtype)
        self.columns = self.out_features * (2 if self.gated else 1)
        object.__setattr__(self, "matmul", matmul)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul.linear(x, self.packed, self.columns, self.bias, gated=self.gated,
                                  threads=torch.get_num_threads())

    def then(self, x: torch.Tensor, other: torch.Tensor, op: str) -> torch.Tensor:
        """linear(x) + other (op "add", the only one)."""
        if op != "add" or self.gated:
            raise ValueError(f"NativeLinear.then does a residual add, not {op!r}")
        return self.matmul.linear(x, self.packed, self.columns, self.bias, residual=other,
                                  threads=torch.get_num_threads())

    @staticmethod
    def fits(weight: torch.Tensor, gated: bool = False) -> bool:
        """Whether the kernel takes this weight's dtype and shape (bfloat16: an even number
        of inputs; gated: whole column groups)."""
        group, pair = NativeMatmul.GROUPS.get(weight.dtype), NativeMatmul.PAIRS.get(weight.dtype)
        return group is not None and weight.shape[1] % pair == 0 and (not gated or weight.shape[0] % group == 0)


def _linear(weight: torch.Tensor, bias: torch.Tensor | None, pack: bool,
            matmul: NativeMatmul | None = None) -> nn.Module:
    if matmul is not None and NativeLinear.fits(weight):
        return NativeLinear(weight, bias, matmul)
    if pack:
        return PackedLinear(weight, bias)
    out = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, dtype=weight.dtype,
                    device=weight.device)
    out.weight = nn.Parameter(weight.detach(), requires_grad=False)
    if bias is not None:
        out.bias = nn.Parameter(bias.detach(), requires_grad=False)
    return out


class FusedLinear(nn.Module):
    """Several projections of the same input as one matmul. Each former projection is
    a `ProjectionPart`; the first part called with an input computes all of them, the
    others take their share of that result. A part called with another input than its
    siblings computes the product again, so any calling order stays correct."""

    def __init__(self, linears: list[nn.Linear], pack: bool, matmul: NativeMatmul | None = None) -> None:
        super().__init__()
        bias = None if linears[0].bias is None else torch.cat([lin.bias for lin in linears])
        self.linear = _linear(torch.cat([lin.weight for lin in linears]), bias, pack, matmul)
        self.sizes = [lin.out_features for lin in linears]
        self._input: torch.Tensor | None = None
        self._outputs: tuple[torch.Tensor, ...] = ()
        self._taken = 0

    def part(self, index: int, x: torch.Tensor) -> torch.Tensor:
        if self._input is not x:
            self._outputs = self.linear(x).split(self.sizes, dim=-1)
            self._input, self._taken = x, 0
        out = self._outputs[index]
        self._taken += 1
        if self._taken == len(self.sizes):            # every part served: drop the references
            self._input, self._outputs = None, ()
        return out


class ProjectionPart(nn.Module):
    def __init__(self, fused: FusedLinear, index: int) -> None:
        super().__init__()
        object.__setattr__(self, "fused", fused)      # owned by the parent module, not by each part
        self.index = index
        self.out_features = fused.sizes[index]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fused.part(self.index, x)


class NativeRMSNorm(nn.Module):
    def __init__(self, norm: nn.Module, kernels: NativeLayers) -> None:
        super().__init__()
        self.weight = norm.weight
        self.eps = float(norm.variance_epsilon)
        object.__setattr__(self, "kernels", kernels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernels.rms_norm(x, self.weight, self.eps, torch.get_num_threads())


class NativeSiluMLP(nn.Module):
    """down(silu(gate(x)) * up(x)) with gate|up as one matmul and the activation in one pass."""

    def __init__(self, mlp: nn.Module, kernels: NativeLayers, pack: bool, matmul: NativeMatmul | None = None) -> None:
        super().__init__()
        self.gated = _gated(mlp, matmul)
        self.gate_up = None if self.gated is not None else FusedLinear([mlp.gate_proj, mlp.up_proj], pack).linear
        self.down_proj = _linear(mlp.down_proj.weight, mlp.down_proj.bias, pack, matmul)
        object.__setattr__(self, "kernels", kernels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gated is not None:
            return self.down_proj(self.gated(x))
        return self.down_proj(self.kernels.silu_mul(self.gate_up(x), torch.get_num_threads()))


def _gated(mlp: nn.Module, matmul: NativeMatmul | None) -> NativeLinear | None:
    """gate|up and SiLU-and-multiply as one native matmul, where the kernel takes them."""
    if matmul is None or not NativeLinear.fits(mlp.gate_proj.weight, gated=True):
        return None
    return NativeLinear(mlp.gate_proj.weight, mlp.gate_proj.bias, matmul, up=mlp.up_proj)


def _rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama's RMSNorm, op for op (float32 parity)."""
    dtype = x.dtype
    x = x.to(torch.float32)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class LeanDecoderLayer(nn.Module):
    """A Llama-family decoder layer's forward, in few calls: RMSNorm -> q|k|v matmul ->
    rotary -> paged attention -> o_proj + residual -> RMSNorm -> gate|up matmul -> SiLU
    and multiply -> down + residual. Native kernels for the element-wise steps in
    bfloat16; torch's ops in the model's own order otherwise."""

    def __init__(self, layer: nn.Module, kernels: NativeLayers | None, pack: bool, fuse: bool,
                 matmul: NativeMatmul | None = None) -> None:
        super().__init__()
        self._take_shape(layer)
        attn, mlp = layer.self_attn, layer.mlp
        self.qkv = FusedLinear([attn.q_proj, attn.k_proj, attn.v_proj], pack, matmul) if fuse else None
        self.gated = _gated(mlp, matmul) if fuse else None
        if self.gated is not None:      # gate|up, silu and "*"; "+ residual" in the native matmul's epilogue
            self.gate_up = None
        elif pack:         # silu(gate) and "* silu(gate)", "+ residual" all in oneDNN epilogues
            self.gate_proj = _linear(mlp.gate_proj.weight, mlp.gate_proj.bias, pack)
            self.up_proj = _linear(mlp.up_proj.weight, mlp.up_proj.bias, pack)
            self.gate_up = None
        else:
            self.gate_up = FusedLinear([mlp.gate_proj, mlp.up_proj], pack) if fuse else None
        if not fuse:                                   # float32 where a fused matmul is not bit-exact
            self.q_proj, self.k_proj, self.v_proj = attn.q_proj, attn.k_proj, attn.v_proj
            self.gate_proj, self.up_proj = mlp.gate_proj, mlp.up_proj
        self.o_proj = _linear(attn.o_proj.weight, attn.o_proj.bias, pack, matmul)
        self.down_proj = _linear(mlp.down_proj.weight, mlp.down_proj.bias, pack, matmul)
        # Tensor parallelism (parallel.py): o and down make partial sums, added over the
        # ranks; the residual joins on one rank (`adds_residual`), in its epilogue.
        self.reduce = getattr(layer, "pdserve_reduce", None)
        self.adds_residual = getattr(layer, "pdserve_adds_residual", True)
        # Epilogue form: "+ residual" (and the gating) inside the matmuls.
        self.pack = (pack or self.gated is not None) and all(hasattr(m, "then") for m in (self.o_proj, self.down_proj))
        object.__setattr__(self, "kernels", kernels)

    def _take_shape(self, layer: nn.Module) -> None:
        attn = layer.self_attn
        self.layer_idx = attn.layer_idx
        self.head_dim = attn.head_dim
        self.scaling = attn.scaling
        self.num_heads = attn.q_proj.out_features // attn.head_dim
        self.num_kv_heads = attn.k_proj.out_features // attn.head_dim
        self.norm_weights = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
        self.eps = (float(layer.input_layernorm.variance_epsilon), float(layer.post_attention_layernorm.variance_epsilon))

    def _norm(self, x: torch.Tensor, i: int) -> torch.Tensor:
        if self.kernels is not None:
            return self.kernels.rms_norm(x, self.norm_weights[i], self.eps[i], torch.get_num_threads())
        return _rms_norm_torch(x, self.norm_weights[i], self.eps[i])

    def _attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, position_embeddings,
                   pdserve_batch) -> torch.Tensor:
        """Rotary then paged attention over this layer's q, k, v ([1, tokens, heads *
        dim] each; q and k are rotated in place where the kernels do it); returns [1,
        tokens, heads * dim]."""
        tokens = q.shape[1]
        q = q.view(1, tokens, self.num_heads, self.head_dim)
        k = k.view(1, tokens, self.num_kv_heads, self.head_dim)
        v = v.view(1, tokens, self.num_kv_heads, self.head_dim)
        cos, sin = position_embeddings
        if self.kernels is not None:                # in place: q and k are this layer's own
            threads = torch.get_num_threads()
            self.kernels.rotary_(q[0], cos[0], sin[0], threads)
            self.kernels.rotary_(k[0], cos[0], sin[0], threads)
            q, k = q.transpose(1, 2), k.transpose(1, 2)
        else:
            q, k = q.transpose(1, 2), k.transpose(1, 2)
            cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
            q, k = (q * cos) + (_rotate_half(q) * sin), (k * cos) + (_rotate_half(k) * sin)
        out, _ = paged_attention(self, q, k, v.transpose(1, 2), None, scaling=self.scaling,
                                 pdserve_batch=pdserve_batch)
        return out.reshape(1, tokens, -1)

    def forward(self, hidden_states: torch.Tensor, position_embeddings=None, pdserve_batch=None, **_):
        x = self._norm(hidden_states, 0)
        if self.qkv is not None:
            q, k, v = self.qkv.linear(x).split(self.qkv.sizes, dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        out = self._attention(q, k, v, position_embeddings, pdserve_batch)
        if self.pack:
            hidden_states = self._plus(self.o_proj, out, hidden_states)
            x = self._norm(hidden_states, 1)
            x = self.gated(x) if self.gated is not None else self.up_proj.then(x, self.gate_proj(x, "swish"), "mul")
            return self._plus(self.down_proj, x, hidden_states)
        hidden_states = hidden_states + self._summed(self.o_proj(out))
        x = self._norm(hidden_states, 1)
        if self.gated is not None:
            x = self.gated(x)
        elif self.gate_up is not None:
            gate_up = self.gate_up.linear(x)
            if self.kernels is not None:
                x = self.kernels.silu_mul(gate_up, torch.get_num_threads())
            else:
                gate, up = gate_up.split(self.gate_up.sizes, dim=-1)
                x = F.silu(gate) * up
        else:
            x = F.silu(self.gate_proj(x)) * self.up_proj(x)
        return hidden_states + self._summed(self.down_proj(x))

    def _plus(self, linear: nn.Module, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """linear(x) + residual, the add in the matmul's epilogue; under tensor
        parallelism summed over the ranks, the residual added on one of them."""
        if self.reduce is None:
            return linear.then(x, residual, "add")
        return self.reduce(linear.then(x, residual, "add") if self.adds_residual else linear(x))

    def _summed(self, partial: torch.Tensor) -> torch.Tensor:
        """A row-parallel product summed over the tensor-parallel ranks (itself alone)."""
        return partial if self.reduce is None else self.reduce(partial)


def lean_compatible(layer: nn.Module) -> bool:
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    names = ("q_proj", "k_proj", "v_proj", "o_proj")
    return (type(layer).__name__ in LEAN_LAYERS and attn is not None and mlp is not None
            and all(isinstance(getattr(attn, n, None), nn.Linear) for n in names)
            and not hasattr(attn, "q_norm") and not getattr(attn, "sliding_window", None)
            and type(mlp).__name__ in SILU_MLPS and _silu(mlp)
            and type(layer.input_layernorm).__name__ in RMS_NORMS
            and type(layer.post_attention_layernorm).__name__ in RMS_NORMS)


def _exact_in_float32(linears: list[nn.Linear]) -> bool:
    """Whether one matmul over the concatenated weights gives the separate products bit
    for bit here (BLAS libraries may block the reduction differently by shape)."""
    weight = torch.cat([lin.weight for lin in linears])
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for rows in (1, 5, 64, 300):
            x = torch.randn(rows, linears[0].in_features, generator=gen, dtype=weight.dtype).to(weight.device)
            fused = F.linear(x, weight).split([lin.out_features for lin in linears], dim=-1)
            if not all(torch.equal(f, F.linear(x, lin.weight)) for f, lin in zip(fused, linears)):
                return False
    return True


def _silu(mlp: nn.Module) -> bool:
    act = getattr(mlp, "act_fn", None)
    return type(act).__name__ in ("SiLU", "SiLUActivation") or act is F.silu


def apply(model: nn.Module, layers, pack: bool, matmul: NativeMatmul | None) -> list[str]:
    """Swap faster equivalents into `model` (in place), with the kernels its backend
    chose (backends.py): `layers`, element-wise kernels (`NativeLayers`,
    `gpu_kernels.TritonLayers`; None: torch's ops); `pack`, bfloat16 weights laid out
    for oneDNN; `matmul`, pdserve's own matmul for every linear layer it takes. Returns
    what was applied."""
    dtype = model.dtype
    applied: set[str] = set()
    qkv = FUSED_PROJECTIONS[0]
    owners = [m for m in model.modules() if all(isinstance(getattr(m, n, None), nn.Linear) for n in qkv)]
    # The native matmul sums each output column alone, in one k order: fused is exact.
    fuse = (dtype != torch.float32 or matmul is not None or not owners
            or _exact_in_float32([getattr(owners[0], n) for n in qkv]))
    for module in list(model.modules()):
        if lean_compatible(module):
            replace(model, module, LeanDecoderLayer(module, layers, pack, fuse, matmul))
            applied.add("lean decoder layers")
    for module in list(model.modules()):
        if layers is not None and type(module).__name__ in SILU_MLPS and _silu(module):
            replace(model, module, NativeSiluMLP(module, layers, pack, matmul))
            applied.add("gate|up+silu")
            continue
        if layers is not None and type(module).__name__ in RMS_NORMS:
            replace(model, module, NativeRMSNorm(module, layers))
            applied.add(f"{layers.name} rmsnorm")
            continue
        for names in FUSED_PROJECTIONS if fuse else ():
            parts = [getattr(module, n, None) for n in names]
            if not all(isinstance(p, nn.Linear) for p in parts):
                continue
            if len({p.in_features for p in parts}) != 1 or len({p.bias is None for p in parts}) != 1:
                continue
            fused = FusedLinear(parts, pack, matmul)
            setattr(module, "_".join(n.split("_")[0] for n in names) + "_fused", fused)
            for i, n in enumerate(names):
                setattr(module, n, ProjectionPart(fused, i))
            applied.add("|".join(n.split("_")[0] for n in names))
    if pack or matmul is not None:
        for parent in list(model.modules()):
            for name, child in list(parent.named_children()):
                if type(child) is nn.Linear:
                    setattr(parent, name, _linear(child.weight, child.bias, pack, matmul))
        kinds = {type(m) for m in model.modules()}
        if NativeLinear in kinds:
            applied.add("native bf16 matmul" if dtype == torch.bfloat16 else "native f32 matmul")
        if PackedLinear in kinds:
            applied.add("packed bf16 weights")
    if dtype == torch.float32 and not fuse:
        log.info("float32 projections stay separate: a fused matmul is not bit-identical on this CPU")
    return sorted(applied)


def replace(model: nn.Module, old: nn.Module, new: nn.Module) -> None:
    """Put `new` where `old` is among `model`'s modules."""
    for parent in model.modules():
        for name, child in parent.named_children():
            if child is old:
                setattr(parent, name, new)
                return
