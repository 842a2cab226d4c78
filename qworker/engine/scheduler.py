"""Iteration-level scheduling: which sequences run in the next step, and how many tokens.

Each step first continues the running sequences in admission order (one token for a
decode, the next chunk for a prefill), then resumes swapped sequences, then admits
waiting ones first-come first-served, all under ``max_num_seqs`` sequences and a
budget of ``max_num_batched_tokens`` tokens (a long prompt is prefilled over several
steps). When the pool cannot take a running sequence's next tokens, the newest
running sequence is preempted: by recompute (blocks freed, sequence requeued at the
front of the waiting queue) or, with ``preemption_mode="swap"`` and room in the host
pool, by swapping its blocks out. A step that preempted admits nothing new.

Per-step Python work is per sequence, never per token. Not thread-safe.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field

from qworker.engine.kv_cache_manager import KVCacheManager
from qworker.engine.sequence import Sequence, SequenceStatus

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class SchedulerOutput:
    """One step's work: sequences with their query lengths and the block copies to do first.

    ``swap_out`` (device, host), ``swap_in`` (host, device) and ``copies`` (src, dst)
    pairs must be executed in that order before the forward.
    """

    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        """Query tokens in the step."""
        return sum(self.num_new_tokens)

    @property
    def is_empty(self) -> bool:
        """True when nothing runs this step."""
        return not self.seqs


class Scheduler:
    """FCFS continuous-batching scheduler over a ``KVCacheManager``."""

    def __init__(
        self,
        kv: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        preemption_mode: str = "recompute",
    ) -> None:
        if preemption_mode not in ("recompute", "swap"):
            raise ValueError(
                f"preemption_mode must be 'recompute' or 'swap', got {preemption_mode!r}"
            )
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.preemption_mode = preemption_mode
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.swapped: deque[Sequence] = deque()
        self.num_preemptions = 0
        self.num_swap_outs = 0
        #: Bumped whenever a sequence enters or leaves a queue (stats derived from the
        #: queues' membership are recomputed only then).
        self.version = 0
        self._waiting_blocks: dict[int, int] = {}  # seq_id -> blocks counted while waiting
        self._waiting_blocks_total = 0

    def _enqueue_waiting(self, seq: Sequence, front: bool = False) -> None:
        blocks = self.kv.blocks_for(seq.num_tokens)
        self._waiting_blocks[seq.seq_id] = blocks
        self._waiting_blocks_total += blocks
        if front:
            self.waiting.appendleft(seq)
        else:
            self.waiting.append(seq)

    def _left_waiting(self, seq: Sequence) -> None:
        self._waiting_blocks_total -= self._waiting_blocks.pop(seq.seq_id, 0)

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence at the back of the waiting queue."""
        seq.status = SequenceStatus.WAITING
        self._enqueue_waiting(seq)
        self.version += 1

    def add_running(self, seq: Sequence) -> None:
        """Register a sequence forked from a running one (it already holds shared blocks)."""
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        self.version += 1

    def has_unfinished(self) -> bool:
        """True while any sequence waits, runs or sits swapped out."""
        return bool(self.waiting or self.running or self.swapped)

    def waiting_prompt_blocks(self) -> int:
        """Blocks the waiting sequences would need if nothing were cached (as counted when
        each joined the queue; kept up to date, not recomputed per call)."""
        return self._waiting_blocks_total

    def finish(self, seq: Sequence, status: SequenceStatus) -> None:
        """Take a sequence out of whatever queue holds it and release its blocks."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
            self._left_waiting(seq)
        elif seq.status is SequenceStatus.SWAPPED:
            self.swapped.remove(seq)
        seq.status = status
        self.kv.free(seq.seq_id)
        self.version += 1

    def schedule(self) -> SchedulerOutput:
        """Choose the next step's sequences and reserve their slots."""
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        running, allocate = self.running, self.kv.allocate_slots
        seqs, counts = out.seqs, out.num_new_tokens
        i = 0
        while i < len(running) and budget > 0:
            seq = running[i]
            num_new = seq.num_uncomputed_tokens
            if num_new > budget:
                num_new = budget
            while not allocate(seq, num_new):
                victim = running.pop()
                self._preempt(victim, out)
                if victim is seq:
                    break
            else:
                seqs.append(seq)
                counts.append(num_new)
                budget -= num_new
            i += 1
        if not out.preempted:
            budget = self._resume_swapped(out, budget)
            if not self.swapped:
                self._admit_waiting(out, budget)
        out.copies = self.kv.take_pending_copies()
        return out

    def _resume_swapped(self, out: SchedulerOutput, budget: int) -> int:
        while self.swapped and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.swapped[0]
            if seq.num_pending:  # swapped out with its last token still on the device
                break
            num_new = min(seq.num_uncomputed_tokens, budget)
            num_host = len(self.kv.host_tables.get(seq.seq_id, ()))
            extra = self.kv.blocks_for(seq.num_computed_tokens + num_new) - num_host
            if not self.kv.can_swap_in(seq.seq_id, max(extra, 0)):
                break
            self.swapped.popleft()
            self.version += 1
            out.swap_in.extend(self.kv.swap_in(seq.seq_id))
            if not self.kv.allocate_slots(seq, num_new):  # cannot fail: room was checked
                raise RuntimeError(f"swap-in of sequence {seq.seq_id} lost its reserved blocks")
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.seqs.append(seq)
            out.num_new_tokens.append(num_new)
            budget -= num_new
        return budget

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if seq.num_pending:  # preempted with its last token still on the device
                break
            computed = self.kv.get_computed_blocks(seq)
            num_hit = len(computed) * self.kv.block_size
            num_new = min(seq.num_tokens - seq.num_computed_tokens - num_hit, budget)
            if not self.kv.allocate_slots(seq, num_new, computed):
                break
            self.waiting.popleft()
            self._left_waiting(seq)
            self.version += 1
            self.kv.record_prefix_query(seq.num_tokens)
            seq.num_computed_tokens += num_hit
            if seq.index == 0 and seq.request.metrics.first_scheduled_time is None:
                # queue time ends here, when the request first gets blocks (not after the
                # forward: that would make it equal time to first token)
                seq.request.num_cached_tokens = num_hit
                seq.request.metrics.first_scheduled_time = time.time()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.seqs.append(seq)
            out.num_new_tokens.append(num_new)
            budget -= num_new

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.version += 1
        self.num_preemptions += 1
        seq.num_preemptions += 1
        out.preempted.append(seq)
        if self.preemption_mode == "swap" and self.kv.can_swap_out(seq.seq_id):
            out.swap_out.extend(self.kv.swap_out(seq.seq_id))
            seq.status = SequenceStatus.SWAPPED
            self.swapped.appendleft(seq)
            self.num_swap_outs += 1
            return
        self.kv.free(seq.seq_id)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self._enqueue_waiting(seq, front=True)
