"""The kernel catalogue: what the backend may request, and how decode launches are cut."""

from __future__ import annotations

import pytest
import torch

from qworker.attention import cuda_kernels as ck


def test_every_requestable_decode_name_is_in_the_compiled_set() -> None:
    names = set(ck.all_instantiations()[ck.PAGED_ATTENTION])
    for dtype in ck.DTYPE_CODE:
        assert ck.reduce_name(dtype) in names
        for d in ck.HEAD_SIZES:
            for group in (1, 2, 3, 4, 5, 7, 8, 16, 32):
                assert ck.decode_name(dtype, d, group) in names


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
