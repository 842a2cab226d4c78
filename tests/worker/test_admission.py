"""Admission sized to the KV pool (admission.py)."""

from __future__ import annotations

from qworker.worker.admission import Admission


def _stats(free: int, waiting: int, total: int = 100) -> dict:
    return {"num_kv_blocks": total, "num_free_blocks": free, "waiting_prompt_blocks": waiting}


def test_budget_is_free_minus_waiting_minus_pending_minus_buffer() -> None:
    adm = Admission(max_inflight=100, buffer_blocks=5)
    assert adm.free_budget(_stats(50, 10), pending_blocks=3) == 32


def test_default_buffer_is_two_percent_of_the_pool() -> None:
    assert Admission(10).buffer_for(_stats(0, 0, total=1000)) == 20
    assert Admission(10).buffer_for(_stats(0, 0, total=10)) == 2


def test_no_room_when_pool_is_spoken_for_unless_idle() -> None:
    adm = Admission(max_inflight=100, buffer_blocks=5)
    assert adm.room(_stats(10, 8), 0, inflight=3) == 0
    assert adm.room(_stats(10, 8), 0, inflight=0) == 1  # a huge prompt never stalls an idle engine


def test_room_converts_blocks_to_jobs_and_respects_max_inflight() -> None:
    adm = Admission(max_inflight=100, buffer_blocks=0)
    for _ in range(200):
        adm.observe_prompt(64, block_size=16)  # 4 blocks each
    assert adm.room(_stats(41, 0), 0, inflight=0) == 10
    adm.max_inflight = 6
    assert adm.room(_stats(41, 0), 0, inflight=0) == 6
    assert adm.room(_stats(1000, 0), 0, inflight=4) == 2
    assert adm.room(_stats(1000, 0), 0, inflight=6) == 0
