"""The kernel catalogue: what the backend may request, and how decode launches are cut."""

from __future__ import annotations

import pytest
import torch

from qworker.attention import cuda_kernels as ck


def test_every_requestable_decode_name_is_in_the_compiled_set() -> None:
    names = set(ck.all_instantiations(soft_capped=True)[ck.PAGED_ATTENTION])
    for dtype in ck.DTYPE_CODE:
        assert ck.reduce_name(dtype) in names
        for d in ck.HEAD_SIZES:
            for group in (1, 2, 3, 4, 5, 7, 8, 16, 32):
                assert ck.decode_name(dtype, d, group) in names
                assert ck.decode_name(dtype, d, group, capped=True) in names


def test_head_tile_is_next_power_of_two_capped_at_eight() -> None:
    assert [ck.head_tile(g) for g in (1, 2, 3, 4, 5, 7, 8, 9, 32)] == [1, 2, 4, 4, 8, 8, 8, 8, 8]


def test_unsupported_shapes_are_named() -> None:
    assert ck.unsupported_reason(torch.bfloat16, 128, 16, 32, 8) is None
    assert "head size" in str(ck.unsupported_reason(torch.bfloat16, 72, 16, 32, 8))
    assert "block size" in str(ck.unsupported_reason(torch.float16, 128, 4, 32, 8))
    assert "block size" in str(ck.unsupported_reason(torch.float16, 128, 24, 32, 8))
    assert "multiple" in str(ck.unsupported_reason(torch.float32, 64, 16, 6, 4))
    assert "dtype" in str(ck.unsupported_reason(torch.float64, 64, 16, 4, 4))


