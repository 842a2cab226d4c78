"""What the engine returns: one ``RequestOutput`` per request, vLLM's shape."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class CompletionOutput:
    """One generated sequence of a request (one of ``n``, or one beam).

    ``logprobs`` is None unless asked for; otherwise one dict per generated token
    mapping token id to log-probability (the top-k plus the chosen token).
    ``finish_reason`` is ``"stop"``, ``"length"``, ``"abort"``, or None while running.
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass(slots=True)
class RequestMetrics:
    """Wall-clock timestamps (``time.time()`` seconds) of a request's life in the engine."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None


@dataclass(slots=True)
class RequestOutput:
    """A request's prompt and its completions; ``finished`` once every completion ended.

    An embedding request (``EmbeddingEngine``) has no completions: ``embeddings`` holds
    one vector per input, in input order, and ``prompt_token_ids`` all its inputs' ids
    concatenated. It stays None for generation and for an aborted embedding request.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0
    error: str | None = field(default=None)
    embeddings: list[list[float]] | None = None


@dataclass(slots=True)
class EmbeddingOutput:
    """One input's embedding from ``LLM.embed``: its ``index`` among the inputs, the
    vector (pooled, normalized when the model normalizes; with ``dimensions``: cut and
    normalized) and
    how many tokens the input had."""

    index: int
    embedding: list[float]
    prompt_tokens: int
