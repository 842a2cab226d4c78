"""Running scheduled steps: launch one, process the samples of the one before.

``launch`` executes a step's block copies, builds its inputs, runs the forward and the
sampler, and starts the step's single device-to-host copy of the sampled ids — it
never waits for the device. ``process`` waits for that copy and does the host side:
append each token, check stop conditions, free finished sequences.

With overlap (``Engine.async_scheduling``, the GPU default) the engine launches step
N+1 before processing step N, so scheduling and output processing run while the
device computes. A sequence sampled in step N is then scheduled in N+1 with its new
token still on the device (``Sequence.num_pending``): its input id comes from N's
device ids (``StepInput.prev_rows``). Results stay exact: a sequence that N finishes
(stop, length, abort) computes one discarded token in N+1 and its blocks are freed
at N's processing (later device writes are stream-ordered after N+1's); blocks are
hashed for the prefix cache only once all their tokens are known; a preempted or
swapped sequence waits for its pending token before it is rescheduled; a step with a
sequence whose sampling needs its full history on the host (``needs_host_history``)
is launched only after the previous step was processed.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from qworker.engine.kv_cache_manager import KVCacheManager
from qworker.engine.model_runner import ModelRunner
from qworker.engine.output_processor import OutputProcessor
from qworker.engine.sampling_params import SamplingParams
from qworker.engine.scheduler import Scheduler, SchedulerOutput
from qworker.engine.sequence import Request, Sequence
from qworker.engine.step_inputs import StepInput


def needs_host_history(params: SamplingParams) -> bool:
    """True when sampling a row reads its previous tokens on the host (repetition-type
    penalties over ``token_ids``, grammar state advanced as tokens arrive), so the row
    cannot be sampled while its previous token is still on the device."""
    own = getattr(params, "needs_host_history", None)
    if isinstance(own, bool):
        return own
    return (params.repetition_penalty != 1.0
            or bool(getattr(params, "presence_penalty", 0.0))
            or bool(getattr(params, "frequency_penalty", 0.0))
            or getattr(params, "structured_outputs", None) is not None)


@dataclass(slots=True)
class LaunchedStep:
    """A step whose forward and sampling were issued; ``process`` finishes it."""

    sampling: list[Sequence] = field(default_factory=list)  # one per sampled row
    output: Any = None  # the sampler's output (token ids on the device)
    token_ids: torch.Tensor | None = None  # int64 [rows] on the device
    row_of: dict[int, int] = field(default_factory=dict)  # seq_id -> sampled row


class StepPipeline:
    """Launches scheduled steps and processes their samples; the engine thread only."""

    def __init__(self, runner: ModelRunner, kv: KVCacheManager, scheduler: Scheduler,
                 sampler: Any, outputs: OutputProcessor,
                 fork: Callable[[Sequence, int], Sequence]) -> None:
        self.runner = runner
        self.kv = kv
        self.scheduler = scheduler
        self.sampler = sampler
        self.outputs = outputs
        self._fork = fork
        self.prompt_tokens = 0
        self.generation_tokens = 0

    @staticmethod
    def can_overlap(sched: SchedulerOutput) -> bool:
        """Whether ``sched`` may launch before the step in flight is processed."""
        return not any(s.num_pending and s.request.needs_host_history for s in sched.seqs)

    def launch(self, sched: SchedulerOutput, prev: LaunchedStep | None) -> LaunchedStep:
        """Issue ``sched``: block ops, inputs, forward, sampling, the async copy back."""
        runner, kv = self.runner, self.kv
        runner.swap_out(sched.swap_out)
        runner.swap_in(sched.swap_in)
        runner.copy_blocks(sched.copies)
        if not sched.seqs:
            return LaunchedStep()
        seqs, num_new = sched.seqs, sched.num_new_tokens
        if any(n != 1 for n in num_new):  # decodes first (stable among each kind)
            order = sorted(range(len(seqs)), key=lambda i: num_new[i] != 1)
            seqs, num_new = [seqs[i] for i in order], [num_new[i] for i in order]
        chunks: list[list[int]] = []
        computed: list[int] = []
        sample: list[int] = []
        prev_rows: list[int] | None = None
        prev_row_of = prev.row_of if prev is not None else {}
        for i, (s, n) in enumerate(zip(seqs, num_new, strict=True)):
            done = s.num_computed_tokens
            tokens = s.token_ids
            chunk = tokens[done : done + n]
            if len(chunk) < n:  # the last token is pending: read it from the device
                row = prev_row_of.get(s.seq_id, -1)
                if row < 0:
                    raise RuntimeError(f"sequence {s.seq_id} has a pending token but no "
                                       "step in flight holds it")
                if prev_rows is None:
                    prev_rows = [-1] * len(seqs)
                prev_rows[i] = row
                chunk.append(0)
            chunks.append(chunk)
            computed.append(done)
            # rows sampled: 0 mid-prompt, n at a request's first token (siblings forked
            # then), else 1
            if done + n != len(tokens) + s.num_pending:
                sample.append(0)
            else:
                k = s.request.params.n
                sample.append(k if k > 1 and len(s.request.seqs) < k else 1)
        tables, keys = kv.step_tables([s.seq_id for s in seqs])
        step = StepInput(chunks, computed, tables, sample, keys, prev_rows)
        prepare = getattr(self.sampler, "prepare", None)
        if callable(prepare):  # e.g. grammar masks, filled while the forward runs
            prepare([s for s, rows in zip(seqs, sample, strict=True) if rows])
        with torch.inference_mode():
            logits = runner.execute(step, prev.token_ids if prev is not None else None)
            return self._sample(seqs, num_new, sample, logits)

    def _sample(self, seqs: list[Sequence], num_new: list[int], sample: list[int],
                logits: torch.Tensor | None) -> LaunchedStep:
        """Advance the launched sequences, fork siblings, sample on the device."""
        kv = self.kv
        bs = kv.block_size
        sampling: list[Sequence] = []
        positions: list[int] = []
        for seq, n, rows in zip(seqs, num_new, sample, strict=True):
            done = seq.num_computed_tokens
            seq.num_computed_tokens = done + n
            if (done + n) // bs != done // bs:  # a block was completed
                kv.cache_full_blocks(seq)
            if rows:
                sampling.append(seq)
                positions.append(len(seq.token_ids) - seq.num_prompt_tokens + seq.num_pending)
                for index in range(1, rows):
                    sampling.append(self._fork(seq, index))
                    positions.append(0)
        if logits is None or not sampling:
            return LaunchedStep()
        output = self.sampler.sample(logits, sampling, positions)
        token_ids = getattr(output, "token_ids_device", None)
        if token_ids is None:  # a sampler that returns host lists (it has synced already)
            token_ids = torch.tensor(output.token_ids, dtype=torch.int64).to(logits.device)
        else:
            output.to_host()  # the step's one device-to-host copy, not awaited here
        row_of = {}
        for i, s in enumerate(sampling):
            s.num_pending += 1
            row_of[s.seq_id] = i
        return LaunchedStep(sampling, output, token_ids, row_of)

    def process(self, launched: LaunchedStep, finished: list[Request]) -> None:
        """Append the sampled tokens (waiting for them), stop and free what ended."""
        if launched.output is None:
            return
        result = launched.output
        token_ids = result.token_ids  # waits for the copy
        logprobs, tops = result.logprobs, result.top_logprobs
        now = time.time()
        append, cache = self.outputs.append_token, self.kv.cache_full_blocks
        bs = self.kv.block_size
        generated = 0
        for i, seq in enumerate(launched.sampling):
            seq.num_pending -= 1
            if seq.status.finished:  # finished (or aborted) after this step was launched
                continue
            request = seq.request
            tokens = seq.token_ids
            if seq.index == 0 and len(tokens) == seq.num_prompt_tokens:
                self.prompt_tokens += seq.num_prompt_tokens
            status = append(seq, token_ids[i], logprobs[i], tops[i])
            generated += 1
            # The token may complete a block whose KV is computed (it was fed already).
            if seq.num_computed_tokens >= len(tokens) and not len(tokens) % bs:
                cache(seq)
            metrics = request.metrics
            if metrics.first_token_time is None:
                metrics.first_token_time = now
            if status is not None:
                self.scheduler.finish(seq, status)
                if request.is_finished:
                    metrics.finished_time = time.time()
                    finished.append(request)
        self.generation_tokens += generated


def without_finished(sched: SchedulerOutput) -> SchedulerOutput:
    """``sched`` minus the sequences that finished since it was made (their blocks are
    already freed); block operations are kept."""
    keep = [i for i, s in enumerate(sched.seqs) if not s.is_finished]
    if len(keep) == len(sched.seqs):
        return sched
    return SchedulerOutput(
        seqs=[sched.seqs[i] for i in keep],
        num_new_tokens=[sched.num_new_tokens[i] for i in keep],
        swap_out=sched.swap_out, swap_in=sched.swap_in, copies=sched.copies,
        preempted=sched.preempted)
