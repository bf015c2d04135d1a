"""`--quantization int8`: the native kernels around the int8 matmuls against torch
references (per-token quantization, RMSNorm into it, scaling back with bias and
residual, SiLU-and-multiply into it), one int8 linear layer against its float product,
the real model quantized (it follows float32's greedy continuation closely and its KV
is labelled apart), a Qwen2-shaped model's q/k/v biases through the smoothing, a
disaggregated cluster quantized end to end, and the refusals."""
import pytest
import torch
import torch.nn.functional as F

from services.common.settings import EngineSettings
from services.engine.kernels import native
from services.engine.model.int8 import Int8DecoderLayer, Int8Linear
from services.engine.model.hardware import cpu_kernels
from services.engine.model.runner import ModelRunner
from tests.processes import start_cluster, stop_cluster


@pytest.fixture(scope="module")
def layers(kernel_cache):
    return native.load_layers(kernel_cache)


def dequantized(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return (q.float() - 128) * scales[:, None]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_rows_keeps_each_row_within_half_a_step(layers, dtype):
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(37, 600, generator=gen) * torch.logspace(-2, 2, 37)[:, None]).to(dtype)
    x[5] = 0                                     # an all-zero row: scale 1, every value 128
    strided = torch.zeros(37, 700, dtype=dtype)
    strided[:, :600] = x
    q, scales = layers.quantize_rows(strided[:, :600])
    assert q.dtype == torch.uint8 and q.shape == (37, 600) and scales.shape == (37,)
    ref = x.float()
    expected = ref.abs().amax(dim=1) / 127
    assert torch.allclose(scales[torch.arange(37) != 5], expected[torch.arange(37) != 5], rtol=1e-6)
    assert scales[5] == 1 and bool((q[5] == 128).all())
    assert int(q.min()) >= 1 and int(q.max()) <= 255
    assert bool(((dequantized(q, scales) - ref).abs() <= scales[:, None] / 2 * 1.0001).all())


def test_rms_norm_quantize_is_the_norm_then_quantize_in_one_pass(layers):
    gen = torch.Generator().manual_seed(1)
    x, w = torch.randn(19, 576, generator=gen), torch.rand(576, generator=gen) * 3
    q, scales = layers.rms_norm_quantize(x, w, 1e-5)
    q2, scales2 = layers.quantize_rows(layers.rms_norm(x, w, 1e-5))
    assert torch.equal(q, q2) and torch.equal(scales, scales2)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
def test_dequant_rows_scales_back_and_adds_bias_and_residual(layers, dtype, tol):
    gen = torch.Generator().manual_seed(2)
    products, scales = torch.randn(11, 960, generator=gen) * 100, torch.rand(11, generator=gen)
    bias, residual = torch.randn(960, generator=gen).to(dtype), torch.randn(11, 960, generator=gen).to(dtype)
    out = layers.dequant_rows(products, scales, bias, residual, dtype)
    ref = products * scales[:, None] + bias.float() + residual.float()
    assert out.dtype == dtype and torch.allclose(out.float(), ref, rtol=tol, atol=tol)
    bare = layers.dequant_rows(products, scales, None, None, dtype)
    assert torch.allclose(bare.float(), products * scales[:, None], rtol=tol, atol=tol)
    with pytest.raises(ValueError):
        layers.dequant_rows(products.to(torch.bfloat16), scales, None, None, dtype)


def test_silu_mul_quantize_follows_torch(layers):
    gen = torch.Generator().manual_seed(3)
    products, scales = torch.randn(9, 2 * 1536, generator=gen) * 50, torch.rand(9, generator=gen) / 20
    q, out_scales = layers.silu_mul_quantize(products, scales)
    gate, up = (products * scales[:, None]).split(1536, dim=-1)
    ref = F.silu(gate) * up
    assert q.shape == (9, 1536)
    assert bool(((dequantized(q, out_scales) - ref).abs() <= out_scales[:, None] * 0.51).all())


def test_int8_linear_is_within_quantization_error_of_the_float_product(layers):
    gen = torch.Generator().manual_seed(4)
    weight, x = torch.randn(1536, 576, generator=gen) * 0.05, torch.randn(40, 576, generator=gen)
    linear = Int8Linear(weight, None)
    q, scales = layers.quantize_rows(x)
    out = layers.dequant_rows(linear.products(q), scales, None, None, torch.float32)
    ref = x @ weight.t()
    assert float((out - ref).norm() / ref.norm()) < 0.02


def test_int8_products_are_the_exact_integer_sums_on_this_cpu(layers):
    """The u8 x s8 products equal int64 sums of the same integers, scaled: on CPUs without
    VNNI oneDNN adds pairs of products in int16 and would saturate with 8-bit weights."""
    gen = torch.Generator().manual_seed(4)
    weight, x = torch.randn(1536, 576, generator=gen) * 0.05, torch.randn(40, 576, generator=gen)
    linear = Int8Linear(weight, None)
    q, _ = layers.quantize_rows(x)
    levels = torch.round(weight / linear.scale[:, None]).to(torch.int64)
    exact = ((q.to(torch.int64) - 128) @ levels.t()).double() * linear.scale.double()
    assert (linear.products(q).double() - exact).abs().max() <= 1e-6 * exact.abs().max()


