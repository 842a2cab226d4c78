"""The FP8 KV cache pieces of ``qworker/attention/fp8.py`` and their use by the torch reference
and the CUDA backend's cache ops (emulated): scales per layer, calibration by the first real
write, quantization byte-exact against torch's E4M3, pool sizing, copy and swap."""

from __future__ import annotations

import pytest
import torch

from qworker.attention.backend import KVCache
from qworker.attention.cuda_backend import CudaAttentionBackend
from qworker.attention.fp8 import (
    FP8_DTYPE,
    FP8_MAX,
    HEADROOM,
    dequantize,
    kv_storage_dtype,
    layer_scales,
    quantize,
    resolve_scales,
)
from qworker.attention.torch_ref import TorchAttentionBackend

REF = TorchAttentionBackend()


def test_kv_storage_dtype_maps_the_config_values() -> None:
    assert kv_storage_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert kv_storage_dtype("fp8_e4m3", torch.float16) == FP8_DTYPE
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        kv_storage_dtype("int4", torch.float16)


def test_quantize_round_trip_error_is_within_e4m3_precision() -> None:
    x = torch.randn(10000) * 3
    scale = x.abs().max() * HEADROOM / FP8_MAX
    back = dequantize(quantize(x, scale), scale, torch.float32)
    normal = x.abs() >= scale * 2.0**-6  # E4M3 normals: 3 mantissa bits
    assert bool(((back - x).abs()[normal] <= x.abs()[normal] * 2.0**-4).all())
    assert bool(((back - x).abs()[~normal] <= scale * 2.0**-10).all())  # subnormal step / 2
    assert float(quantize(torch.tensor([1e9]), 1.0).float()) == FP8_MAX  # saturates


def test_fp8_pool_sizes_one_byte_per_element_and_finds_its_layers() -> None:
    assert KVCache.bytes_per_block(4, 8, 16, 128, FP8_DTYPE) * 2 == KVCache.bytes_per_block(
        4, 8, 16, 128, torch.bfloat16
    )
    pool = KVCache.allocate(3, 10, 2, 8, 32, FP8_DTYPE, "cpu")
    assert pool.scales is not None and pool.scales.values.shape == (3, 2)
    for layer in range(3):
        found = layer_scales(pool.key[layer])
        assert found is not None and found[0] is pool.scales and found[1] == layer
    assert layer_scales(torch.zeros(10, 2, 8, 32, dtype=FP8_DTYPE)) is None
    assert KVCache.allocate(1, 4, 1, 8, 16, torch.bfloat16, "cpu").scales is None
    with pytest.raises(ValueError, match="scales"):
        resolve_scales(torch.zeros(10, 2, 8, 32, dtype=FP8_DTYPE), None)


def test_first_real_write_calibrates_once_and_padding_is_ignored() -> None:
    pool = KVCache.allocate(2, 8, 2, 8, 16, FP8_DTYPE, "cpu")
    key = torch.randn(4, 2, 16)
    value = torch.randn(4, 2, 16) * 0.1
    key[3] = 1e4  # a padding row (slot -1) must not set the scale
    only_padding = torch.tensor([-1, -1, -1, -1])
    REF.write_kv(key, value, pool.key[1], pool.value[1], only_padding)
    assert not pool.scales.calibrated[1]
    REF.write_kv(key, value, pool.key[1], pool.value[1], torch.tensor([0, 9, 17, -1]))
    want = torch.stack([key[:3].abs().max(), value[:3].abs().max()]) * HEADROOM / FP8_MAX
    assert torch.allclose(pool.scales.values[1], want)
    assert pool.scales.calibrated == [False, True]
    REF.write_kv(key * 100, value, pool.key[1], pool.value[1], torch.tensor([1, 2, 3, 4]))
    assert torch.allclose(pool.scales.values[1], want)  # fixed after the first real write
    stored = pool.key[1].view(torch.uint8)[1, :, 1]  # slot 9: block 1, row 1
    assert torch.equal(stored, quantize(key[1], want[0]).view(torch.uint8))


def test_reference_copy_and_swap_move_fp8_bytes() -> None:
    pool = KVCache.allocate(2, 6, 2, 8, 16, FP8_DTYPE, "cpu")
    pool.key.view(torch.uint8).random_(0, 255)
    pool.value.view(torch.uint8).random_(0, 255)
    before = pool.key.view(torch.uint8).clone()
    REF.copy_blocks(pool, torch.tensor([1, 2]), torch.tensor([4, 5]))
    assert torch.equal(pool.key.view(torch.uint8)[:, 4:6], before[:, 1:3])
    host = KVCache.allocate(2, 3, 2, 8, 16, FP8_DTYPE, "cpu")
    REF.swap_blocks(pool, host, torch.tensor([0, 3]), torch.tensor([2, 0]))
    assert torch.equal(host.value.view(torch.uint8)[:, 2], pool.value.view(torch.uint8)[:, 0])
    assert torch.equal(host.key.view(torch.uint8)[:, 0], pool.key.view(torch.uint8)[:, 3])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_emulated_fp8_cache_write_is_byte_exact(emu_kernels, dtype: torch.dtype) -> None:  # type: ignore[no-untyped-def]
    got = KVCache.allocate(2, 9, 3, 16, 32, FP8_DTYPE, "cpu")
    want = KVCache.allocate(2, 9, 3, 16, 32, FP8_DTYPE, "cpu")
    gen = torch.Generator().manual_seed(2)
    # keys sliced out of a fused projection (rows strided), values contiguous
    fused = (torch.randn(7, 3 * 32 * 2, generator=gen) * 4).to(dtype)
    key = fused[:, : 3 * 32].view(7, 3, 32)
    value = fused[:, 3 * 32 :].reshape(7, 3, 32) * 0.05
    slots = torch.tensor([5, 16, 40, -1, 100, 127, 0])
    backend = CudaAttentionBackend(kernels=emu_kernels(), num_sms=4)
    for layer in (0, 1):
        backend.write_kv(key, value, got.key[layer], got.value[layer], slots)
        REF.write_kv(key, value, want.key[layer], want.value[layer], slots)
    assert torch.equal(got.scales.values, want.scales.values)
    assert torch.equal(got.key.view(torch.uint8), want.key.view(torch.uint8))
    assert torch.equal(got.value.view(torch.uint8), want.value.view(torch.uint8))


