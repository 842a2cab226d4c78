"""The attention self-test (qworker/attention/selftest.py) on the CPU emulator: sound kernels
pass at the shapes asked for (dtype, head size, GQA group, block size, FP8 cache, windows);
each planted fault (a broken decode kernel build, a wrong softmax scale in the prefill kernel,
a cache write that never runs, a kernel that is not there) fails its check, names the kernel,
and the selection falls back to the next path, which passes. On a GPU (``-m gpu``) the same
selection runs with the cupy-compiled kernels at the shapes the engine meets."""

from __future__ import annotations

import pytest
import torch

from qworker.attention.cuda_backend import CudaAttentionBackend
from qworker.attention.fp8 import FP8_DTYPE
from qworker.attention.selftest import (
    BOUNDS,
    SelftestShape,
    decode_cases,
    make_case,
    select_attention,
)
from qworker.attention.torch_ref import TorchAttentionBackend
from qworker.testing.kernel_faults import FaultyKernels, RoutedKernels

CPU = torch.device("cpu")


def _backend(runner) -> CudaAttentionBackend:  # type: ignore[no-untyped-def]
    return CudaAttentionBackend(kernels=runner, num_sms=4)


@pytest.mark.parametrize(
    ("dtype", "kv_dtype", "dim", "q_heads", "kv_heads", "block", "windows", "kernels"),
    [
        (torch.bfloat16, torch.bfloat16, 64, 8, 2, 16, ((None, None),),
         ["reshape_and_cache<16>", "paged_decode_tc<2, 0, 64, 1>", "paged_prefill_tc<2, 0, 64>"]),
        (torch.float16, FP8_DTYPE, 80, 4, 1, 8, ((None, None), (40, 30.0)),
         ["reshape_and_cache_fp8<1>", "paged_decode_tc<1, 1, 80, 1>",
          "paged_prefill_tc<1, 1, 80>"]),
        (torch.float32, torch.float32, 32, 8, 1, 8, ((None, None),),
         ["paged_attention_decode<0, 32, 8>", "paged_attention_reduce<0>"]),
    ],
)
def test_sound_kernels_pass_and_keep_their_paths(  # type: ignore[no-untyped-def]
    emu_kernels, dtype, kv_dtype, dim, q_heads, kv_heads, block, windows, kernels
) -> None:
    backend = _backend(emu_kernels())
    shape = SelftestShape(dtype, kv_dtype, dim, q_heads, kv_heads, block, windows, 512)
    sel = select_attention(backend, shape, CPU)
    assert not sel.fell_back, [c.describe() for c in sel.checks if not c.passed]
    assert isinstance(sel.backend, CudaAttentionBackend)
    assert sel.backend.paths(dtype, kv_dtype, dim, q_heads, kv_heads, block) == backend.paths(
        dtype, kv_dtype, dim, q_heads, kv_heads, block)
    launched = {k for c in sel.checks for k in c.kernels}
    assert set(kernels) <= launched
    assert all(c.rel_err < BOUNDS[dtype] / 3 for c in sel.checks if c.component != "cache_write")
    windowed = [c for c in sel.checks if "window 40" in c.detail]
    assert len(windowed) == (3 if (40, 30.0) in windows else 0)  # decode unsplit/split, prefill
    assert all("soft-cap 30" in c.detail for c in windowed)


def test_decode_contexts_span_partitions_and_pass_the_window() -> None:
    shape = SelftestShape(torch.bfloat16, torch.bfloat16, 128, 32, 8, 16,
                          ((None, None), (4096, 50.0)), 8192)
    (none, lens), (window, wlens) = decode_cases(shape)
    assert none == (None, None) and lens == [1, 17, 205]
    assert window == (4096, 50.0) and max(wlens) > 4096 + 64
    small = SelftestShape(torch.bfloat16, torch.bfloat16, 64, 4, 1, 32, ((None, None),), 100)
    assert max(decode_cases(small)[0][1]) == 99  # held to max_model_len