def test_small_batch_long_context_is_split_to_fill_the_gpu() -> None:
    plan = ck.plan_decode(1, 8, 4, 32768, num_sms=132)
    assert plan.split
    assert plan.partition_size in ck.PARTITION_SIZES
    assert 8 * plan.num_partitions >= 4 * 132
    assert plan.num_partitions == -(-32768 // plan.partition_size)


def test_large_batch_or_short_context_is_not_split() -> None:
    assert not ck.plan_decode(256, 8, 4, 32768, num_sms=132).split
    assert not ck.plan_decode(1, 8, 4, 200, num_sms=132).split


def test_forced_split_honours_partition_size_and_window() -> None:
    plan = ck.plan_decode(64, 8, 1, 1000, 132, split_k=True, partition_size=128)
    assert (plan.partition_size, plan.num_partitions) == (128, 8)
    plan = ck.plan_decode(
        1, 1, 1, 100_000, 132, split_k=True, partition_size=256, sliding_window=600
    )
    assert plan.num_partitions == 3
    assert not ck.plan_decode(1, 1, 1, 100_000, 132, split_k=False).split


def test_partition_count_is_capped() -> None:
    plan = ck.plan_decode(1, 1, 1, 10_000_000, 132, split_k=True, partition_size=256)
    assert plan.num_partitions <= ck.MAX_PARTITIONS


def test_group_above_eight_uses_several_head_tiles() -> None:
    assert ck.plan_decode(4, 1, 32, 100, 132).head_tiles == 4
    assert ck.plan_decode(4, 2, 7, 100, 132).head_tiles == 1


@pytest.mark.parametrize("name", [ck.PAGED_ATTENTION, ck.CACHE_OPS])
def test_kernel_sources_open_with_the_style_comment_block(name: str) -> None:
    text = ck.source(name)
    assert text.startswith("//")
    head = text[:4000]
    for word in ("Grid", "layout", "Reference"):
        assert word.lower() in head.lower()


@pytest.mark.parametrize("name", [ck.DECODE_TC, ck.PREFILL_TC])
def test_tensor_core_sources_open_with_the_style_comment_block(name: str) -> None:
    raw = (ck.CUDA_DIR / name).read_text()
    assert raw.startswith("//")
    for word in ("Grid", "layout", "Reference"):
        assert word.lower() in raw[:5000].lower()
    assert '#include "warp_mma.cuh"' in raw
    inlined = ck.source(name)
    assert "#include" not in inlined and "mma.sync.aligned.m16n8k16" in inlined


def test_num_splits_follows_flash_attentions_wave_rule() -> None:
    # FlashAttention's own example: 48 CTAs on 108 SMs -> 2 splits (0.89 of a wave).
    assert ck.num_splits_heuristic(48, 108, 1000, 64) == 2
    assert ck.num_splits_heuristic(100, 108, 1000, 64) == 1  # >= 80% of a wave: no split
    assert ck.num_splits_heuristic(8, 264, 4, 64) == 4  # capped by the work units
    # split counts that do not change the per-split length are skipped
    assert ck.num_splits_heuristic(1, 200, 3, 64) == 3


def test_tc_decode_plan_splits_small_batches_only() -> None:
    plan = ck.plan_decode_tc(torch.bfloat16, False, 128, 1, 8, 4, 32768, 132)
    assert plan.split and 1 < plan.num_splits <= ck.TC_MAX_SPLITS
    assert plan.partition_size % ck.TC_SPLIT_UNIT == 0
    assert plan.num_splits * plan.partition_size >= 32768
    big = ck.plan_decode_tc(torch.bfloat16, False, 128, 64, 8, 4, 32768, 132)
    assert not big.split and big.partition_size == 0
    assert (plan.nt, plan.head_tiles, plan.warps) == (1, 1, 4)


def test_tc_decode_plan_heads_and_forced_splits() -> None:
    assert ck.plan_decode_tc(torch.float16, False, 64, 4, 2, 12, 100, 132).nt == 2
    assert ck.plan_decode_tc(torch.float16, False, 64, 4, 1, 24, 100, 132).head_tiles == 2
    assert ck.plan_decode_tc(torch.float16, False, 256, 4, 1, 16, 100, 132).head_tiles == 2
    forced = ck.plan_decode_tc(torch.bfloat16, True, 128, 64, 8, 1, 1000, 132, None, True, 100)
    assert (forced.partition_size, forced.num_splits) == (128, 8)
    assert not ck.plan_decode_tc(torch.bfloat16, False, 128, 1, 8, 4, 32768, 132, None, False).split
    windowed = ck.plan_decode_tc(torch.bfloat16, False, 128, 1, 8, 4, 10**6, 132, 500)
    assert windowed.num_splits * windowed.partition_size >= 515


def test_tc_layouts_fit_two_ctas_per_sm() -> None:
    for d in ck.TC_HEAD_SIZES:
        for kv8 in (False, True):
            lay = ck.decode_tc_layout(kv8, d)
            assert lay.stages >= 2 and lay.warps in (2, 4)
            assert ck.ctas_per_sm(lay.warps * 32, lay.smem_bytes) >= 2
            if d <= ck.PREFILL_TC_MAX_HEAD:
                assert ck.ctas_per_sm(128, ck.prefill_tc_layout(kv8, d).smem_bytes, 255) >= 2


def test_soft_capped_layers_get_their_own_instantiation_of_every_kernel() -> None:
    every = ck.all_instantiations(soft_capped=True)
    uncapped = ck.all_instantiations()  # what gpu_check precompiles: the capped set is extra
    assert set(uncapped[ck.DECODE_TC]) < set(every[ck.DECODE_TC])
    assert all(n.count(",") == 3 for n in uncapped[ck.DECODE_TC])
    plan = ck.plan_decode_tc(torch.bfloat16, False, 128, 4, 8, 4, 2000, 132)
    assert plan.kernel_name(False) == plan.name == "paged_decode_tc<2, 0, 128, 1>"
    assert plan.kernel_name(True) == "paged_decode_tc<2, 0, 128, 1, 1>"
    for capped in (False, True):
        for d in ck.TC_HEAD_SIZES:
            for kv8 in (False, True):
                for group in (1, 4, 12):
                    name = ck.decode_tc_name(torch.float16, kv8, d, group, capped)
                    assert name in every[ck.DECODE_TC]
                if d <= ck.PREFILL_TC_MAX_HEAD:
                    prefill = ck.prefill_tc_name(torch.bfloat16, kv8, d, capped)
                    assert prefill in every[ck.PREFILL_TC]
    assert ck.prefill_tc_name(torch.bfloat16, True, 64, True) == "paged_prefill_tc<2, 1, 64, 1>"