def test_emulated_fp8_copy_blocks_moves_bytes(emu_kernels) -> None:  # type: ignore[no-untyped-def]
    pool = KVCache.allocate(2, 6, 2, 8, 16, FP8_DTYPE, "cpu")
    pool.key.view(torch.uint8).random_(0, 255)
    pool.value.view(torch.uint8).random_(0, 255)
    want = KVCache(pool.key.clone(), pool.value.clone())
    CudaAttentionBackend(kernels=emu_kernels(), num_sms=4).copy_blocks(
        pool, torch.tensor([1, 2]), torch.tensor([4, 0])
    )
    REF.copy_blocks(want, torch.tensor([1, 2]), torch.tensor([4, 0]))
    assert torch.equal(pool.key.view(torch.uint8), want.key.view(torch.uint8))
    assert torch.equal(pool.value.view(torch.uint8), want.value.view(torch.uint8))


def test_engine_with_an_fp8_cache_fits_twice_the_blocks_and_generates(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from qworker.engine.llm import LLM
    from qworker.engine.sampling_params import SamplingParams
    from tests.fixtures.models import make_tiny_model_dir

    model = make_tiny_model_dir("llama", tmp_path / "m", num_key_value_heads=2)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = [[5, 9, 13, 2, 77], [100, 3] * 20]
    blocks, tokens = {}, {}
    for kv in ("auto", "fp8_e4m3"):
        llm = LLM(str(model), dtype="float32", device="cpu", kv_cache_dtype=kv,
                  kv_cache_memory=1 << 20, block_size=16)  # fmt: skip
        stats = llm.stats()
        blocks[kv] = stats["num_kv_blocks"]
        assert stats["kv_cache_dtype"] == kv
        runner = llm.engine.runner
        assert runner.kv_cache.key.dtype == (FP8_DTYPE if kv != "auto" else torch.float32)
        outs = llm.generate(prompts, params, use_tqdm=False)
        tokens[kv] = [list(o.outputs[0].token_ids) for o in outs]
        if kv != "auto":
            assert all(runner.kv_cache.scales.calibrated)
    assert blocks["fp8_e4m3"] == 4 * blocks["auto"]  # 1 byte per element instead of 4 (fp32)
    assert all(len(t) == 12 for t in tokens["fp8_e4m3"])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gpu_fp8_cache_write_is_byte_exact_and_copies_and_swaps(dtype: torch.dtype) -> None:
    # Also pins cvt.rn.satfinite.e4m3x2.f32's operand order (which byte gets which input).
    got = KVCache.allocate(2, 64, 8, 16, 128, FP8_DTYPE, "cuda")
    want = KVCache.allocate(2, 64, 8, 16, 128, FP8_DTYPE, "cuda")
    fused = (torch.randn(50, 2 * 8 * 128, device="cuda") * 3).to(dtype)
    key = fused[:, : 8 * 128].view(50, 8, 128)
    value = fused[:, 8 * 128 :].reshape(50, 8, 128)
    value[0, 0, :4] = torch.tensor([1e6, -1e6, 0.0, 1e-30], dtype=dtype)  # saturation, zeros
    slots = torch.randperm(64 * 16, device="cuda")[:50]
    slots[7] = -1
    backend = CudaAttentionBackend()
    for layer in (0, 1):
        backend.write_kv(key, value, got.key[layer], got.value[layer], slots)
        REF.write_kv(key, value, want.key[layer], want.value[layer], slots)
    torch.cuda.synchronize()
    assert torch.equal(got.scales.values, want.scales.values)
    assert torch.equal(got.key.view(torch.uint8), want.key.view(torch.uint8))
    assert torch.equal(got.value.view(torch.uint8), want.value.view(torch.uint8))
    backend.copy_blocks(
        got, torch.tensor([1, 5], device="cuda"), torch.tensor([60, 61], device="cuda")
    )
    assert torch.equal(got.key.view(torch.uint8)[:, 60], got.key.view(torch.uint8)[:, 1])
    host = KVCache.allocate(2, 8, 8, 16, 128, FP8_DTYPE, "cpu", pin_memory=True)
    backend.swap_blocks(got, host, torch.tensor([5, 9]), torch.tensor([0, 7]))
    assert torch.equal(host.value.view(torch.uint8)[:, 7], got.value.view(torch.uint8)[:, 9].cpu())
    back = KVCache.allocate(2, 64, 8, 16, 128, FP8_DTYPE, "cuda")
    backend.swap_blocks(host, back, torch.tensor([0, 7]), torch.tensor([5, 9]))
    torch.cuda.synchronize()
    assert torch.equal(back.key.view(torch.uint8)[:, 5], got.key.view(torch.uint8)[:, 5])
