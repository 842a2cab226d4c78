"""Admission control sized to the KV pool.

The worker takes a job from its source only while the engine's free blocks, minus
what its waiting prompts (and prompts just submitted) still need, exceed a small
buffer, and fewer than ``max_inflight`` jobs are inside the worker. That keeps the
pool near full without a preemption storm: decode growth is covered by the buffer.
"""

from __future__ import annotations

import math


class Admission:
    """Decides how many more jobs to pull from the source right now.

    ``buffer_blocks`` None picks ~2% of the pool (at least 2 blocks).
    """

    def __init__(self, max_inflight: int, buffer_blocks: int | None = None) -> None:
        self.max_inflight = max_inflight
        self.buffer_blocks = buffer_blocks
        self._avg_prompt_blocks = 1.0

    def buffer_for(self, stats: dict) -> int:
        """The reserve in blocks for this pool."""
        if self.buffer_blocks is not None:
            return self.buffer_blocks
        return max(2, int(stats.get("num_kv_blocks", 0)) // 50)

    def free_budget(self, stats: dict, pending_blocks: int) -> int:
        """Blocks admission may still hand out: free - waiting - pending - buffer."""
        free = int(stats.get("num_free_blocks", 0))
        waiting = int(stats.get("waiting_prompt_blocks", 0))
        return free - waiting - pending_blocks - self.buffer_for(stats)

    def room(self, stats: dict, pending_blocks: int, inflight: int) -> int:
        """How many jobs to ask the source for now (0 = admit nothing).

        Uses a running average of prompt sizes to turn the block budget into a count,
        and always allows one job into an idle engine so a huge prompt cannot stall.
        """
        slots = self.max_inflight - inflight
        if slots <= 0:
            return 0
        budget = self.free_budget(stats, pending_blocks)
        if budget <= 0:
            return 1 if inflight == 0 else 0
        return max(1, min(slots, math.floor(budget / self._avg_prompt_blocks)))

    def observe_prompt(self, n_tokens: int, block_size: int) -> None:
        """Feed one admitted prompt's length into the running average."""
        blocks = max(1, math.ceil(n_tokens / block_size))
        self._avg_prompt_blocks = 0.9 * self._avg_prompt_blocks + 0.1 * blocks
