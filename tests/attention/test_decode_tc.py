"""The tensor-core decode kernel (``cuda/paged_decode_tc.cu``) on the CPU emulator, behind the
backend's own launch code, against the torch reference: head sizes 32..256, GQA 1..24
(powers of two or not, groups past 8 and 16), block sizes 8/16/32, sliding windows, split-KV
with the in-launch merge, fixed (CUDA-graph) plans, and the FP8 cache.

Every pool slot no sequence owns is NaN (``tests/attention/cases.py``), so reading a wrong
block or a token outside the context poisons the output; cp.async data read before its wait
is poison too (the emulator), so a missing wait fails here.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from qworker.attention.cuda_backend import CudaAttentionBackend
from qworker.attention.cuda_kernels import DTYPE_CODE, decode_tc_nt
from qworker.attention.fp8 import FP8_DTYPE, FP8_MAX, quantize
from qworker.attention.torch_ref import TorchAttentionBackend
from tests.attention.cases import TOLERANCE, Batch, make_batch, rel_err
from tests.attention.conftest import EMU_TC_DECODE

REF = TorchAttentionBackend()


def _backend(emu_kernels, **kwargs) -> CudaAttentionBackend:  # type: ignore[no-untyped-def]
    return CudaAttentionBackend(kernels=emu_kernels(), num_sms=4, **kwargs)


def fp8_batch(batch: Batch, headroom: float = 2.0) -> tuple[Batch, torch.Tensor]:
    """``batch`` with its cache quantized to FP8 (NaN slots stay NaN) and its scales."""
    finite = lambda t: t[torch.isfinite(t)].abs().max()  # noqa: E731
    scales = torch.stack([finite(batch.key_cache.float()), finite(batch.value_cache.float())])
    scales = (scales * headroom / FP8_MAX).float()
    k8 = quantize(batch.key_cache, scales[0])
    v8 = quantize(batch.value_cache, scales[1])
    return Batch(batch.query, k8, v8, batch.meta, batch.new_key, batch.new_value), scales


DECODE_CASES = [
    # dtype, kv8, head_dim, q_heads, kv_heads, block_size, split, window, seq_lens
    (torch.bfloat16, False, 64, 8, 2, 16, False, None, [1, 17, 130]),  # GQA 4, partial blocks
    (torch.float16, False, 80, 14, 2, 8, True, None, [9, 200]),  # group 7, split, 5 k steps
    (torch.bfloat16, False, 128, 4, 4, 32, True, 100, [300, 140]),  # MHA, window across splits
    (torch.bfloat16, False, 32, 16, 1, 8, None, None, [5, 70]),  # group 16: NT = 2
    (torch.float16, False, 96, 12, 1, 16, True, None, [77, 3]),  # group 12: padded NT = 2
    (torch.bfloat16, False, 256, 4, 2, 16, True, 70, [190, 31]),  # 2-warp CTAs, window
    (torch.bfloat16, False, 64, 24, 1, 32, None, None, [45]),  # group 24: two head tiles
    (torch.float16, False, 32, 6, 2, 16, False, None, [33, 64, 1]),  # group 3
    (torch.bfloat16, True, 64, 8, 2, 16, True, None, [70, 129]),  # FP8
    (torch.float16, True, 80, 7, 7, 8, False, 20, [60, 5]),  # FP8, odd k steps, window
    (torch.bfloat16, True, 112, 8, 1, 32, True, None, [150]),  # FP8, 7 k steps, MQA
    (torch.bfloat16, True, 256, 2, 2, 16, False, None, [40, 17]),  # FP8, 16 k steps
    (torch.float16, True, 32, 20, 2, 8, True, None, [66, 12]),  # FP8, group 10: NT = 2
]


@pytest.mark.parametrize(
    ("dtype", "kv8", "dim", "q_heads", "kv_heads", "block_size", "split", "window", "lens"),
    DECODE_CASES,
)
def test_emulated_tc_decode_matches_reference(  # type: ignore[no-untyped-def]
    emu_kernels, dtype, kv8, dim, q_heads, kv_heads, block_size, split, window, lens
) -> None:
    group = q_heads // kv_heads
    assert (DTYPE_CODE[dtype], int(kv8), dim, decode_tc_nt(group, dim)) in EMU_TC_DECODE
    batch = make_batch([1] * len(lens), lens, q_heads, kv_heads, dim, block_size, dtype,
                       sliding_window=window, seed=dim + group)  # fmt: skip
    scales = None
    if kv8:
        batch, scales = fp8_batch(batch)
    backend = _backend(emu_kernels, split_k=split, partition_size=64 if split else None)
    scale = dim**-0.5
    out = backend.forward(batch.query, batch.key_cache, batch.value_cache, batch.meta, scale,
                          kv_scales=scales)  # fmt: skip
    plan = backend.last_decode
    assert plan is not None and plan.name.startswith("paged_decode_tc")
    if split is not None:
        assert plan.split == split
    ref = REF.forward(batch.query, batch.key_cache, batch.value_cache, batch.meta, scale,
                      kv_scales=scales)  # fmt: skip
    assert rel_err(out, ref) < TOLERANCE[dtype]


CAPPED_DECODE_CASES = [
    # dtype, kv8, head_dim, q_heads, kv_heads, block_size, split, window, cap, seq_lens
    (torch.bfloat16, False, 64, 8, 2, 16, True, 100, 1.5, [1, 250, 33]),  # window over splits
    (torch.float16, False, 80, 14, 2, 8, False, None, 0.75, [9, 70]),  # group 7, tiny cap
    (torch.bfloat16, False, 256, 4, 2, 16, True, None, 3.0, [90, 31]),  # 2-warp CTAs
    (torch.bfloat16, True, 64, 8, 2, 16, True, 90, 2.0, [70, 229]),  # FP8 cache
]


@pytest.mark.parametrize(
    ("dtype", "kv8", "dim", "q_heads", "kv_heads", "block_size", "split", "window", "cap",
     "lens"),
    CAPPED_DECODE_CASES,
)
def test_emulated_tc_decode_soft_cap_matches_reference(  # type: ignore[no-untyped-def]
    emu_kernels, dtype, kv8, dim, q_heads, kv_heads, block_size, split, window, cap, lens
) -> None:
    group = q_heads // kv_heads
    assert (DTYPE_CODE[dtype], int(kv8), dim, decode_tc_nt(group, dim), 1) in EMU_TC_DECODE
    batch = make_batch([1] * len(lens), lens, q_heads, kv_heads, dim, block_size, dtype,
                       sliding_window=window, logits_soft_cap=cap, seed=dim + 7)  # fmt: skip
    scales = None
    if kv8:
        batch, scales = fp8_batch(batch)
    kernels = emu_kernels()
    backend = CudaAttentionBackend(kernels=kernels, num_sms=4, split_k=split,
                                   partition_size=64 if split else None)
    scale = 0.4  # not head_dim ** -0.5: scores of several units, so the cap bites
    args = (batch.query, batch.key_cache, batch.value_cache)
    out = backend.forward(*args, batch.meta, scale, kv_scales=scales)
    assert backend.last_decode is not None and backend.last_decode.split == split
    assert kernels.launches == [backend.last_decode.kernel_name(True)]
    ref = REF.forward(*args, batch.meta, scale, kv_scales=scales)
    assert rel_err(out, ref) < TOLERANCE[dtype]
    uncapped = dataclasses.replace(batch.meta, logits_soft_cap=None)
    assert rel_err(REF.forward(*args, uncapped, scale, kv_scales=scales), ref) > 0.05


def test_emulated_layers_of_one_step_keep_their_own_window_and_cap(emu_kernels) -> None:  # type: ignore[no-untyped-def]
    # Gemma 2: windowed + capped and global + capped layers alternate within one step; the
    # per-step launch cache must hand each its own arguments, every time.
    batch = make_batch([1, 1, 1], [140, 33, 9], 8, 2, 64, 16, torch.bfloat16, seed=4)
    variants = [dataclasses.replace(batch.meta, sliding_window=w, logits_soft_cap=c)
                for w, c in ((32, 1.0), (None, 1.0), (None, None))]
    backend = _backend(emu_kernels, split_k=True, partition_size=64)
    args = (batch.query, batch.key_cache, batch.value_cache)
    for _ in range(2):
        for meta in variants:
            out = backend.forward(*args, meta, 0.3)
            assert rel_err(out, REF.forward(*args, meta, 0.3)) < TOLERANCE[torch.bfloat16]


def test_emulated_split_merge_leaves_counters_at_zero_and_repeats(emu_kernels) -> None:  # type: ignore[no-untyped-def]
    batch = make_batch([1, 1, 1], [300, 65, 190], 8, 2, 64, 16, torch.bfloat16, seed=4)
    backend = _backend(emu_kernels, split_k=True, partition_size=64)
    first = backend.forward(batch.query, batch.key_cache, batch.value_cache, batch.meta, 0.125)
    assert backend.last_decode.num_splits == 5
    ws = next(iter(backend._tc._workspaces.values()))
    assert int(ws.counters.abs().sum()) == 0
    again = backend.forward(batch.query, batch.key_cache, batch.value_cache, batch.meta, 0.125)
    assert torch.equal(first, again)


def test_emulated_fixed_plan_serves_shorter_and_fewer_sequences(emu_kernels) -> None:  # type: ignore[no-untyped-def]
    # A plan for 4 sequences up to 2000 tokens (as a captured CUDA graph would hold), run on
    # 3 sequences far shorter than the bound and one past the split the bound implies.
    backend = _backend(emu_kernels)
    fixed = backend.plan_decode(4, 2000, 8, 2, 64, torch.bfloat16, device="cpu")
    assert fixed.plan.split and fixed.plan.fixed
    for lens in ([1, 700, 33], [2000, 5, 1999, 64]):
        batch = make_batch([1] * len(lens), lens, 8, 2, 64, 16, torch.bfloat16, seed=len(lens))
        batch.meta.decode_plan = fixed
        out = backend.forward(batch.query, batch.key_cache, batch.value_cache, batch.meta, 0.1)
        assert backend.last_decode is fixed.plan
        assert rel_err(out, REF.forward(batch.query, batch.key_cache, batch.value_cache,
                                        batch.meta, 0.1)) < TOLERANCE[torch.bfloat16]  # fmt: skip
        assert int(fixed.workspace.counters.abs().sum()) == 0
    batch.meta.decode_plan = fixed
    too_many = make_batch([1] * 5, [9] * 5, 8, 2, 64, 16, torch.bfloat16)
    too_many.meta.decode_plan = fixed
    with pytest.raises(ValueError, match="exceed"):
        backend.forward(
            too_many.query, too_many.key_cache, too_many.value_cache, too_many.meta, 1.0
        )


def test_emulated_fixed_plan_set_on_a_seen_step_takes_effect(emu_kernels) -> None:  # type: ignore[no-untyped-def]
    batch = make_batch([1, 1], [300, 20], 8, 2, 64, 16, torch.bfloat16, seed=6)
    backend = _backend(emu_kernels)
    backend.forward(batch.query, batch.key_cache, batch.value_cache, batch.meta, 0.1)
    fixed = backend.plan_decode(2, 4000, 8, 2, 64, torch.bfloat16, device="cpu")
    batch.meta.decode_plan = fixed
    out = backend.forward(batch.query, batch.key_cache, batch.value_cache, batch.meta, 0.1)
    assert backend.last_decode is fixed.plan
    ref = REF.forward(batch.query, batch.key_cache, batch.value_cache, batch.meta, 0.1)
    assert rel_err(out, ref) < TOLERANCE[torch.bfloat16]


def test_emulated_sequence_longer_than_the_fixed_bound_still_attends_everything(
    emu_kernels,
) -> None:  # type: ignore[no-untyped-def]
    backend = _backend(emu_kernels)
    fixed = backend.plan_decode(1, 256, 8, 2, 64, torch.bfloat16, device="cpu")
    batch = make_batch([1], [700], 8, 2, 64, 16, torch.bfloat16, seed=9)
    batch.meta.decode_plan = fixed
    out = backend.forward(batch.query, batch.key_cache, batch.value_cache, batch.meta, 0.1)
    ref = REF.forward(batch.query, batch.key_cache, batch.value_cache, batch.meta, 0.1)
    assert rel_err(out, ref) < TOLERANCE[torch.bfloat16]


def test_fp8_cache_error_against_the_unquantized_cache_is_bounded(emu_kernels) -> None:  # type: ignore[no-untyped-def]
    # E4M3 keeps 3 mantissa bits: each cached element is off by at most 2^-4 of itself
    # (uniform rounding: ~2^-4/sqrt(3) = 3.6% RMS); the attention output averages many of
    # them, so its relative error stays well under that.
    batch = make_batch([1] * 4, [40, 300, 129, 7], 16, 4, 64, 16, torch.bfloat16, seed=12)
    b8, scales = fp8_batch(batch)
    backend = _backend(emu_kernels)
    exact = REF.forward(batch.query, batch.key_cache, batch.value_cache, batch.meta, 0.125)
    got = backend.forward(b8.query, b8.key_cache, b8.value_cache, b8.meta, 0.125, kv_scales=scales)
    err = rel_err(got, exact)
    assert 1e-3 < err < 0.04, err
    assert b8.key_cache.dtype == FP8_DTYPE


def test_missing_cp_async_wait_poisons_the_result(emu_kernels) -> None:  # type: ignore[no-untyped-def]
    # The same kernel built with its wait one group too weak reads stages still in flight.
    from tests.attention.emulator import EmulatedKernels, build

    lib = build([], [(2, 0, 64, 1)], [], defines=["QW_EMU_MUTATE_WAIT=1"])
    batch = make_batch([1, 1], [200, 90], 8, 2, 64, 16, torch.bfloat16, seed=3)
    backend = CudaAttentionBackend(kernels=EmulatedKernels(lib), num_sms=4, split_k=False)
    out = backend.forward(batch.query, batch.key_cache, batch.value_cache, batch.meta, 0.125)
    ref = REF.forward(batch.query, batch.key_cache, batch.value_cache, batch.meta, 0.125)
    assert rel_err(out, ref) > 0.5  # NaN (inf) when poison is read


# ---------------------------------------------------------------------------------------
# GPU (-m gpu): the cupy-compiled kernels

GPU_GQA = [(8, 8), (8, 4), (8, 2), (8, 1), (14, 2), (32, 1), (24, 2), (12, 4)]


GPU_DECODE_MATRIX = [
    (dtype, dim, kv8)
    for dtype in (torch.bfloat16, torch.float16)
    for dim in (64, 128, 256)
    for kv8 in (False, True)
] + [(torch.bfloat16, dim, False) for dim in (80, 96, 112, 160, 192)] + [
    (torch.float16, 80, True)
]


@pytest.mark.gpu
@pytest.mark.parametrize(("dtype", "dim", "kv8"), GPU_DECODE_MATRIX)
def test_gpu_tc_decode_matches_reference(dtype: torch.dtype, dim: int, kv8: bool) -> None:
    import random

    rng = random.Random(dim * 2 + kv8)
    failures = []
    for (q_heads, kv_heads), block_size in zip(GPU_GQA, [8, 16, 32, 16, 8, 32, 16, 8], strict=True):
        for split in (None, True):
            window = rng.choice([None, None, 300])
            lens = [1, block_size + 1, 3 * block_size - 1] + [
                rng.randint(2, 3000) for _ in range(4)
            ]
            seed = rng.randint(0, 1 << 30)
            batch = make_batch([1] * len(lens), lens, q_heads, kv_heads, dim, block_size, dtype,
                               "cuda", sliding_window=window, seed=seed)  # fmt: skip
            scales = None
            if kv8:
                batch, scales = fp8_batch(batch)
            backend = CudaAttentionBackend(split_k=split, partition_size=rng.choice([64, 256, 512]))
            out = backend.forward(batch.query, batch.key_cache, batch.value_cache, batch.meta,
                                  dim**-0.5, kv_scales=scales)  # fmt: skip
            assert backend.last_decode.name.startswith("paged_decode_tc")
            ref = REF.forward(batch.query, batch.key_cache, batch.value_cache, batch.meta,
                              dim**-0.5, kv_scales=scales)  # fmt: skip
            err = rel_err(out, ref)
            if not err < TOLERANCE[dtype]:
                failures.append((q_heads, kv_heads, block_size, split, window, lens, err))
    assert not failures, failures


@pytest.mark.gpu
@pytest.mark.parametrize("kv8", [False, True])
def test_gpu_tc_decode_long_contexts_split_and_merge_in_one_launch(kv8: bool) -> None:
    lens = [32768, 32000 + 3, 1, 4097]
    batch = make_batch([1] * 4, lens, 32, 8, 128, 16, torch.bfloat16, "cuda", seed=11)
    scales = None
    if kv8:
        batch, scales = fp8_batch(batch)
    ref = REF.forward(batch.query, batch.key_cache, batch.value_cache, batch.meta, 128**-0.5,
                      kv_scales=scales)  # fmt: skip
    for split in (None, False):
        backend = CudaAttentionBackend(split_k=split)
        out = backend.forward(batch.query, batch.key_cache, batch.value_cache, batch.meta,
                              128**-0.5, kv_scales=scales)  # fmt: skip
        assert backend.last_decode.split == (split is None)
        assert rel_err(out, ref) < TOLERANCE[torch.bfloat16]


@pytest.mark.gpu
@pytest.mark.parametrize("kv8", [False, True])
def test_gpu_tc_decode_replays_in_a_cuda_graph_as_sequences_grow(kv8: bool) -> None:
    # Capture one decode with a fixed plan (8 sequences up to 4096 tokens), then replay it
    # after growing seq_lens in place: the graph holds the grid, the kernel reads the lengths.
    final = [4000, 3000, 17, 1, 2048, 999, 4096, 64]
    batch = make_batch([1] * 8, final, 32, 8, 128, 16, torch.bfloat16, "cuda", seed=5)
    scales = None
    if kv8:
        batch, scales = fp8_batch(batch)
    backend = CudaAttentionBackend()
    fixed = backend.plan_decode(8, 4096, 32, 8, 128, torch.bfloat16,
                                batch.key_cache.dtype, device="cuda")  # fmt: skip
    meta = batch.meta
    meta.decode_plan = fixed
    meta.seq_lens.copy_(torch.tensor([100, 50, 3, 1, 700, 999, 2000, 10], device="cuda"))
    args = (batch.query, batch.key_cache, batch.value_cache, meta, 0.09)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture (compiles, calibrates)
        backend.forward(*args, kv_scales=scales)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.forward(*args, kv_scales=scales)
    for lens in ([100, 50, 3, 1, 700, 999, 2000, 10], [3999, 2500, 17, 1, 2048, 999, 4096, 64]):
        meta.seq_lens.copy_(torch.tensor(lens, device="cuda"))
        graph.replay()
        torch.cuda.synchronize()
        ref = REF.forward(*args, kv_scales=scales)
        assert rel_err(out, ref) < TOLERANCE[torch.bfloat16], lens
    assert int(fixed.workspace.counters.abs().sum()) == 0


@pytest.mark.gpu
def test_gpu_tc_decode_without_a_fixed_plan_refuses_capture() -> None:
    batch = make_batch([1] * 2, [900, 40], 8, 2, 128, 16, torch.bfloat16, "cuda")
    backend = CudaAttentionBackend()
    backend.forward(batch.query, batch.key_cache, batch.value_cache, batch.meta, 0.1)
    graph = torch.cuda.CUDAGraph()
    fresh = make_batch([1] * 2, [900, 40], 8, 2, 128, 16, torch.bfloat16, "cuda")
    with pytest.raises(RuntimeError, match="fixed plan"), torch.cuda.graph(graph):
        backend.forward(fresh.query, fresh.key_cache, fresh.value_cache, fresh.meta, 0.1)
