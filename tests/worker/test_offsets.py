"""The Kafka commit watermark: never past unfinished work, whatever the ack order."""

from __future__ import annotations

import pytest

pytest.importorskip("hypothesis")  # absent on the GPU machine

from hypothesis import given
from hypothesis import strategies as st

from qworker.worker.offsets import PartitionWatermark


def test_watermark_is_none_before_anything_is_tracked() -> None:
    wm = PartitionWatermark()
    assert wm.watermark is None
    assert not wm.needs_commit()
    assert wm.uncommitted == 0


def test_watermark_stays_at_lowest_unfinished_offset_when_later_ones_finish() -> None:
    wm = PartitionWatermark()
    for off in range(10, 15):
        assert wm.track(off)
    wm.finish(12)
    wm.finish(13)
    assert wm.watermark == 10
    wm.finish(10)
    assert wm.watermark == 11
    wm.finish(11)
    # 12 and 13 were already done: the watermark jumps over them to 14.
    assert wm.watermark == 14
    wm.finish(14)
    assert wm.watermark == 15
    assert wm.in_flight == 0


def test_gaps_in_offsets_do_not_block_the_watermark() -> None:
    wm = PartitionWatermark()
    for off in (3, 7, 8):
        wm.track(off)
    wm.finish(3)
    assert wm.watermark == 7
    wm.finish(8)
    wm.finish(7)
    assert wm.watermark == 9


def test_duplicate_and_unknown_acks_do_not_move_the_watermark() -> None:
    wm = PartitionWatermark()
    wm.track(0)
    wm.track(1)
    wm.finish(0)
    wm.finish(0)
    wm.finish(99)
    assert wm.watermark == 1
    assert wm.in_flight == 1


def test_refetch_of_a_tracked_offset_is_reported_and_ignored() -> None:
    wm = PartitionWatermark()
    wm.track(0)
    wm.track(1)
    wm.finish(0)
    assert wm.track(0) is False
    assert wm.track(1) is False
    assert wm.watermark == 1


def test_offsets_below_a_committed_start_are_ignored() -> None:
    wm = PartitionWatermark(committed=50)
    assert wm.watermark == 50
    assert wm.track(49) is False
    assert wm.track(50)
    assert wm.watermark == 50
    wm.finish(50)
    assert wm.watermark == 51


def test_skipping_back_into_an_untracked_gap_is_an_error() -> None:
    wm = PartitionWatermark()
    wm.track(0)
    wm.track(5)
    with pytest.raises(ValueError, match="below the tracked range"):
        wm.track(3)


def test_needs_commit_only_when_the_watermark_advanced() -> None:
    wm = PartitionWatermark()
    wm.track(0)
    wm.track(1)
    assert wm.needs_commit()  # the first commit records where we started
    wm.mark_committed(0)
    assert not wm.needs_commit()
    wm.finish(1)
    assert not wm.needs_commit()
    wm.finish(0)
    assert wm.needs_commit()
    wm.mark_committed(2)
    wm.mark_committed(1)  # never backwards
    assert wm.committed == 2
    assert not wm.needs_commit()


def test_uncommitted_counts_offsets_fetched_past_the_last_commit() -> None:
    wm = PartitionWatermark()
    for off in range(5):
        wm.track(off)
    assert wm.uncommitted == 5
    for off in range(3):
        wm.finish(off)
    wm.mark_committed(wm.watermark or 0)
    assert wm.uncommitted == 2


@given(
    n=st.integers(min_value=1, max_value=60),
    gaps=st.lists(st.integers(min_value=1, max_value=3), min_size=60, max_size=60),
    order=st.randoms(use_true_random=False),
    stop_after=st.integers(min_value=0, max_value=60),
)
def test_watermark_never_passes_an_unfinished_offset(
    n: int, gaps: list[int], order: object, stop_after: int
) -> None:
    offsets = []
    off = 0
    for i in range(n):
        off += gaps[i]
        offsets.append(off)
    wm = PartitionWatermark()
    for o in offsets:
        wm.track(o)
    finish_order = list(offsets)
    order.shuffle(finish_order)  # type: ignore[attr-defined]
    finished: set[int] = set()
    for o in finish_order[:stop_after]:
        wm.finish(o)
        finished.add(o)
        mark = wm.watermark
        assert mark is not None
        # Everything below the watermark is finished ...
        assert all(x in finished for x in offsets if x < mark)
        # ... and the watermark is as high as that allows.
        unfinished = [x for x in offsets if x not in finished]
        assert mark == (min(unfinished) if unfinished else offsets[-1] + 1)
    assert wm.in_flight == n - len(finished)
