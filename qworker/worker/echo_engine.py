"""A model-free engine with the ``Engine`` surface, for worker tests and benchmarks.

Selected by the model value ``echo://`` (query options: ``delay_ms`` sleeps that long
in every step; ``steps`` is how many steps a request takes, default 1;
``max_model_len`` and ``num_kv_blocks`` size the imaginary pool). Tokens are UTF-8
bytes; a request's completion echoes its prompt tokens (at most ``max_tokens``), so
``text`` is the prompt text. KV accounting imitates a paged pool of 16-token blocks.

``task=embed`` makes it an embedding engine (``EmbeddingEngine``'s surface): each input
gets a deterministic unit vector of ``dim`` (default 8) float32 values seeded by its
token ids (``echo_embedding``), truncated to ``dimensions`` and renormalized when asked.

Faults for the fault campaign (``scripts/chaos.py``): ``fail_rate`` makes a step with
work raise with that probability (``seed`` seeds it), ``poison=MARK`` makes every step
raise while a request whose prompt contains ``MARK`` is in the batch (a request that
breaks the device), ``hang_after=N`` makes the N-th step with work never return.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import random
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from urllib.parse import parse_qs, urlsplit

import numpy as np

from qworker.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from qworker.engine.sampling_params import SamplingParams
from qworker.engine.stats import EngineStats
from qworker.errors import ContextLengthExceededError, InvalidRequestError

BLOCK_SIZE = 16


@dataclass(slots=True)
class _EchoRequest:
    request_id: str
    prompt: str | None
    token_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    steps_left: int
    aborted: bool = False
    inputs: list[list[int]] | None = None  # an embedding request's inputs
    dimensions: int | None = None


class EchoEngine:
    """Finishes each request after ``steps`` steps with its prompt echoed back.

    Thread-safe like the real engine: ``add_request``, ``abort``, ``has_unfinished``
    and ``stats`` from any thread, ``step`` from one.
    """

    tokenizer = None
    model_name = "echo"

    def __init__(
        self,
        delay_ms: float = 0.0,
        steps: int = 1,
        max_model_len: int = 4096,
        num_kv_blocks: int = 4096,
        fail_rate: float = 0.0,
        poison: str = "",
        hang_after: int = 0,
        seed: int | None = None,
        task: str = "generate",
        dim: int = 8,
        max_num_batched_tokens: int = 8192,
    ) -> None:
        if task not in ("generate", "embed"):
            raise ValueError(f'echo: task must be "generate" or "embed", got {task!r}')
        self.task = task
        self.embedding_dim = dim
        self.max_num_batched_tokens = max_num_batched_tokens
        self.delay_s = delay_ms / 1000.0
        self.fail_rate = fail_rate
        self.poison = poison.encode("utf-8")
        self.hang_after = hang_after
        self._rng = random.Random(seed)
        self._work_steps = 0
        self.steps = max(1, steps)
        self.max_model_len = max_model_len
        self.num_kv_blocks = num_kv_blocks
        self._lock = threading.Lock()
        self._batch_lock = threading.Lock()
        self._inbox: list[_EchoRequest] = []
        self._running: dict[str, _EchoRequest] = {}
        self._ids: set[str] = set()
        self._prompt_tokens = 0
        self._generation_tokens = 0

    @classmethod
    def from_uri(cls, uri: str) -> EchoEngine:
        """Build from ``echo://[?delay_ms=N&steps=S&max_model_len=L&num_kv_blocks=B]``."""
        query = parse_qs(urlsplit(uri).query)
        opts = {k: v[-1] for k, v in query.items()}
        return cls(
            delay_ms=float(opts.get("delay_ms", 0)),
            steps=int(opts.get("steps", 1)),
            max_model_len=int(opts.get("max_model_len", 4096)),
            num_kv_blocks=int(opts.get("num_kv_blocks", 4096)),
            fail_rate=float(opts.get("fail_rate", 0)),
            poison=opts.get("poison", ""),
            hang_after=int(opts.get("hang_after", 0)),
            seed=int(opts["seed"]) if "seed" in opts else None,
            task=opts.get("task", "generate"),
            dim=int(opts.get("dim", 8)),
            max_num_batched_tokens=int(opts.get("max_num_batched_tokens", 8192)),
        )

    def _serves(self, task: str) -> None:
        if self.task != task:
            what = "embeddings" if self.task == "embed" else "text generation"
            raise InvalidRequestError(f"this worker serves {what} (task {self.task!r})")

    def encode_chat(self, messages: list[dict]) -> list[int]:
        """``role: content`` lines as UTF-8 bytes (a stand-in for a chat template)."""
        self._serves("generate")
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
        return list(text.encode("utf-8"))

    def validate_prompt(
        self, prompt: str | list[int], params: SamplingParams
    ) -> tuple[str | None, list[int]]:
        """Like the engine's: ``(text or None, token ids)``; raises on empty or too long."""
        self._serves("generate")
        params.validate()
        if isinstance(prompt, str):
            token_ids, text = list(prompt.encode("utf-8")), prompt
        else:
            token_ids, text = list(prompt), None
            bad = [t for t in token_ids if not isinstance(t, int) or not 0 <= t < 256]
            if bad:  # its vocabulary is the 256 byte values, as the real engine checks its own
                raise InvalidRequestError(
                    f"prompt token ids must be integers in [0, 256); got {bad[:5]!r}")
        if not token_ids:
            raise InvalidRequestError("prompt must not be empty")
        if len(token_ids) + 1 > self.max_model_len:
            raise ContextLengthExceededError(
                f"prompt is {len(token_ids)} tokens; max_model_len is {self.max_model_len}"
            )
        return text, token_ids

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
    ) -> None:
        """Validate like the engine (empty, too long, duplicate id) and queue the request."""
        text, token_ids = self.validate_prompt(prompt, params)
        self.add_validated(request_id, text, token_ids, params, arrival_time)

    def add_validated(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
    ) -> None:
        """Queue a request whose prompt passed ``validate_prompt`` (duplicate ids refused)."""
        self._serves("generate")
        self._queue(_EchoRequest(
            request_id,
            prompt,
            list(prompt_token_ids),
            params,
            RequestMetrics(arrival_time=arrival_time or time.time()),
            self.steps,
        ))

    def _queue(self, req: _EchoRequest) -> None:
        with self._lock:
            if req.request_id in self._ids:
                raise InvalidRequestError(f"duplicate request_id {req.request_id!r}")
            self._ids.add(req.request_id)
            self._inbox.append(req)

    def validate_embedding_input(self, item: str | list[int]) -> list[int]:
        """One embedding input's token ids (UTF-8 bytes); raises on empty or too long."""
        self._serves("embed")
        if isinstance(item, str):
            token_ids = list(item.encode("utf-8"))
        else:
            token_ids = list(item)
            bad = [t for t in token_ids if not isinstance(t, int) or not 0 <= t < 256]
            if bad:
                raise InvalidRequestError(
                    f"input token ids must be integers in [0, 256); got {bad[:5]!r}")
        if not token_ids:
            raise InvalidRequestError("input must not be empty")
        if len(token_ids) > self.max_model_len:
            raise ContextLengthExceededError(
                f"input is {len(token_ids)} tokens; the model takes at most "
                f"{self.max_model_len}")
        return token_ids

    def check_dimensions(self, dimensions: int | None) -> None:
        """Refuse ``dimensions`` outside 1..``embedding_dim`` (None: the full vector)."""
        self._serves("embed")
        if dimensions is not None and not 1 <= dimensions <= self.embedding_dim:
            raise InvalidRequestError(
                f"dimensions must be between 1 and {self.embedding_dim}, got {dimensions}")

    def add_embedding(self, request_id: str, inputs: list[list[int]],
                      dimensions: int | None = None, arrival_time: float | None = None) -> None:
        """Queue an embedding request of validated inputs (thread-safe)."""
        self._serves("embed")
        self.check_dimensions(dimensions)
        self._queue(_EchoRequest(
            request_id, None, [t for ids in inputs for t in ids], SamplingParams(),
            RequestMetrics(arrival_time=arrival_time or time.time()), self.steps,
            inputs=[list(ids) for ids in inputs], dimensions=dimensions))

    def abort(self, request_id: str) -> None:
        """Mark a request aborted; it is returned with finish_reason "abort" next step."""
        with self._lock:
            for req in self._inbox:
                if req.request_id == request_id:
                    req.aborted = True
            if request_id in self._running:
                self._running[request_id].aborted = True

    @contextlib.contextmanager
    def inbox_batch(self) -> Iterator[None]:
        """Requests added inside the block join the same step (as ``Engine.inbox_batch``)."""
        with self._batch_lock:
            yield

    def has_unfinished(self) -> bool:
        """True while any request is queued or running."""
        with self._lock:
            return bool(self._inbox or self._running)

    def _inject_faults(self, batch: list[_EchoRequest]) -> None:
        live = [r for r in batch if not r.aborted]
        if not live:
            return
        self._work_steps += 1
        if self.hang_after and self._work_steps >= self.hang_after:
            threading.Event().wait()  # a step that never returns (a hung device)
        if self.poison and any(self.poison in bytes(t % 256 for t in r.token_ids)
                               for r in live):
            raise RuntimeError("echo: a poisoned request breaks every step it is in")
        if self.fail_rate and self._rng.random() < self.fail_rate:
            raise RuntimeError("echo: injected step failure")

    def step(self) -> list[RequestOutput]:
        """Advance every request one step; return those that finished or were aborted.

        The batch is fixed when the step starts: requests added meanwhile wait for the
        next step (as in the real engine, whose inbox is drained once per step).
        """
        now = time.time()
        with self._batch_lock, self._lock:
            for req in self._inbox:
                self._running[req.request_id] = req
                req.metrics.first_scheduled_time = now
                self._prompt_tokens += len(req.token_ids)
            self._inbox.clear()
            batch = list(self._running.values())
        self._inject_faults(batch)
        if self.delay_s:
            time.sleep(self.delay_s)
        now = time.time()
        finished: list[RequestOutput] = []
        with self._lock:
            for req in batch:
                rid = req.request_id
                req.steps_left -= 1
                if req.metrics.first_token_time is None:
                    req.metrics.first_token_time = now
                if req.aborted or req.steps_left <= 0:
                    del self._running[rid]
                    self._ids.discard(rid)
                    finished.append(self._output(req, now))
        return finished

    def _output(self, req: _EchoRequest, now: float) -> RequestOutput:
        req.metrics.finished_time = now
        if req.inputs is not None:
            vectors = None if req.aborted else [
                echo_embedding(ids, self.embedding_dim, req.dimensions) for ids in req.inputs]
            return RequestOutput(req.request_id, None, req.token_ids, [], True, req.metrics,
                                 embeddings=vectors)
        limit = req.params.max_tokens or len(req.token_ids)
        ids = req.token_ids[:limit]
        if req.aborted:
            reason = "abort"
        else:
            reason = "length" if len(ids) < len(req.token_ids) else "stop"
            self._generation_tokens += len(ids) * req.params.n
        text = bytes(t for t in ids if t < 256).decode("utf-8", errors="replace")
        logprobs = [{t: 0.0} for t in ids] if req.params.logprobs is not None else None
        outputs = [
            CompletionOutput(i, text, list(ids), 0.0, logprobs, reason) for i in range(req.params.n)
        ]
        return RequestOutput(req.request_id, req.prompt, req.token_ids, outputs, True, req.metrics)

    def close(self) -> None:
        """Nothing to stop (``Engine.close`` stops tensor-parallel ranks)."""

    def failed(self) -> str | None:
        """Never: the echo engine has no ranks to lose."""
        return None

    def stats(self) -> EngineStats:
        """The engine's figures, from an imaginary pool of 16-token blocks (none in embed
        mode: like the embedding engine's, its KV figures are all 0)."""
        if self.task == "embed":
            with self._lock:
                return EngineStats(
                    num_kv_blocks=0, block_size=0, prompt_tokens=self._prompt_tokens,
                    num_requests_running=len(self._running),
                    num_requests_waiting=len(self._inbox), max_model_len=self.max_model_len,
                    max_num_seqs=1 << 30, attention_backend="echo", kv_cache_dtype="none")
        with self._lock:
            waiting = sum(math.ceil(len(r.token_ids) / BLOCK_SIZE) for r in self._inbox)
            used = sum(math.ceil(len(r.token_ids) / BLOCK_SIZE) for r in self._running.values())
            n_wait, n_run = len(self._inbox), len(self._running)
            prompt_tokens, gen_tokens = self._prompt_tokens, self._generation_tokens
        return EngineStats(
            num_kv_blocks=self.num_kv_blocks,
            block_size=BLOCK_SIZE,
            kv_blocks_used=used,
            kv_cache_usage_perc=used / self.num_kv_blocks,
            num_free_blocks=self.num_kv_blocks - used,
            prompt_tokens=prompt_tokens,
            generation_tokens=gen_tokens,
            num_requests_running=n_run,
            num_requests_waiting=n_wait,
            waiting_prompt_blocks=waiting,
            max_model_len=self.max_model_len,
            max_num_seqs=1 << 30,
            max_concurrent_full_length_seqs=self.num_kv_blocks
            // math.ceil(self.max_model_len / BLOCK_SIZE),
            attention_backend="echo",
        )


def echo_embedding(token_ids: list[int], dim: int, dimensions: int | None = None) -> list[float]:
    """The echo engine's vector of one input: ``dim`` float32 values from a generator
    seeded by the token ids, cut to ``dimensions`` (if given), scaled to unit length."""
    seed = hashlib.sha256(np.asarray(token_ids, dtype=np.int64).tobytes()).digest()
    vector = np.random.default_rng(int.from_bytes(seed[:8], "little")).standard_normal(dim)
    vector = vector[:dimensions] if dimensions is not None else vector
    return (vector / np.linalg.norm(vector)).astype(np.float32).tolist()
