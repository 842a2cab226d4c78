"""The embedding engine: inputs in, one packed prefill-only forward per step, vectors out.

A request carries one or more inputs (token ids). ``step()`` takes waiting inputs
first-come first-served across requests until ``max_num_batched_tokens`` (an input
longer than the budget runs alone) or ``max_num_seqs`` inputs, packs them end to end
(``qworker.models.packed_attention.PackedBatch``), runs the model once, pools each
input's tokens (``qworker.models.pooling``) and returns the requests whose every input
is done. Nothing is cached between steps: no KV pool, no blocks. On the CPU in fp32 the
linear layers run through the packed matmuls (``qworker.models.cpu_gemm``); elsewhere
torch, with SDPA for attention. docs/embeddings.md describes the choices.

Thread-safety as ``Engine``: ``add_embedding``, ``abort``, ``has_unfinished`` and
``stats`` may be called from any thread (they touch a lock-protected inbox);
``step()`` runs on one thread. It satisfies the worker's ``EngineLike`` protocol; the
generation calls raise ``InvalidRequestError`` saying the engine serves embeddings.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from qworker.engine.config import EngineConfig, check_config, served_model_name
from qworker.engine.engine_setup import (
    available_cores,
    pack_cpu_linears,
    resolve_device,
    resolve_dtype,
    set_cpu_threads,
)
from qworker.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from qworker.engine.sampling_params import SamplingParams
from qworker.engine.stats import EngineStats
from qworker.errors import ContextLengthExceededError, InvalidRequestError, ModelLoadError
from qworker.models.embedding_loader import load_embedding_model
from qworker.models.packed_attention import PackedBatch
from qworker.models.pooling import pool

logger = logging.getLogger(__name__)

_SERVES = "this engine serves embeddings (task 'embed'): send /v1/embeddings inputs"


@dataclass(slots=True)
class EmbeddingRequest:
    """One request's inputs and the vectors computed so far (the engine thread's)."""

    request_id: str
    inputs: list[list[int]]
    dimensions: int | None
    metrics: RequestMetrics
    vectors: list[torch.Tensor | None] = field(default_factory=list)
    next_input: int = 0  # inputs handed to a step so far
    done: int = 0  # inputs pooled so far


class EmbeddingEngine:
    """A packed, prefill-only embedding engine over an ``EngineConfig`` with task "embed".

    ``embedding_dim`` is the model's output width (pooling modes concatenated);
    ``max_model_len`` the longest input in tokens: the model's positions, capped by
    ``max_model_len`` and by a sentence-transformers ``max_seq_length``.
    """

    task: str = "embed"

    def __init__(self, config: EngineConfig) -> None:
        check_config(config)
        if config.tensor_parallel_size != 1:
            raise ModelLoadError("task 'embed' runs on one device: tensor_parallel_size must "
                                 "be 1")
        self.config = config
        device = resolve_device(config.device)
        dtype = resolve_dtype(config.dtype, device)
        torch.manual_seed(config.seed)
        cores = available_cores()
        set_cpu_threads(device, config.cpu_threads, cores)
        cache = Path(config.model_cache) if config.model_cache else None
        loaded = load_embedding_model(config.model, dtype, device, cache_dir=cache,
                                      load_format=config.load_format)
        self.model = loaded.model
        self.rule = loaded.rule
        self.architecture = loaded.architecture
        self.device, self.dtype = device, dtype
        self.gemm_threads = 0
        if device.type == "cpu" and dtype == torch.float32:
            self.gemm_threads = pack_cpu_linears(self.model, config.cpu_threads or cores)
        from qworker.models.loader import load_tokenizer

        self.tokenizer = load_tokenizer(config.tokenizer or loaded.source, cache_dir=cache)
        self.model_name = served_model_name(config)
        limit = self.model.max_positions
        if config.max_model_len is not None and config.max_model_len > limit:
            raise ModelLoadError(f"max_model_len {config.max_model_len} exceeds the "
                                 f"model's {limit} positions")
        caps = [limit, config.max_model_len, self.rule.max_seq_length]
        self.max_model_len = min(c for c in caps if c is not None)
        self.embedding_dim = self.rule.output_dim(self.model.hidden_size)
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.max_num_seqs = config.max_num_seqs
        self.vocab_size = int(loaded.config.vocab_size)
        self._lock = threading.Lock()
        self._batch_lock = threading.Lock()  # held by ``inbox_batch``
        self._inbox: list[EmbeddingRequest] = []
        self._aborts: list[str] = []
        self._live_ids: set[str] = set()
        self._waiting: deque[EmbeddingRequest] = deque()
        self.prompt_tokens = 0
        self.num_steps = 0
        logger.info("embedding engine: %s, dim %d, max_model_len %d, %d tokens per step, "
                    "%s on %s%s", self.architecture, self.embedding_dim, self.max_model_len,
                    self.max_num_batched_tokens, dtype, device,
                    f", packed matmuls on {self.gemm_threads} threads"
                    if self.gemm_threads else "")

    # ---- the embedding surface (thread-safe) --------------------------------------

    def validate_embedding_input(self, item: str | list[int]) -> list[int]:
        """Token ids of one input: text is tokenized with the special tokens the model's
        tokenizer adds (as sentence-transformers does); ids are checked against the
        vocabulary. ``InvalidRequestError`` when empty or malformed,
        ``ContextLengthExceededError`` when longer than ``max_model_len``."""
        if isinstance(item, str):
            if not item:
                raise InvalidRequestError("input is an empty string")
            if self.tokenizer is None:
                raise InvalidRequestError("input is text but the model has no tokenizer: "
                                          "send token ids instead")
            ids = list(self.tokenizer(item)["input_ids"])
        elif isinstance(item, list | tuple):
            ids = list(item)
            if not ids:
                raise InvalidRequestError("input is an empty list of token ids")
            bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool)
                   or not 0 <= t < self.vocab_size]
            if bad:
                raise InvalidRequestError(f"input token ids must be integers in "
                                          f"[0, {self.vocab_size}); got {bad[:5]!r}")
        else:
            raise InvalidRequestError(f"input must be a string or a list of token ids, got "
                                      f"{type(item).__name__}")
        if len(ids) > self.max_model_len:
            raise ContextLengthExceededError(
                f"input has {len(ids)} tokens; this model's maximum is {self.max_model_len}")
        return ids

    def check_dimensions(self, dimensions: int | None) -> None:
        """``InvalidRequestError`` (param ``dimensions``) unless None or 1..embedding_dim."""
        if dimensions is None:
            return
        if (not isinstance(dimensions, int) or isinstance(dimensions, bool)
                or not 1 <= dimensions <= self.embedding_dim):
            raise InvalidRequestError(f"dimensions must be an integer from 1 to "
                                      f"{self.embedding_dim}, got {dimensions!r}")

    def add_embedding(self, request_id: str, inputs: list[list[int]],
                      dimensions: int | None = None, arrival_time: float | None = None) -> None:
        """Queue a request of validated inputs (``validate_embedding_input``); any thread.
        Its output, one vector per input, comes from the step that pools its last input."""
        if not isinstance(request_id, str) or not request_id:
            raise InvalidRequestError(f"request_id must be a non-empty string, got {request_id!r}")
        if not inputs:
            raise InvalidRequestError("input is empty: give at least one string or token list")
        self.check_dimensions(dimensions)
        request = EmbeddingRequest(request_id, [list(i) for i in inputs], dimensions,
                                   RequestMetrics(arrival_time=arrival_time or time.time()),
                                   [None] * len(inputs))
        with self._lock:
            if request_id in self._live_ids:
                raise InvalidRequestError(f"request_id {request_id!r} is already in the engine")
            self._live_ids.add(request_id)
            self._inbox.append(request)

    @contextlib.contextmanager
    def inbox_batch(self) -> Iterator[None]:
        """Requests added inside the block reach the engine in the same step (any thread)."""
        with self._batch_lock:
            yield

    def abort(self, request_id: str) -> None:
        """Drop a request (any thread): the next step returns it once, ``embeddings`` None
        and one completion with finish_reason "abort" (as ``Engine`` reports aborts)."""
        with self._lock:
            self._aborts.append(request_id)

    def has_unfinished(self) -> bool:
        """True while any request is queued or not yet returned (any thread)."""
        with self._lock:
            return bool(self._live_ids)

    def stats(self) -> EngineStats:
        """Counters (``prompt_tokens``: tokens embedded) and queue sizes; KV figures are 0."""
        with self._lock:
            waiting = len(self._waiting) + len(self._inbox)
            return EngineStats(
                # block_size stays the configured one: callers divide by it
                num_kv_blocks=0, block_size=self.config.block_size,
                prompt_tokens=self.prompt_tokens,
                num_requests_waiting=waiting, max_model_len=self.max_model_len,
                max_num_seqs=self.max_num_seqs, attention_backend="sdpa",
                kv_cache_dtype="none", kernel_selftest="not_applicable")

    def failed(self) -> str | None:
        """Always None: one process, nothing that dies apart from the caller."""
        return None

    def close(self) -> None:
        """Nothing to release (one device, no other ranks)."""

    # ---- generation calls: refused --------------------------------------------------

    def validate_prompt(self, prompt: str | list[int], params: SamplingParams
                        ) -> tuple[str | None, list[int]]:
        """Refused: ``InvalidRequestError`` (this engine embeds)."""
        raise InvalidRequestError(_SERVES)

    def add_validated(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                      params: SamplingParams, arrival_time: float | None = None) -> None:
        """Refused: ``InvalidRequestError`` (this engine embeds)."""
        raise InvalidRequestError(_SERVES)

    def encode_chat(self, messages: list[dict[str, Any]]) -> list[int]:
        """Refused: ``InvalidRequestError`` (this engine embeds)."""
        raise InvalidRequestError(_SERVES)

    # ---- engine thread --------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Embed one packed batch of waiting inputs; return the requests now complete
        (and those aborted since the last step)."""
        finished: list[RequestOutput] = []
        self._drain_inbox(finished)
        items = self._schedule()
        if items:
            try:
                self._run(items)
            except BaseException:
                self._requeue(items)
                raise
            for request, _ in items:
                if request.done == len(request.inputs) and request.next_input >= 0:
                    request.next_input = -1  # reported once
                    finished.append(self._output(request))
        with self._lock:
            for out in finished:
                self._live_ids.discard(out.request_id)
        return finished

    def _drain_inbox(self, finished: list[RequestOutput]) -> None:
        with self._batch_lock, self._lock:
            inbox, self._inbox = self._inbox, []
            aborts, self._aborts = self._aborts, []
        self._waiting.extend(inbox)
        if not aborts:
            return
        dropped = set(aborts)
        kept: deque[EmbeddingRequest] = deque()
        for request in self._waiting:
            if request.request_id in dropped:
                request.metrics.finished_time = time.time()
                finished.append(RequestOutput(
                    request.request_id, None, [t for i in request.inputs for t in i],
                    [CompletionOutput(0, "", [], finish_reason="abort")], True,
                    request.metrics))
            else:
                kept.append(request)
        self._waiting = kept

    def _schedule(self) -> list[tuple[EmbeddingRequest, int]]:
        """Waiting inputs for this step, first come first served, within the budgets."""
        items: list[tuple[EmbeddingRequest, int]] = []
        tokens = 0
        while self._waiting and len(items) < self.max_num_seqs:
            request = self._waiting[0]
            length = len(request.inputs[request.next_input])
            if items and tokens + length > self.max_num_batched_tokens:
                break
            items.append((request, request.next_input))
            tokens += length
            request.next_input += 1
            if request.next_input == len(request.inputs):
                self._waiting.popleft()
        return items

    def _requeue(self, items: list[tuple[EmbeddingRequest, int]]) -> None:
        """Put a failed step's inputs back at the head of the queue, in their order, so
        the next step retries them and ``abort`` can still find their requests."""
        first: dict[int, tuple[EmbeddingRequest, int]] = {}
        for request, i in items:
            first.setdefault(id(request), (request, i))
        head = self._waiting[0] if self._waiting else None
        popped = [r for r, _ in first.values() if r is not head]
        for request, i in first.values():
            request.next_input = i
        self._waiting.extendleft(reversed(popped))

    @torch.inference_mode()
    def _run(self, items: list[tuple[EmbeddingRequest, int]]) -> None:
        # shortest first: attention groups of similar lengths (packed_attention.py)
        items = sorted(items, key=lambda item: len(item[0].inputs[item[1]]))
        inputs = [request.inputs[i] for request, i in items]
        lengths = [len(ids) for ids in inputs]
        flat = torch.tensor([t for ids in inputs for t in ids], dtype=torch.int64)
        batch = PackedBatch.build(lengths, self.device)
        now = time.time()
        hidden = self.model(flat.to(self.device, non_blocking=True), batch)
        vectors = pool(hidden, batch, self.rule).cpu()
        for (request, i), vector in zip(items, vectors, strict=True):
            if request.metrics.first_scheduled_time is None:
                request.metrics.first_scheduled_time = now
            request.vectors[i] = vector
            request.done += 1
        self.prompt_tokens += sum(lengths)
        self.num_steps += 1

    def _output(self, request: EmbeddingRequest) -> RequestOutput:
        stacked = torch.stack([v for v in request.vectors if v is not None])
        if request.dimensions is not None:  # Matryoshka: cut, then unit length again
            stacked = F.normalize(stacked[:, : request.dimensions], p=2, dim=-1)
        request.metrics.finished_time = time.time()
        return RequestOutput(request.request_id, None,
                             [t for ids in request.inputs for t in ids], [], True,
                             request.metrics, embeddings=stacked.tolist())
