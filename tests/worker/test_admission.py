"""Admission sized to the KV pool (admission.py)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from qworker.engine.stats import EngineStats
from qworker.worker.admission import Admission


def _stats(free: int, waiting: int, total: int = 100) -> EngineStats:
    return EngineStats(num_kv_blocks=total, num_free_blocks=free, waiting_prompt_blocks=waiting)


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


def test_peak_projection_counts_blocks_freed_by_sequences_that_end_first() -> None:
    short = Admission.growth(16, 16, 1, 1024, start_step=0)
    long = Admission.growth(16, 48, 1, 1024, start_step=0)
    assert short.final_blocks(16) + long.final_blocks(16) == 6
    # short ends at 32 tokens (2 blocks) while long holds 2; long alone peaks at 4 blocks.
    assert Admission.peak_blocks([short, long], step=0, block_size=16) == 4
    # 20 steps later, short is done generating 16 of its 16 tokens.
    assert short.at(20) == (32, 0) and long.at(20) == (35, 29)


def test_fits_refuses_a_job_whose_growth_would_overflow_the_pool() -> None:
    adm = Admission(max_inflight=100, buffer_blocks=0)
    running = Admission.growth(64, 64, 1, 1024, start_step=0)  # 8 blocks at the end
    adm.admitted(running, 16)
    stats = _stats(free=6, waiting=0, total=10)
    small = Admission.growth(16, 16, 1, 1024, start_step=0)  # ends long before running peaks
    assert adm.fits(stats, 0, 1, [running], small, step=0, block_size=16)
    big = Admission.growth(16, 64, 1, 1024, start_step=0)  # 5 blocks at the end
    assert not adm.fits(stats, 0, 1, [running], big, step=0, block_size=16)
    assert adm.fits(stats, 0, 1, [], big, step=0, block_size=16)  # idle engine: always


def _peak_reference(jobs: list, step: int, block_size: int) -> int:
    """The quadratic projection: every sequence at every moment just before one ends."""
    seqs = [job.at(step) for job in jobs for _ in range(job.n)]
    best = 0
    for _, rem_k in seqs:
        moment = max(rem_k - 1, 0)
        total = sum(-(-(cur + moment) // block_size) for cur, rem in seqs if rem >= rem_k)
        best = max(best, total)
    return best


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 300), st.integers(0, 300), st.integers(1, 4),
                       st.integers(0, 50)), min_size=1, max_size=12),
    st.integers(0, 60),
    st.sampled_from([8, 16, 32]),
)
def test_peak_projection_matches_the_quadratic_reference(
    specs: list[tuple[int, int, int, int]], step: int, block_size: int
) -> None:
    jobs = [Admission.growth(p, m, n, 4096, start) for p, m, n, start in specs]
    assert Admission.peak_blocks(jobs, step, block_size) == _peak_reference(
        jobs, step, block_size)

