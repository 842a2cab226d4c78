"""Admission for an embedding engine: by prompt tokens in flight, not by KV blocks.

An embedding request is one forward pass over its inputs: it keeps no KV cache after
its step and never grows, so the block projection of ``admission.Admission`` does not
apply. What bounds it is compute: the engine runs at most ``max_num_batched_tokens``
tokens per step. Admitting up to ``STEPS_IN_FLIGHT`` steps' worth keeps the next step's
batch ready the moment one ends (the device never waits on the loop), while what waits
inside the engine stays a few steps long: the memory of queued inputs stays bounded, a
drain finishes what runs within a few steps, and jobs that wait do so at the gate, where
the worker can still hand them back untouched (docs/operations.md, "Per-job work and
admission").
"""

from __future__ import annotations

import math
from typing import cast

from qworker.worker.embedding_jobs import EMBED
from qworker.worker.engine_thread import EmbeddingEngineLike, EngineLike

#: Engine steps' worth of tokens admitted at once (see the module docstring).
STEPS_IN_FLIGHT = 4


class TokenAdmission:
    """Counts the prompt tokens of the embedding requests inside the engine.

    ``limit`` is the most tokens in flight at once, except that an idle engine always
    takes the next job (a job over the limit alone cannot stall the queue). Event loop
    only; keyed by request id, so releasing twice is harmless.
    """

    def __init__(self, max_inflight: int, limit: int) -> None:
        self.max_inflight = max_inflight
        self.limit = max(1, limit)
        self.in_flight = 0
        self._tokens: dict[str, int] = {}
        self._avg_tokens = 64.0

    @classmethod
    def for_engine(cls, max_inflight: int, max_num_batched_tokens: int) -> TokenAdmission:
        """The admission of an engine computing ``max_num_batched_tokens`` tokens a step."""
        return cls(max_inflight, STEPS_IN_FLIGHT * max_num_batched_tokens)

    def room(self, inflight: int) -> int:
        """How many messages to ask the source for, with ``inflight`` jobs here (0 = none).

        The token budget left, turned into a count by the running average of job sizes.
        """
        slots = self.max_inflight - inflight
        if slots <= 0:
            return 0
        left = self.limit - self.in_flight
        if left <= 0:
            return 1 if inflight == 0 else 0
        return max(1, min(slots, math.floor(left / self._avg_tokens)))

    def fits(self, tokens: int) -> bool:
        """Whether a job of ``tokens`` prompt tokens may enter the engine now."""
        return not self._tokens or self.in_flight + tokens <= self.limit

    def admitted(self, request_id: str, tokens: int) -> None:
        """Account for a job that entered the engine as ``request_id``."""
        self._tokens[request_id] = tokens
        self.in_flight += tokens
        self._avg_tokens = 0.9 * self._avg_tokens + 0.1 * max(1, tokens)

    def released(self, request_id: str) -> None:
        """Account for a request that left the engine (once; repeats are ignored)."""
        self.in_flight -= self._tokens.pop(request_id, 0)


def embedding_admission(engine: EngineLike, max_inflight: int) -> TokenAdmission | None:
    """The token admission of an ``embed`` engine; None for a generating one (KV admission)."""
    if engine.task != EMBED:
        return None
    embed = cast(EmbeddingEngineLike, engine)
    return TokenAdmission.for_engine(max_inflight, embed.max_num_batched_tokens)
