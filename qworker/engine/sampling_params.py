"""Per-request sampling parameters, with vLLM's names and defaults."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from qworker.errors import InvalidRequestError


@dataclass(slots=True)
class SamplingParams:
    """How one request's tokens are chosen and when generation stops.

    ``temperature=0`` is greedy. ``top_k`` 0 or -1 disables top-k. ``seed`` makes the
    request's sampling reproducible whatever shares its batch and whether it was
    preempted. ``logprobs=k`` returns, per generated token, the top-k ids (plus the
    chosen one) with their log-probabilities. ``stop`` strings are not included in
    the returned text. Invalid values raise ``InvalidRequestError`` (a ``ValueError``)
    naming the field; call ``validate()`` after mutating an instance.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    repetition_penalty: float = 1.0
    stop_strings: list[str] = field(init=False, repr=False, default_factory=list)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check every field; raise ``InvalidRequestError`` naming the first bad one."""
        if not isinstance(self.n, int) or isinstance(self.n, bool) or self.n < 1:
            raise InvalidRequestError(f"n must be an integer >= 1, got {self.n!r}")
        if not _is_finite_number(self.temperature) or self.temperature < 0:
            raise InvalidRequestError(
                f"temperature must be a finite number >= 0, got {self.temperature!r}"
            )
        if not _is_finite_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < -1:
            raise InvalidRequestError(
                f"top_k must be -1, 0 or a positive integer, got {self.top_k!r}"
            )
        if not _is_finite_number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise InvalidRequestError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and (
            not isinstance(self.seed, int) or isinstance(self.seed, bool)
        ):
            raise InvalidRequestError(f"seed must be an integer or None, got {self.seed!r}")
        if self.max_tokens is not None and (
            not isinstance(self.max_tokens, int)
            or isinstance(self.max_tokens, bool)
            or self.max_tokens < 1
        ):
            raise InvalidRequestError(
                f"max_tokens must be an integer >= 1 or None, got {self.max_tokens!r}"
            )
        if self.logprobs is not None and (
            not isinstance(self.logprobs, int)
            or isinstance(self.logprobs, bool)
            or self.logprobs < 0
        ):
            raise InvalidRequestError(
                f"logprobs must be an integer >= 0 or None, got {self.logprobs!r}"
            )
        if not _is_finite_number(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise InvalidRequestError(
                f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty!r}"
            )
        if not isinstance(self.ignore_eos, bool):
            raise InvalidRequestError(f"ignore_eos must be a boolean, got {self.ignore_eos!r}")
        self.stop_strings = _normalize_stop(self.stop)
        if self.stop_token_ids is not None and (
            not isinstance(self.stop_token_ids, list)
            or not all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0
                for t in self.stop_token_ids
            )
        ):
            raise InvalidRequestError(
                "stop_token_ids must be a list of non-negative integers, "
                f"got {self.stop_token_ids!r}"
            )

    @property
    def greedy(self) -> bool:
        """True when tokens are chosen by argmax (``temperature == 0``)."""
        return self.temperature == 0.0


def _is_finite_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _normalize_stop(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise InvalidRequestError(f"stop must be a string or a list of strings, got {stop!r}")
    if any(s == "" for s in stop):
        raise InvalidRequestError("stop must not contain an empty string")
    return list(stop)