def test_case_pool_is_nan_outside_every_context() -> None:
    shape = SelftestShape(torch.bfloat16, torch.bfloat16, 64, 4, 2, 16, ((None, None),), 512)
    case = make_case(shape, [1, 3], [20, 3], None, CPU, seed=1)
    owned = 0
    for s, n in enumerate([20, 3]):
        for p in range(n):
            block = int(case.meta.block_tables[s, p // 16])
            assert torch.isfinite(case.key_cache[block, :, p % 16]).all()
            owned += 1
    slots = case.key_cache.shape[0] * 16
    assert int(torch.isnan(case.key_cache[:, 0, :, 0]).sum()) == slots - owned


def test_broken_tensor_core_decode_falls_back_to_the_legacy_kernel(emu_kernels) -> None:  # type: ignore[no-untyped-def]
    from tests.attention.emulator import EmulatedKernels, build

    broken = EmulatedKernels(build([], [(2, 0, 64, 1)], [], defines=["QW_EMU_MUTATE_WAIT=1"]))
    runner = RoutedKernels(emu_kernels(), {"paged_decode_tc": broken})
    shape = SelftestShape(torch.bfloat16, torch.bfloat16, 64, 4, 1, 16, ((None, None),), 512)
    sel = select_attention(_backend(runner), shape, CPU)
    failed = [c for c in sel.checks if not c.passed]
    assert failed and all(c.component == "decode" and c.path == "tensor_core" for c in failed)
    assert all("paged_decode_tc<2, 0, 64, 1>" in c.describe() for c in failed)
    assert sel.fell_back and isinstance(sel.backend, CudaAttentionBackend)
    assert sel.backend.decode_kernel == "legacy"
    paths = sel.backend.paths(torch.bfloat16, torch.bfloat16, 64, 4, 1, 16)
    assert paths == {"decode": "legacy", "prefill": "tensor_core", "cache_write": "cuda"}
    # the prefill check ran with the legacy decode and the tensor-core prefill, and passed
    prefill = [c for c in sel.checks if c.component == "prefill"]
    assert len(prefill) == 1 and prefill[0].passed
    assert "paged_attention_decode<2, 64, 4>" in prefill[0].kernels
    assert "paged_prefill_tc<2, 0, 64>" in prefill[0].kernels


def test_wrong_scale_in_the_prefill_kernel_falls_back_to_sdpa(emu_kernels) -> None:  # type: ignore[no-untyped-def]
    runner = FaultyKernels(emu_kernels(), "paged_prefill_tc", factor=1.05)
    shape = SelftestShape(torch.bfloat16, torch.bfloat16, 64, 4, 1, 16, ((None, None),), 512)
    sel = select_attention(_backend(runner), shape, CPU)
    failed = [c for c in sel.checks if not c.passed]
    assert [(c.component, c.path) for c in failed] == [("prefill", "tensor_core")]
    assert BOUNDS[torch.bfloat16] < failed[0].rel_err < 1.0  # plausible numbers, still caught
    assert isinstance(sel.backend, CudaAttentionBackend) and sel.backend.prefill == "sdpa"
    assert sel.backend.decode_kernel == "auto"


def test_cache_write_that_never_runs_falls_back_to_the_torch_scatter(emu_kernels) -> None:  # type: ignore[no-untyped-def]
    runner = FaultyKernels(emu_kernels(), "reshape_and_cache", fault="skip")
    shape = SelftestShape(torch.float16, torch.float16, 32, 8, 1, 8, ((None, None),), 512)
    sel = select_attention(_backend(runner), shape, CPU)
    failed = [c for c in sel.checks if not c.passed]
    assert [(c.component, c.path) for c in failed] == [("cache_write", "cuda")]
    assert sel.backend.paths(torch.float16, torch.float16, 32, 8, 1, 8)["cache_write"] == "torch"
    hits = runner.hits
    # decode and prefill were checked with the torch scatter: no faulty launch since
    assert sum(1 for c in sel.checks if c.passed) >= 3 and runner.hits == hits == 1


def test_missing_kernel_is_a_failed_check_with_its_error(emu_kernels) -> None:  # type: ignore[no-untyped-def]
    # bf16 head 96 is in no emulator build: each kernel launch raises, torch paths remain
    shape = SelftestShape(torch.bfloat16, torch.bfloat16, 96, 4, 2, 16, ((None, None),), 512)
    sel = select_attention(_backend(emu_kernels()), shape, CPU)
    raised = [c for c in sel.checks if c.error is not None]
    assert {(c.component, c.path) for c in raised} == {
        ("decode", "tensor_core"), ("decode", "legacy"), ("prefill", "tensor_core")}
    assert all("paged_" in c.describe() and "failed" in c.error for c in raised)
    decode = [c for c in sel.checks if c.component == "decode"]
    assert [c.path for c in decode] == ["tensor_core"] * 2 + ["legacy"] * 2 + ["torch"] * 2
    paths = sel.backend.paths(torch.bfloat16, torch.bfloat16, 96, 4, 2, 16)
    assert paths == {"decode": "torch", "prefill": "sdpa", "cache_write": "cuda"}


def test_nothing_passing_leaves_the_torch_reference(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import qworker.attention.cuda_backend as cuda_backend

    def fails(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise RuntimeError("device lost")

    class Dead:  # a runner whose every kernel fails
        get = staticmethod(fails)
        launch = staticmethod(fails)

    monkeypatch.setattr(cuda_backend, "sdpa_prefill", fails)  # and SDPA too
    shape = SelftestShape(torch.float16, torch.float16, 32, 8, 1, 8, ((None, None),), 512)
    sel = select_attention(_backend(Dead()), shape, CPU)
    assert isinstance(sel.backend, TorchAttentionBackend) and sel.fell_back
    assert not any(c.passed for c in sel.checks if c.component in ("decode", "prefill"))
    assert all("device lost" in (c.error or "") for c in sel.checks if not c.passed)


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("dtype", "kv_dtype", "dim", "q_heads", "kv_heads", "block", "windows"),
    [
        (torch.bfloat16, torch.bfloat16, 128, 32, 8, 16, ((None, None),)),  # Llama-3.1-8B
        (torch.bfloat16, FP8_DTYPE, 128, 32, 8, 16, ((None, None),)),
        (torch.float16, torch.float16, 64, 14, 2, 32, ((None, None), (4096, None))),  # group 7
        (torch.bfloat16, torch.bfloat16, 128, 32, 16, 16,
         ((4096, 50.0), (None, 50.0))),  # Gemma-2-27B: windowed and global, soft-capped
        (torch.bfloat16, torch.bfloat16, 256, 8, 4, 8, ((None, None),)),  # 2-warp, SDPA prefill
        (torch.float32, torch.float32, 128, 32, 8, 16, ((None, None),)),  # legacy kernel
    ],
)
def test_gpu_selection_keeps_every_kernel(  # type: ignore[no-untyped-def]
    dtype, kv_dtype, dim, q_heads, kv_heads, block, windows
) -> None:
    backend = CudaAttentionBackend()
    shape = SelftestShape(dtype, kv_dtype, dim, q_heads, kv_heads, block, windows, 8192)
    sel = select_attention(backend, shape, torch.device("cuda"))
    assert not sel.fell_back, [c.describe() for c in sel.checks if not c.passed]
    assert sel.backend.paths(dtype, kv_dtype, dim, q_heads, kv_heads, block) == backend.paths(
        dtype, kv_dtype, dim, q_heads, kv_heads, block)
