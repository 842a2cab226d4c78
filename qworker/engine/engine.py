"""The engine: requests in, one batched model step at a time, finished outputs out.

``add_request`` and ``abort`` may be called from any thread: they only touch a
lock-protected inbox, which ``step()`` drains first. ``step()`` itself (schedule,
block copies, forward, sample, stop checks) runs on one thread. ``stats()`` returns a
snapshot taken at the end of the last step plus what sits in the inbox.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
import weakref
from collections.abc import Iterator
from typing import Any

from qworker.attention.kernel_cache import KernelRunner
from qworker.engine.config import EngineConfig, served_model_name
from qworker.engine.detokenizer import start_offsets
from qworker.engine.engine_setup import EngineParts, build_engine_parts
from qworker.engine.outputs import RequestMetrics, RequestOutput
from qworker.engine.sampling_params import SamplingParams
from qworker.engine.sequence import Request, Sequence, SequenceStatus
from qworker.engine.stats import EngineStats
from qworker.engine.step_pipeline import (
    LaunchedStep,
    StepPipeline,
    needs_host_history,
    without_finished,
)
from qworker.errors import ContextLengthExceededError, InvalidRequestError, ModelLoadError

logger = logging.getLogger(__name__)


class Engine:
    """A continuously batched, paged-KV generator (the Python API of README.md)."""

    #: What this engine serves (``EmbeddingEngine.task`` is "embed"; ``open_engine`` picks).
    task: str = "generate"

    def __init__(self, config: EngineConfig, kernels: KernelRunner | None = None,
                 tp_group: Any = None) -> None:
        """Build the engine ``config`` describes. ``kernels``: tests run the CUDA backend's
        kernels through the CPU emulator this way. ``tp_group``: a running
        ``qworker.engine.parallel.launcher.TensorParallelGroup`` to serve on (the caller
        keeps it: ``close`` only releases it); by default a ``tensor_parallel_size > 1``
        engine starts its own and shuts it down on ``close``, or at exit."""
        if config.task == "embed":
            raise ModelLoadError("task 'embed' is served by EmbeddingEngine: build engines "
                                 "with qworker.engine.open_engine(config)")
        parts: EngineParts = build_engine_parts(config, tp_group, kernels)
        self.tp_group = parts.tp_group
        self._close_group: Any = None
        if self.tp_group is not None:
            self._close_group = (self.tp_group.release if tp_group is not None else
                                 weakref.finalize(self, self.tp_group.shutdown))
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
        self.selftest = parts.selftest
        self._lock = threading.Lock()
        self._batch_lock = threading.Lock()  # held by ``inbox_batch``; the drain waits for it
        self._inbox: list[Request] = []
        self._aborts: list[str] = []
        self._live_ids: set[str] = set()
        self._requests: dict[str, Request] = {}
        self._next_seq_id = 0
        self.pipeline = StepPipeline(self.runner, self.kv, self.scheduler, self.sampler,
                                     self.outputs, self._fork)
        # Overlap needs a device that runs while the host works; on the CPU it buys nothing.
        self.async_scheduling = config.async_scheduling and self.runner.device.type != "cpu"
        self._inflight: LaunchedStep | None = None
        self.num_overlapped_steps = 0  # steps launched before the previous one was processed
        self._snapshot = EngineStats()
        self._counted_version = -1
        self._request_counts = (0, 0, 0)
        self._take_snapshot()

    @property
    def prompt_tokens(self) -> int:
        """Prompt tokens of requests that produced a first token (a counter)."""
        return self.pipeline.prompt_tokens

    @prompt_tokens.setter
    def prompt_tokens(self, value: int) -> None:
        self.pipeline.prompt_tokens = value

    @property
    def generation_tokens(self) -> int:
        """Tokens generated so far (a counter)."""
        return self.pipeline.generation_tokens

    @generation_tokens.setter
    def generation_tokens(self, value: int) -> None:
        self.pipeline.generation_tokens = value

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
            needs_host_history=needs_host_history(params),
        )
        with self._lock:
            if request_id in self._live_ids:
                raise InvalidRequestError(f"request_id {request_id!r} is already in the engine")
            self._live_ids.add(request_id)
            self._inbox.append(request)

    @contextlib.contextmanager
    def inbox_batch(self) -> Iterator[None]:
        """Requests added inside the block reach the engine in the same step (any thread).

        A step that would start meanwhile waits for the block to end, so keep the block
        to the adding itself: nothing inside may wait for the engine thread.
        """
        with self._batch_lock:
            yield

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

    def failed(self) -> str | None:
        """Why the engine can never step again (a tensor-parallel rank died or hung), or
        None (any thread; the worker's watchdog polls it)."""
        group = self.tp_group
        broken = group.broken if group is not None else None
        return str(broken) if broken is not None else None

    def close(self) -> None:
        """Stop the engine's other tensor-parallel ranks (release a group it was given);
        nothing to do with one rank. Any thread; the engine cannot step afterwards."""
        close, self._close_group = self._close_group, None
        if close is not None:
            close()

    # ---- engine thread -------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one iteration; return the outputs of requests that finished or were aborted.

        With ``async_scheduling`` the step scheduled here is launched before the previous
        step's samples are processed (see ``step_pipeline``); either way every output
        is exactly what the one-step-at-a-time engine produces.
        """
        finished: list[Request] = []
        self._drain_inbox(finished)
        pipeline = self.pipeline
        sched = self.scheduler.schedule()
        prev, self._inflight = self._inflight, None
        launched = None
        if prev is None or pipeline.can_overlap(sched):
            launched = pipeline.launch(sched, prev)
            self.num_overlapped_steps += prev is not None and bool(sched.seqs)
        if prev is not None:
            pipeline.process(prev, finished)
            if launched is None:
                launched = pipeline.launch(without_finished(sched), None)
        if self.async_scheduling:
            self._inflight = launched
        else:
            pipeline.process(launched, finished)
        outputs = [self.outputs.make_output(r) for r in finished]
        with self._lock:
            for r in finished:
                self._live_ids.discard(r.request_id)
                self._requests.pop(r.request_id, None)
            self._take_snapshot()
        return outputs

    def _drain_inbox(self, finished: list[Request]) -> None:
        with self._batch_lock, self._lock:
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

    def _fork(self, seq: Sequence, index: int) -> Sequence:
        """Sibling ``index`` of ``seq`` at its request's first sample, sharing its blocks."""
        child = self._new_seq(seq.request, index, list(seq.token_ids))
        child.num_computed_tokens = seq.num_computed_tokens
        child.block_hashes = list(seq.block_hashes)
        self.kv.fork(seq.seq_id, child.seq_id)
        self.scheduler.add_running(child)
        return child

    def _take_snapshot(self) -> None:
        pool = self.kv.pool
        sched = self.scheduler
        if self._counted_version != sched.version:  # membership changed: recount requests
            running_requests = {s.request.request_id for s in sched.running}
            waiting_requests = {s.request.request_id for s in sched.waiting}
            self._request_counts = (
                len(running_requests), len(waiting_requests - running_requests),
                len({s.request.request_id for s in sched.swapped}))
            self._counted_version = sched.version
        num_running, num_waiting, num_swapped = self._request_counts
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
            prompt_tokens=self.pipeline.prompt_tokens,
            generation_tokens=self.pipeline.generation_tokens,
            num_requests_running=num_running,
            num_requests_waiting=num_waiting,
            num_requests_swapped=num_swapped,
            waiting_prompt_blocks=sched.waiting_prompt_blocks(),
            max_model_len=self.max_model_len,
            max_num_seqs=sched.max_num_seqs,
            max_concurrent_full_length_seqs=self.max_concurrent_full_length_seqs,
            attention_backend=self.selftest.attention_backend or self.runner.backend.name,
            kernel_selftest=self.selftest.state.value,
            kernel_paths=dict(self.selftest.paths),
            kv_cache_dtype=self.config.kv_cache_dtype,
            cuda_graphs=self.runner.graphs is not None and self.runner.graphs.captured,
        )
