"""The fused-op self-test (qworker/models/fused_selftest.py): the kernels of cuda/fused_ops.cu
on the CPU emulator pass against their torch forms; a planted fault (a launch that never
runs, a wrong epsilon) fails exactly the ops it touches, and only those leave the kernels."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from qworker.models import fused_kernels, ops
from qworker.models.fused_kernels import OPS, FusedKernels
from qworker.models.fused_selftest import FusedShape, check_fused_ops, passing_ops
from qworker.testing.kernel_faults import FaultyKernels

CPU = torch.device("cpu")
SHAPE = FusedShape(torch.bfloat16, hidden_size=64, mlp_width=96, num_q_heads=4, num_kv_heads=2,
                   head_dim=16)


@pytest.fixture(scope="module")
def emu():  # type: ignore[no-untyped-def]
    from tests.attention.emulator import EmulatedKernels
    from tests.models.test_fused_kernels import _build

    return EmulatedKernels(_build())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_sound_fused_kernels_pass(emu, dtype: torch.dtype) -> None:  # type: ignore[no-untyped-def]
    fused = FusedKernels(emu, emulated=True)
    shape = FusedShape(dtype, 64, 96, 4, 2, 16)
    results = check_fused_ops(fused, shape, CPU)
    assert [r.component for r in results] == list(OPS)
    assert all(r.passed for r in results), [r.describe() for r in results]
    assert results[3].kernels == [f"rotary_neox<{fused_kernels.DTYPE_CODE[dtype]}>"]
    assert passing_ops(fused, results) is fused


def test_a_launch_that_never_runs_fails_only_its_op(emu) -> None:  # type: ignore[no-untyped-def]
    fused = FusedKernels(FaultyKernels(emu, "silu_and_mul", fault="skip"), emulated=True)
    results = check_fused_ops(fused, SHAPE, CPU)
    assert [r.component for r in results if not r.passed] == ["silu_and_mul"]
    kept = passing_ops(fused, results)
    assert kept is not None and kept.ops == frozenset(OPS) - {"silu_and_mul"}
    # the model's ops then run silu in torch and the rest through the kernels
    gate_up = torch.randn(3, 2 * 96).to(torch.bfloat16)
    x, w = torch.randn(3, 64).to(torch.bfloat16), torch.ones(64, dtype=torch.bfloat16)
    fused_kernels.enable(kept)
    try:
        before = len(emu.launches)
        got = ops.gated_act(gate_up, F.silu)
        ops.rms_norm(x, w, 1e-6)
        launched = emu.launches[before:]
    finally:
        fused_kernels.enable(None)
    gate, up = gate_up.chunk(2, dim=-1)
    assert torch.equal(got, F.silu(gate) * up)
    assert launched == ["rms_norm<2>"]


def test_a_wrong_epsilon_fails_both_norms(emu) -> None:  # type: ignore[no-untyped-def]
    fused = FusedKernels(FaultyKernels(emu, "", factor=1e5), emulated=True)  # eps 1e-6 -> 0.1
    results = check_fused_ops(fused, SHAPE, CPU)
    assert {r.component for r in results if not r.passed} == {"rms_norm", "add_rms_norm"}
    assert all(0 < r.rel_err < 1 for r in results if not r.passed)  # plausible, still caught
    kept = passing_ops(fused, results)
    assert kept is not None and kept.ops == {"silu_and_mul", "rotary"}
    assert passing_ops(kept, [r for r in results if r.component in kept.ops]) is kept


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_fused_kernels_pass_at_llama_8b_widths(dtype: torch.dtype) -> None:
    results = check_fused_ops(FusedKernels(), FusedShape(dtype, 4096, 14336, 32, 8, 128),
                              torch.device("cuda"))
    assert all(r.passed for r in results), [r.describe() for r in results]
