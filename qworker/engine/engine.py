"""The engine: requests in, one batched model step at a time, finished outputs out.

``add_request`` and ``abort`` may be called from any thread: they only touch a
lock-protected inbox, which ``step()`` drains first. ``step()`` itself (schedule,
block copies, forward, sample, stop checks) runs on one thread. ``stats()`` returns a
snapshot taken at the end of the last step plus what sits in the inbox.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import Any

import torch

from qworker.engine.config import EngineConfig, served_model_name
from qworker.engine.detokenizer import start_offsets
from qworker.engine.engine_setup import EngineParts, build_engine_parts
from qworker.engine.model_runner import StepInput
from qworker.engine.outputs import RequestMetrics, RequestOutput
from qworker.engine.sampling_params import SamplingParams
from qworker.engine.sequence import Request, Sequence, SequenceStatus
from qworker.engine.stats import EngineStats
from qworker.errors import ContextLengthExceededError, InvalidRequestError

logger = logging.getLogger(__name__)


class Engine:
    """A continuously batched, paged-KV generator (the Python API of README.md)."""

    def __init__(self, config: EngineConfig) -> None:
        parts: EngineParts = build_engine_parts(config)
        self.config = config
        self.tokenizer = parts.tokenizer
        self.model_name = served_model_name(config)
        self.max_model_len = parts.max_model_len
        self.spec = parts.spec
        self.runner = parts.runner
        self.kv = parts.kv
        self.scheduler = parts.scheduler
        self.sampler = parts.sampler
        self.outputs = parts.outputs
        self.max_concurrent_full_length_seqs = parts.max_concurrent_full_length_seqs
        self._lock = threading.Lock()
        self._inbox: list[Request] = []
        self._aborts: list[str] = []
        self._live_ids: set[str] = set()
        self._requests: dict[str, Request] = {}
        self._next_seq_id = 0
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self._snapshot = EngineStats()
        self._take_snapshot()

    # ---- thread-safe surface -------------------------------------------------------

    def validate_prompt(
        self, prompt: str | list[int], params: SamplingParams
    ) -> tuple[str | None, list[int]]:
        """Check ``prompt`` and ``params``; return ``(text or None, token ids)`` or raise
        ``InvalidRequestError`` / ``ContextLengthExceededError`` naming the problem."""
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"params must be a SamplingParams, got {type(params)!r}")
        params.validate()
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError(
                    "prompt is text but the model has no tokenizer: pass token ids instead"
                )
            if not prompt:
                raise InvalidRequestError("prompt is empty")
            text: str | None = prompt
            ids = list(self.tokenizer.encode(prompt))
        elif isinstance(prompt, list | tuple):
            text = None
            ids = list(prompt)
            vocab = self.spec.vocab_size
            bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool)
                   or not 0 <= t < vocab]
            if bad:
                raise InvalidRequestError(
                    f"prompt token ids must be integers in [0, {vocab}); got {bad[:5]!r}"
                )
        else:
            raise InvalidRequestError(f"prompt must be a string or a list of token ids, got "
                                      f"{type(prompt).__name__}")
        if not ids:
            raise InvalidRequestError("prompt is empty")
        if len(ids) >= self.max_model_len:
            raise ContextLengthExceededError(
                f"prompt has {len(ids)} tokens; max_model_len is {self.max_model_len} and at "
                "least one token must be generated"
            )
        self.sampler.validate(params)  # compiles a structured output grammar (cached)
        return text, ids

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
    ) -> None:
        """Validate and queue a request (any thread); it joins the batch at the next step."""
        text, ids = self.validate_prompt(prompt, params)
        self.add_validated(request_id, text, ids, params, arrival_time)

    def add_validated(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
    ) -> None:
        """Queue a request whose prompt already passed ``validate_prompt`` (any thread)."""
        if not isinstance(request_id, str) or not request_id:
            raise InvalidRequestError(f"request_id must be a non-empty string, got {request_id!r}")
        max_tokens = params.max_tokens or self.max_model_len
        request = Request(
            request_id=request_id,
            prompt=prompt,
            prompt_token_ids=prompt_token_ids,
            params=params,
            max_tokens=max_tokens,
            metrics=RequestMetrics(arrival_time=arrival_time or time.time()),
        )
        with self._lock:
            if request_id in self._live_ids:
                raise InvalidRequestError(f"request_id {request_id!r} is already in the engine")
            self._live_ids.add(request_id)
            self._inbox.append(request)

    def abort(self, request_id: str) -> None:
        """Abort a request (any thread); its output comes from the next step, "abort"."""
        with self._lock:
            self._aborts.append(request_id)

    def has_unfinished(self) -> bool:
        """True while any request is queued, running or not yet returned (any thread)."""
        with self._lock:
            return bool(self._live_ids)

    def encode_chat(self, messages: list[dict[str, Any]]) -> list[int]:
        """Token ids of ``messages`` through the tokenizer's chat template, ready to answer."""
        tok = self.tokenizer
        if tok is None or not getattr(tok, "chat_template", None):
            raise InvalidRequestError("the model has no tokenizer chat template; send a prompt")
        try:
            text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as exc:
            raise InvalidRequestError(f"messages do not fit the chat template: {exc}") from exc
        return list(tok.encode(text, add_special_tokens=False))

    def stats(self) -> EngineStats:
        """Snapshot of pool and counter figures at the last step, plus the inbox (any thread)."""
        with self._lock:
            return dataclasses.replace(
                self._snapshot,
                num_requests_waiting=self._snapshot.num_requests_waiting + len(self._inbox),
                waiting_prompt_blocks=self._snapshot.waiting_prompt_blocks + sum(
                    self.kv.blocks_for(len(r.prompt_token_ids)) for r in self._inbox
                ),
            )

    # ---- engine thread -------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one iteration; return the outputs of requests that finished or were aborted."""
        finished: list[Request] = []
        self._drain_inbox(finished)
        sched = self.scheduler.schedule()
        if not sched.is_empty:
            self._run(sched.seqs, sched.num_new_tokens, sched, finished)
        outputs = [self.outputs.make_output(r) for r in finished]
        with self._lock:
            for r in finished:
                self._live_ids.discard(r.request_id)
                self._requests.pop(r.request_id, None)
            self._take_snapshot()
        return outputs

    def _drain_inbox(self, finished: list[Request]) -> None:
        with self._lock:
            inbox, self._inbox = self._inbox, []
            aborts, self._aborts = self._aborts, []
        for request in inbox:
            seq = self._new_seq(request, 0, list(request.prompt_token_ids))
            self._requests[request.request_id] = request
            self.scheduler.add(seq)
        for rid in aborts:
            request = self._requests.get(rid)
            if request is None or request in finished:
                continue
            for seq in request.seqs:
                if not seq.is_finished:
                    self.scheduler.finish(seq, SequenceStatus.FINISHED_ABORTED)
            request.metrics.finished_time = time.time()
            finished.append(request)

    def _new_seq(self, request: Request, index: int, token_ids: list[int]) -> Sequence:
        num_prompt = len(request.prompt_token_ids)
        seq = Sequence(self._next_seq_id, request, index, token_ids, num_prompt)
        seq.prefix_offset, seq.read_offset = start_offsets(num_prompt)
        self._next_seq_id += 1
        request.seqs.append(seq)
        return seq

    def _run(self, seqs: list[Sequence], num_new: list[int], sched: Any,
             finished: list[Request]) -> None:
        runner = self.runner
        runner.swap_out(sched.swap_out)
        runner.swap_in(sched.swap_in)
        runner.copy_blocks(sched.copies)
        order = sorted(range(len(seqs)), key=lambda i: num_new[i] != 1)  # decodes first
        seqs = [seqs[i] for i in order]
        num_new = [num_new[i] for i in order]
        sample = [s.num_computed_tokens + n == s.num_tokens for s, n in zip(seqs, num_new,
                                                                             strict=True)]
        step = StepInput(
            token_chunks=[s.token_ids[s.num_computed_tokens : s.num_computed_tokens + n]
                          for s, n in zip(seqs, num_new, strict=True)],
            num_computed=[s.num_computed_tokens for s in seqs],
            block_tables=[self.kv.block_ids(s.seq_id) for s in seqs],
            sample=sample,
        )
        self.sampler.prepare([s for s, smp in zip(seqs, sample, strict=True) if smp])
        logits = runner.execute(step)
        now = time.time()
        rows: list[int] = []
        sampling: list[Sequence] = []
        num_logit_rows = 0
        for seq, n, samples in zip(seqs, num_new, sample, strict=True):
            seq.num_computed_tokens += n
            self.kv.cache_full_blocks(seq)
            if seq.request.metrics.first_scheduled_time is None:
                seq.request.metrics.first_scheduled_time = now
            if samples:
                rows.append(num_logit_rows)
                sampling.append(seq)
                self._fork_siblings(seq, num_logit_rows, rows, sampling)
                num_logit_rows += 1
        if logits is None or not sampling:
            return
        if len(rows) != logits.shape[0]:
            logits = logits[torch.tensor(rows, device=logits.device)]
        result = self.sampler.sample(logits, sampling)
        for i, seq in enumerate(sampling):
            request = seq.request
            if seq.num_output_tokens == 0 and seq.index == 0:
                self.prompt_tokens += seq.num_prompt_tokens
            status = self.outputs.append_token(
                seq, result.token_ids[i], result.logprobs[i], result.top_logprobs[i]
            )
            self.generation_tokens += 1
            if request.metrics.first_token_time is None:
                request.metrics.first_token_time = now
            if status is not None:
                self.scheduler.finish(seq, status)
                if request.is_finished:
                    request.metrics.finished_time = time.time()
                    finished.append(request)

    def _fork_siblings(self, seq: Sequence, row: int, rows: list[int],
                       sampling: list[Sequence]) -> None:
        """At a request's first sample, create its other ``n - 1`` sequences sharing blocks."""
        request = seq.request
        if request.params.n == 1 or len(request.seqs) == request.params.n:
            return
        for index in range(1, request.params.n):
            child = self._new_seq(request, index, list(seq.token_ids))
            child.num_computed_tokens = seq.num_computed_tokens
            child.block_hashes = list(seq.block_hashes)
            self.kv.fork(seq.seq_id, child.seq_id)
            self.scheduler.add_running(child)
            rows.append(row)
            sampling.append(child)

    def _take_snapshot(self) -> None:
        pool = self.kv.pool
        sched = self.scheduler
        running_requests = {s.request.request_id for s in sched.running}
        waiting_requests = {s.request.request_id for s in sched.waiting}
        self._snapshot = EngineStats(
            num_kv_blocks=pool.num_blocks,
            block_size=self.kv.block_size,
            kv_blocks_used=pool.num_used_blocks,
            kv_cache_usage_perc=pool.usage,
            num_free_blocks=pool.num_free_blocks,
            prefix_cache_queries=pool.prefix_cache_queries,
            prefix_cache_hits=pool.prefix_cache_hits,
            num_preemptions=sched.num_preemptions,
            num_swap_outs=sched.num_swap_outs,
            prompt_tokens=self.prompt_tokens,
            generation_tokens=self.generation_tokens,
            num_requests_running=len(running_requests),
            num_requests_waiting=len(waiting_requests - running_requests),
            num_requests_swapped=len({s.request.request_id for s in sched.swapped}),
            waiting_prompt_blocks=sched.waiting_prompt_blocks(),
            max_model_len=self.max_model_len,
            max_num_seqs=sched.max_num_seqs,
            max_concurrent_full_length_seqs=self.max_concurrent_full_length_seqs,
            attention_backend=self.runner.backend.name,
            kv_cache_dtype=self.config.kv_cache_dtype,
        )