@pytest.fixture(scope="module")
def int8_runner(model_dir, kernel_cache):
    return ModelRunner(model_dir, "auto", "cpu", kernel_cache=kernel_cache, quantization="int8")


def test_the_quantized_model_follows_float32_and_labels_its_kv_apart(model_dir, kernel_cache, int8_runner):
    """Calibrated (smoothed) int8 layers in the dtype auto picks: top-1 agreement with
    float32 along its own greedy continuation well above chance (measured ~94 % here,
    bfloat16 alone ~97 %; bench/int8_quality.py), and a compatibility hash of its own,
    so a quantized prefill worker's KV never reaches an unquantized decode worker."""
    from transformers import AutoTokenizer
    from bench.int8_quality import PROMPTS, _chat_ids, continuation, teacher_forced
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = [_chat_ids(tokenizer, p) for p in PROMPTS[:3]]
    reference_runner = ModelRunner(model_dir, "float32", "cpu", kernel_cache=kernel_cache)
    reference = {tuple(ids): continuation(reference_runner, ids, 16) for ids in prompts}
    int8 = int8_runner
    assert "int8 decoder layers (smoothed)" in int8.fusions and "int8 weights" in int8.describe()
    assert ("native int8 matmul" in int8.fusions) == cpu_kernels().int8_matmul
    assert sum(isinstance(m, Int8DecoderLayer) for m in int8.model.modules()) == int8.num_layers
    agree, _ = teacher_forced(int8, reference, prompts)
    assert sum(agree) / len(agree) >= 0.8
    layout = int8.layout(4, 16)
    assert layout.dtype == int8.dtype_name
    assert int8.compat_hash(layout) != reference_runner.compat_hash(layout)   # same layout, unquantized


def test_int8_needs_the_native_kernels_and_a_known_name(model_dir):
    for dtype, attention in (("auto", "torch"), ("float16", "auto")):
        with pytest.raises(ValueError, match="--quantization int8 runs on CPU in float32 or bfloat16"):
            ModelRunner(model_dir, dtype, "cpu", attention=attention, quantization="int8")
    with pytest.raises(ValueError, match="--quantization must be one of none, int8"):
        EngineSettings(quantization="fp8")


@pytest.mark.slow          # int8 is opt-in; its engine is checked above, by default
def test_a_quantized_cluster_serves_what_the_quantized_engine_computes(model_dir, int8_runner):
    """`up --quantization int8`: both workers quantize alike (the router pairs them by
    the compatibility hash), the prompt's KV (its V rows carry the smoothing) crosses
    to the decode worker, and the official client gets, twice, the greedy tokens the
    quantized engine computes in-process (prefilled in one pass, decoded alone, as the
    cluster does it here)."""
    from openai import OpenAI
    from transformers import AutoTokenizer
    from bench.int8_quality import PROMPTS, _chat_ids, continuation
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompt = _chat_ids(tokenizer, PROMPTS[2])
    expected, _ = continuation(int8_runner, prompt, 12)
    assert tokenizer.eos_token_id not in expected              # 12 tokens, no early stop
    c = start_cluster("--quantization", "int8", dtype="auto")
    try:
        client = OpenAI(base_url=f"{c.http}/v1", api_key="unused")
        answers = [client.completions.create(model="SmolLM2-135M-Instruct", prompt=prompt, max_tokens=12,
                                             temperature=0).choices[0].text for _ in range(2)]
        assert answers == [tokenizer.decode(expected)] * 2
        assert c.stats("decode").kv_bytes_received > 0 and c.stats("prefill").prompt_tokens_computed > 0
    finally:
        stop_cluster(c)


def test_a_model_with_qkv_biases_quantizes_close_to_its_float32_self(model_dir, tmp_path, kernel_cache):
    """A small random Qwen2 (q/k/v biases, grouped KV heads; the tokenizer borrowed from
    the default model for calibration): the biases survive the smoothing of v's rows,
    so the int8 model's logits stay close to its own float32 logits."""
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM
    from services.engine.model.kv_cache import KVPoolMemory
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    with torch.no_grad():                        # biases big enough to matter
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5)
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    ids = tokenizer("The quick brown fox jumps over the lazy dog, again and again.")["input_ids"]

    def logits(runner):
        pool = KVPoolMemory.allocate(runner.layout(4, 16))
        try:
            return runner.prefill(pool, ids, [0, 1, 2, 3]).float()
        finally:
            pool.close()
    exact = logits(ModelRunner(tmp_path, "float32", "cpu", kernel_cache=kernel_cache))
    int8 = ModelRunner(tmp_path, "float32", "cpu", kernel_cache=kernel_cache, quantization="int8")
    assert sum(isinstance(m, Int8DecoderLayer) for m in int8.model.modules()) == 2
    assert int8.model.model.layers[0].qkv.bias is not None
    assert float(F.cosine_similarity(logits(int8), exact, dim=0)) > 0.99
