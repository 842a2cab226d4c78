"""The GPU's FP8 layers, exercised on the CPU up to the matmul call; the kernels on a GPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from qworker.models.loader import _build, _iter_safetensors, _safetensors_files
from qworker.models.quant import plan_quantization, weight_bytes
from qworker.models.quant.fp8 import (
    FP8,
    dequantize_weight,
    fake_quant_per_token,
    quantize_act_per_token,
    quantize_weight_per_channel,
)
from qworker.models.quant.fp8_experts import Fp8FusedExperts
from qworker.models.quant.fp8_linear import (
    ActQuantFusedLinear,
    ActQuantLinear,
    Fp8FusedLinear,
    Fp8Linear,
)
from qworker.models.quant.fp8_mm import MatmulKind, reference_mm
from qworker.models.quant.scheme import ActQuant
from tests.fixtures.models import make_tiny_model_dir
from tests.models.paged import PagedRunner, random_prompts
from tests.models.quant.checkpoints import block_quantize, write_block_fp8


def test_partial_blocks_dequantize_as_computed_by_hand() -> None:
    # 200 x 130 in 128 x 128 blocks: a 2 x 2 grid whose last row and column are partial.
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(200, 130, generator=gen)
    w8, grid = block_quantize(w, (128, 128))
    assert grid.shape == (2, 2)
    got = dequantize_weight(w8, grid, torch.float32, (128, 128))
    for (r, c) in [(0, 0), (127, 127), (128, 0), (199, 129), (5, 128)]:
        want = float(w8[r, c].float()) * float(grid[r // 128, c // 128])
        assert float(got[r, c]) == pytest.approx(want, rel=1e-6)
    assert float((got - w).abs().max()) < 0.07 * float(w.abs().max())


def test_per_token_activation_quantization_round_trips_within_fp8_precision() -> None:
    x = torch.randn(6, 64) * torch.tensor([1e-3, 1.0, 30.0, 1.0, 1.0, 0.0]).unsqueeze(1)
    x8, scales = quantize_act_per_token(x)
    assert x8.dtype == FP8 and scales.shape == (6, 1)
    back = x8.float() * scales
    torch.testing.assert_close(back, fake_quant_per_token(x), rtol=1e-6, atol=0)
    rel = ((back - x).abs().amax(1) / x.abs().amax(1).clamp(min=1e-30))[:5]
    assert float(rel.max()) <= 2**-4  # e4m3: 3 mantissa bits
    assert torch.all(back[5] == 0)


def _fp8_model(model_dir: Path, mode: str, kind: MatmulKind) -> torch.nn.Module:
    """The GPU's FP8 model built and loaded on the CPU, its kernels replaced by the
    fp32 reference of what they compute."""
    import json

    from transformers import AutoConfig

    raw = json.loads((model_dir / "config.json").read_text())
    files = _safetensors_files(model_dir)
    quant = plan_quantization(raw, mode, torch.float32, torch.device("cpu"), files)
    assert quant is not None
    quant.keep_fp8 = True  # the GPU's layout
    quant.fp8_experts = True
    config = AutoConfig.from_pretrained(str(model_dir))
    model = _build(raw["architectures"][0], config, torch.float32, torch.device("cpu"), quant)
    model.load_weights(quant.adapt(_iter_safetensors(files)))
    for m in model.modules():
        if isinstance(m, Fp8FusedLinear):
            m.kind, m.use_reference = kind, True
        if isinstance(m, Fp8FusedExperts):
            m.use_reference = True
    return model.eval()


def test_fp8_moe_experts_up_to_the_grouped_kernel_match_the_cpu_form(tmp_path: Path) -> None:
    """Online FP8 on a Qwen3-MoE: the GPU layout (FP8 experts with per-channel scales, the
    grouped W8A8 call with the reference in place of the kernel) computes what the CPU
    form (per-channel QDQ weights, per-token QDQ inputs) does, and neither is the dense
    model."""
    from qworker.models.loader import load_model
    from qworker.models.quant.fp8_experts import ActQuantFusedExperts

    model_dir = make_tiny_model_dir("qwen3_moe", tmp_path / "m", seed=46)
    gpu_form = _fp8_model(model_dir, "fp8", MatmulKind.ROWWISE)
    experts = gpu_form.model.layers[0].mlp.experts
    assert isinstance(experts, Fp8FusedExperts) and experts.gate_up_proj.dtype == FP8
    cpu_form = load_model(model_dir, torch.float32, "cpu", quantization="fp8").model
    assert isinstance(cpu_form.model.layers[1].mlp.experts, ActQuantFusedExperts)
    dense = load_model(model_dir, torch.float32, "cpu").model
    prompt = random_prompts([23], 512)[0]
    a = PagedRunner(gpu_form).step({0: prompt})[0]
    b = PagedRunner(cpu_form).step({0: prompt})[0]
    c = PagedRunner(dense).step({0: prompt})[0]
    assert float((a - b).abs().max()) < 1e-3
    assert float((b - c).abs().max()) > 1e-3


@pytest.mark.parametrize(
    ("mode", "block", "kind"),
    [("fp8", None, MatmulKind.ROWWISE), ("fp8", None, MatmulKind.DEQUANT),
     ("auto", (16, 16), MatmulKind.DEQUANT)],
    ids=["online-rowwise-w8a8", "online-w8a16", "block-checkpoint-dequant-per-block"])
def test_fp8_layers_up_to_the_kernel_match_the_cpu_form(
    mode: str, block: tuple[int, int] | None, kind: MatmulKind, tmp_path: Path
) -> None:
    """The GPU layout (FP8 weights, per-channel or fused block-scale grids, the W8A8 call
    with the reference in place of ``_scaled_mm``, or the W8A16 fallback) computes what
    the CPU form computes (W8A16 against the dequantized weights, activations unquantized,
    so that comparison uses the CPU form under ``quantization="none"``)."""
    from qworker.models.loader import load_model

    dense = make_tiny_model_dir("qwen2", tmp_path / "dense", seed=43)
    model_dir = write_block_fp8(dense, tmp_path / "fp8", block) if block else dense
    gpu_form = _fp8_model(model_dir, mode, kind)
    layer = gpu_form.model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj, Fp8FusedLinear)
    assert isinstance(layer.self_attn.o_proj, Fp8Linear)
    assert layer.self_attn.qkv_proj.weight.dtype == FP8
    assert layer.self_attn.qkv_proj.bias.dtype == torch.float32  # Qwen2's q/k/v biases
    if kind is MatmulKind.ROWWISE:
        cpu_form = load_model(model_dir, torch.float32, "cpu", quantization=mode).model
    else:  # W8A16: the quantized weights, unquantized activations
        cpu_form = load_model(model_dir, torch.float32, "cpu", quantization=mode).model
        for m in cpu_form.modules():
            if isinstance(m, ActQuantFusedLinear | ActQuantLinear):
                m.act = ActQuant.NONE
    prompt = random_prompts([21], 512)[0]
    a = PagedRunner(gpu_form).step({0: prompt})[0]
    b = PagedRunner(cpu_form).step({0: prompt})[0]
    assert float((a - b).abs().max()) < 1e-3


def test_block_w8a8_layer_quantizes_activations_per_group_and_fuses_block_grids() -> None:
    """A fused q/k/v layer with 16 x 16 block weights on the W8A8 block path (reference in
    place of the kernel) equals dequantized weights applied to per-group QDQ activations."""
    from qworker.models.quant.fp8 import fake_quant_per_group
    from qworker.models.quant.scheme import Fp8Scheme, WeightScales

    scheme = Fp8Scheme("fp8", WeightScales.BLOCK, ActQuant.DYNAMIC_GROUP, block=(16, 16),
                       group_size=16, scale_name="weight_scale_inv")
    gen = torch.Generator().manual_seed(3)
    shards = {"q": 64, "k": 32, "v": 32}
    layer = Fp8FusedLinear(48, shards, False, scheme, torch.float32)
    dense = []
    for shard, rows in shards.items():
        w = torch.randn(rows, 48, generator=gen)
        w8, grid = block_quantize(w, (16, 16))
        layer.load_shard(shard, "weight", w8)
        layer.load_shard(shard, "weight_scale", grid)
        dense.append(dequantize_weight(w8, grid, torch.float32, (16, 16)))
    layer.kind, layer.use_reference = MatmulKind.BLOCKWISE, True
    x = torch.randn(5, 48, generator=gen)
    want = fake_quant_per_group(x, 16) @ torch.cat(dense).t()
    torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-4)


def test_fp8_weights_take_about_half_the_bytes_of_bf16(tmp_path: Path) -> None:
    import json

    from transformers import AutoConfig

    model_dir = make_tiny_model_dir("llama", tmp_path / "m", seed=44, hidden_size=256,
                                    intermediate_size=1024, num_attention_heads=8,
                                    num_key_value_heads=4, head_dim=32, vocab_size=512)
    raw = json.loads((model_dir / "config.json").read_text())
    config = AutoConfig.from_pretrained(str(model_dir))
    sizes = {}
    for mode in ("none", "fp8"):
        quant = plan_quantization(raw, mode, torch.bfloat16, torch.device("meta"))
        if quant is not None:
            quant.keep_fp8 = True
        sizes[mode] = weight_bytes(_build(raw["architectures"][0], config, torch.bfloat16,
                                          torch.device("meta"), quant))
    weights = 2 * (256 * (256 + 2 * 128) + 256 * 256 + 3 * 256 * 1024)
    scale_rows = 2 * ((256 + 2 * 128) + 256 + 2 * 1024 + 256)
    # one byte saved per layer weight, four spent per output row's fp32 scale
    assert sizes["none"] - sizes["fp8"] == weights - 4 * scale_rows
    assert sizes["fp8"] / sizes["none"] < 0.6


@pytest.mark.gpu
def test_scaled_mm_kernels_match_the_dequantized_reference() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from qworker.models.quant.fp8 import quantize_act_per_group
    from qworker.models.quant.fp8_mm import blockwise_kernel, rowwise_available, rowwise_mm

    dev = torch.device("cuda")
    gen = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(37, 512, generator=gen).to(dev, torch.bfloat16)
    w = torch.randn(384, 512, generator=gen).to(dev) * 0.05
    bias = torch.randn(384, generator=gen).to(dev, torch.bfloat16)
    if rowwise_available(dev, torch.bfloat16):
        w8, sw = quantize_weight_per_channel(w)
        x8, sx = quantize_act_per_token(x)
        got = rowwise_mm(x8, sx, w8, sw, bias, torch.bfloat16).float()
        want = reference_mm(x8, sx, w8, sw, None, bias, torch.float32)
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2 * float(want.abs().max()))
    kernel = blockwise_kernel(dev)
    if kernel is not None:
        w8, grid = block_quantize(w.cpu(), (128, 128))
        w8, grid = w8.to(dev), grid.to(dev)
        x8, sx = quantize_act_per_group(x, 128)
        got = kernel(x8, sx, w8, grid, torch.bfloat16).float()
        want = reference_mm(x8, sx, w8, grid, (128, 128), None, torch.float32)
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2 * float(want.abs().max()))


@pytest.mark.gpu
def test_scaled_grouped_kernel_matches_the_reference_when_torch_has_one() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from qworker.models.quant.fp8_mm import grouped_kernel, reference_grouped_mm

    dev = torch.device("cuda")
    kernel = grouped_kernel(dev)
    if kernel is None:
        pytest.skip("no scaled grouped kernel in this torch: experts stay bf16 (logged)")
    gen = torch.Generator(device="cpu").manual_seed(1)
    x = torch.randn(70, 512, generator=gen).to(dev, torch.bfloat16)
    w = torch.randn(8, 256, 512, generator=gen).to(dev) * 0.05
    sw = w.abs().amax(dim=2) / 448
    w8 = (w / sw.unsqueeze(2)).to(FP8)
    x8, sx = quantize_act_per_token(x)
    offs = torch.tensor([0, 9, 9, 30, 31, 50, 64, 70], dtype=torch.int32, device=dev)
    got = kernel(x8, sx, w8, sw, offs, torch.bfloat16).float()
    want = reference_grouped_mm(x8, sx, w8, sw, offs, torch.float32)
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2 * float(want.abs().max()))


@pytest.mark.gpu
def test_fp8_model_on_the_gpu_tracks_its_cpu_emulation(tmp_path: Path) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from qworker.models.loader import load_model

    model_dir = make_tiny_model_dir("llama", tmp_path / "m", seed=45)
    gpu = load_model(model_dir, torch.bfloat16, "cuda", quantization="fp8").model
    cpu = load_model(model_dir, torch.float32, "cpu", quantization="fp8").model
    assert any(isinstance(m, Fp8FusedLinear) for m in gpu.modules())
    prompt = random_prompts([19], 512)[0]
    a = PagedRunner(gpu).step({0: prompt})[0].float().cpu()
    b = PagedRunner(cpu).step({0: prompt})[0]
    assert float((a - b).abs().max()) < 0.1 * float(b.abs().max())
