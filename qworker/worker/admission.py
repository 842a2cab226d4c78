"""Admission control sized to the KV pool.

A prepared job enters the engine only while

1. the engine's free blocks, minus what its waiting prompts (and prompts just
   submitted) still need, minus a small buffer, can hold the new prompt; and
2. the *peak* number of blocks the admitted jobs will hold together, if each runs to
   its ``max_tokens`` from where it is now, stays within the pool minus the buffer.

(1) keeps the pool full; (2) keeps decode growth from forcing preemptions. The peak
in (2) comes from a small projection: every running sequence grows one token per
engine step and frees its blocks when it ends, so demand peaks just before one of
them finishes. A job's progress is estimated from the engine steps since it was
submitted; jobs that stop early at EOS only make the projection conservative.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from qworker.engine.stats import EngineStats

# Projected peak allowed relative to the pool: above 1 trades a few preemptions for a
# fuller pool (the projection assumes every job runs to max_tokens).
OVERCOMMIT = 1.0
# Expected output tokens of a job without max_tokens (it runs until EOS or max_model_len).
UNBOUNDED_OUTPUT_GUESS = 256


@dataclass(slots=True)
class Growth:
    """One admitted job as admission projects it: tokens now, tokens still to come."""

    prompt_tokens: int
    max_output: int
    n: int
    start_step: int

    def final_blocks(self, block_size: int) -> int:
        """Blocks the job holds at its last token (prompt blocks counted per sequence)."""
        return self.n * math.ceil((self.prompt_tokens + self.max_output) / block_size)

    def at(self, step: int) -> tuple[int, int]:
        """(current tokens, remaining tokens) per sequence at engine step ``step``."""
        generated = min(self.max_output, max(0, step - self.start_step - 1))
        return self.prompt_tokens + generated, self.max_output - generated


class Admission:
    """Decides how many jobs to pull from the source and which may enter the engine.

    ``buffer_blocks`` None picks ~2% of the pool (at least 2 blocks).
    """

    def __init__(self, max_inflight: int, buffer_blocks: int | None = None) -> None:
        self.max_inflight = max_inflight
        self.buffer_blocks = buffer_blocks
        self._avg_prompt_blocks = 1.0
        self.final_sum = 0  # sum of final_blocks of the admitted jobs

    def admitted(self, job: Growth, block_size: int) -> None:
        """Account for a job that entered the engine."""
        self.final_sum += job.final_blocks(block_size)

    def released(self, job: Growth, block_size: int) -> None:
        """Account for a job that left the engine."""
        self.final_sum -= job.final_blocks(block_size)

    def buffer_for(self, stats: EngineStats) -> int:
        """The reserve in blocks for this pool."""
        if self.buffer_blocks is not None:
            return self.buffer_blocks
        return max(2, stats.num_kv_blocks // 50)

    def free_budget(self, stats: EngineStats, pending_blocks: int) -> int:
        """Blocks admission may still hand out: free - waiting - pending - buffer."""
        return (stats.num_free_blocks - stats.waiting_prompt_blocks - pending_blocks
                - self.buffer_for(stats))

    def room(self, stats: EngineStats, pending_blocks: int, inflight: int) -> int:
        """How many messages to ask the source for now (0 = none).

        Uses a running average of prompt sizes to turn the block budget into a count,
        and always allows one job into an idle worker so a huge prompt cannot stall.
        """
        slots = self.max_inflight - inflight
        if slots <= 0:
            return 0
        budget = self.free_budget(stats, pending_blocks)
        if budget <= 0:
            return 1 if inflight == 0 else 0
        return max(1, min(slots, math.floor(budget / self._avg_prompt_blocks)))

    @staticmethod
    def growth(
        prompt_tokens: int, max_tokens: int | None, n: int, max_model_len: int, start_step: int
    ) -> Growth:
        """The projection record of a job about to be submitted at ``start_step``."""
        room = max(1, max_model_len - prompt_tokens)
        output = min(max_tokens if max_tokens is not None else UNBOUNDED_OUTPUT_GUESS, room)
        return Growth(prompt_tokens, output, n, start_step)

    @staticmethod
    def peak_blocks(jobs: list[Growth], step: int, block_size: int) -> int:
        """Most blocks the jobs' sequences will hold at once from ``step`` on.

        Demand only grows between two sequence ends, so it peaks just before one ends:
        with the jobs sorted by remaining tokens (longest first), just before job k's
        sequences end, jobs 0..k are alive and each holds ``ceil((cur + m_k) / bs)``
        blocks per sequence, ``m_k`` being job k's remaining tokens less one. Splitting
        ``ceil((cur + m) / bs)`` into ``floor(a/bs) + floor(m/bs) + [a%bs + m%bs >= bs]``
        (``a = cur + bs - 1``) turns every moment's sum into prefix sums plus a prefix
        count of residues above a threshold: O(n log n) for the sort, O(n * bs) after.
        """
        if not jobs:
            return 0
        cur, rem, weight = np.array(
            [(*job.at(step), job.n) for job in jobs], dtype=np.int64
        ).T
        order = np.argsort(-rem, kind="stable")
        cur, rem, weight = cur[order], rem[order], weight[order]
        bs = block_size
        moment = np.maximum(rem - 1, 0)
        a = cur + bs - 1
        base = np.cumsum(weight * (a // bs))
        alive = np.cumsum(weight)
        residues = np.zeros((len(jobs), bs), dtype=np.int64)
        residues[np.arange(len(jobs)), a % bs] = weight
        at_least = np.cumsum(np.cumsum(residues, axis=0)[:, ::-1], axis=1)[:, ::-1]
        threshold = bs - moment % bs  # a residue at or above it rounds up one more block
        carry = np.where(
            threshold < bs, at_least[np.arange(len(jobs)), np.minimum(threshold, bs - 1)], 0
        )
        return int((base + alive * (moment // bs) + carry).max())

    def fits(
        self,
        stats: EngineStats,
        pending_blocks: int,
        prompt_blocks: int,
        admitted: list[Growth],
        candidate: Growth,
        step: int,
        block_size: int,
    ) -> bool:
        """Whether ``candidate`` may enter now, next to the ``admitted`` jobs.

        An idle engine always takes the next job, so no job can stall the queue.
        """
        if not admitted:
            return True
        if self.free_budget(stats, pending_blocks) < prompt_blocks:
            return False
        limit = int(OVERCOMMIT * stats.num_kv_blocks) - self.buffer_for(stats)
        if self.final_sum + candidate.final_blocks(block_size) <= limit:
            return True  # even all at their largest at once would fit
        return self.peak_blocks([*admitted, candidate], step, block_size) <= limit

    def observe_prompt(self, n_tokens: int, block_size: int) -> None:
        """Feed one admitted prompt's length into the running average."""
        blocks = max(1, math.ceil(n_tokens / block_size))
        self._avg_prompt_blocks = 0.9 * self._avg_prompt_blocks + 0.1 * blocks
