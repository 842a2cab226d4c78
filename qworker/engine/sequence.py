"""Requests and their sequences: the units the scheduler moves between queues.

A request asks for ``n`` completions of one prompt. It starts as one sequence
(index 0); when that sequence's prompt has been prefilled, the engine forks
``n - 1`` siblings that share its KV blocks. From then on every sequence is
scheduled, preempted and finished on its own.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from qworker.engine.outputs import RequestMetrics
from qworker.engine.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    """Where a sequence is in its life."""

    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"

    @property
    def finished(self) -> bool:
        """True for the three FINISHED_* states."""
        return self._finished  # type: ignore[attr-defined, no-any-return]

    @property
    def finish_reason(self) -> str | None:
        """OpenAI ``finish_reason`` of a finished state, None otherwise."""
        return _REASONS.get(self)


_FINISHED = frozenset(
    {
        SequenceStatus.FINISHED_STOPPED,
        SequenceStatus.FINISHED_LENGTH,
        SequenceStatus.FINISHED_ABORTED,
    }
)
for _status in SequenceStatus:  # a plain attribute: read for every sequence every step
    _status._finished = _status in _FINISHED  # type: ignore[attr-defined]
_REASONS = {
    SequenceStatus.FINISHED_STOPPED: "stop",
    SequenceStatus.FINISHED_LENGTH: "length",
    SequenceStatus.FINISHED_ABORTED: "abort",
}


@dataclass(slots=True, eq=False)
class Sequence:
    """One stream of tokens: the prompt plus what has been generated for it.

    ``token_ids`` holds prompt and output tokens; ``num_computed_tokens`` of them have
    their keys and values in the KV cache (or being computed by a step in flight).
    ``num_pending`` counts tokens already sampled on the device but not yet appended
    (at most one, while the engine overlaps steps): the scheduler treats them as part
    of the sequence, the next step reads them from the device. ``index`` is the
    completion index inside the request (it seeds the sampler together with the
    request's seed). Text fields are filled by incremental detokenization when the
    request has stop strings.
    """

    seq_id: int
    request: Request
    index: int
    token_ids: list[int]
    num_prompt_tokens: int
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    cumulative_logprob: float = 0.0
    logprobs: list[dict[int, float]] | None = None
    text: str = ""
    prefix_offset: int = 0
    read_offset: int = 0
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    block_hashes: list[int] = field(default_factory=list)
    num_pending: int = 0

    @property
    def num_tokens(self) -> int:
        """Prompt plus output tokens."""
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Tokens generated so far."""
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        """The generated tokens (a copy)."""
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens (pending ones included) whose keys and values must still be computed
        before the next sample."""
        return len(self.token_ids) + self.num_pending - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        """True once the sequence stopped, hit a length limit or was aborted."""
        return self.status.finished


@dataclass(slots=True, eq=False)
class Request:
    """One ``add_request`` call: prompt, parameters and its ``n`` sequences."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int
    metrics: RequestMetrics
    seqs: list[Sequence] = field(default_factory=list)
    num_cached_tokens: int = 0
    #: Sampling reads the host-side token history (``step_pipeline.needs_host_history``):
    #: the request's sequences are not sampled while a token of theirs is in flight.
    needs_host_history: bool = False

    @property
    def is_finished(self) -> bool:
        """True once every sequence finished and none is still to be forked."""
        if not all(s.is_finished for s in self.seqs):
            return False
        aborted = self.seqs[0].status is SequenceStatus.FINISHED_ABORTED
        return aborted or len(self.seqs) == self.params.n
