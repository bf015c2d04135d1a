"""Native CPU kernels, built on first use with the machine's C compiler.

`attention.c` runs decode attention straight from the paged KV cache, and causal
prefill attention in bfloat16 on CPUs with AVX512-BF16; `matmul.c` the matmuls
themselves, bfloat16 on those CPUs, uint8 x int8 on CPUs with AVX512-VNNI and float32 on
CPUs with AVX2 and FMA; `layers.c` the element-wise work around the matmuls (RMSNorm,
SiLU-and-multiply; with int8 weights, quantizing activations per token and scaling
products back) in one pass each; `decoder.c` a decode step's decoder layers through
those kernels in one call (bfloat16).

Each .c has its Python side in the module of the same name (`NativeAttention`,
`NativeLayers`, `NativeMatmul`, `NativeDecoder`). `pdserve_kernels.h` declares every
function they export, once: the compiler checks each definition against it, and
header.py reads the ctypes types from it. library.py builds each source for the CPU it
runs on (-march=native) into the cache directory, under a name keyed by its source,
headers, flags, compiler and CPU, so a cache shared between machines never hands one
machine another's build; building takes about a second. Where there is no compiler (or
the build fails) the loaders raise `NativeBuildError` and the engine keeps torch's own
ops.
"""
from __future__ import annotations

from pathlib import Path

from services.engine.kernels.native.attention import NativeAttention
from services.engine.kernels.native.decoder import DecoderLayerWeights, NativeDecoder
from services.engine.kernels.native.layers import NativeLayers
from services.engine.kernels.native.library import NativeBuildError, build, kernel_dir
from services.engine.kernels.native.matmul import NativeMatmul

__all__ = ["DecoderLayerWeights", "NativeAttention", "NativeBuildError", "NativeDecoder", "NativeLayers",
           "NativeMatmul", "load_attention", "load_decoder", "load_layers", "load_matmul"]

SOURCE = Path(__file__).with_name("attention.c")
LAYERS_SOURCE = Path(__file__).with_name("layers.c")
MATMUL_SOURCE = Path(__file__).with_name("matmul.c")
DECODER_SOURCE = Path(__file__).with_name("decoder.c")


def load_attention(cache_root: Path) -> NativeAttention:
    """Build (once per machine and source) and load the attention kernels."""
    return NativeAttention(build(SOURCE, kernel_dir(cache_root)))


def load_layers(cache_root: Path) -> NativeLayers:
    """Build (once per machine and source) and load the layer kernels."""
    return NativeLayers(build(LAYERS_SOURCE, kernel_dir(cache_root)))


def load_decoder(cache_root: Path) -> Path:
    """Build (once per machine and source) the one-call decoder layers; the library's
    path, for `NativeDecoder`."""
    return build(DECODER_SOURCE, kernel_dir(cache_root))


def load_matmul(cache_root: Path) -> NativeMatmul:
    """Build (once per machine and source) and load the matmuls; NativeBuildError where
    this CPU has none of AVX512-BF16, AVX512-VNNI or AVX2 with FMA for them (`bf16`,
    `int8` and `f32` say which it has)."""
    matmul = NativeMatmul(build(MATMUL_SOURCE, kernel_dir(cache_root)))
    if not (matmul.bf16 or matmul.int8 or matmul.f32):
        raise NativeBuildError("the native matmuls need AVX512-BF16 (bfloat16), AVX512-VNNI (int8) or AVX2 "
                               "with FMA (float32)")
    return matmul
