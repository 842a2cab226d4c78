"""Per-request sampling parameters, with vLLM's names and defaults."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import NamedTuple

from qworker.engine.structured.params import StructuredOutputsParams
from qworker.errors import InvalidRequestError

_U64 = (1 << 64) - 1


class RowParams(NamedTuple):
    """The numbers the batched sampler reads per row, computed once per ``validate()``.

    ``top_k`` is 0 when disabled; ``seed`` is the seed modulo 2**64 (0 when unseeded);
    ``logprobs`` is -1 when not asked for; ``plain`` marks greedy rows that need nothing
    but an argmax (no penalties, constraints, min_tokens or logprobs).
    """

    temperature: float
    top_k: int
    top_p: float
    min_p: float
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    min_tokens: int
    seed: int
    seeded: bool
    logprobs: int
    structured: bool
    penalized: bool
    plain: bool


@dataclass(slots=True)
class SamplingParams:
    """How one request's tokens are chosen and when generation stops.

    ``temperature=0`` is greedy. ``top_k`` 0 or -1 disables top-k. ``seed`` makes the
    request's sampling reproducible whatever shares its batch and whether it was
    preempted. ``logprobs=k`` returns, per generated token, the top-k ids (plus the
    chosen one) with their log-probabilities (of the model's raw distribution).
    ``stop`` strings are not included in the returned text.

    ``repetition_penalty`` (transformers' semantics) scales the logits of every token
    already in the prompt or the output; ``presence_penalty`` and ``frequency_penalty``
    (OpenAI's, in [-2, 2]) subtract from a token's logit once if it was generated and
    per time it was generated. ``min_tokens`` forbids EOS and ``stop_token_ids`` until
    that many tokens were generated. ``structured_outputs`` constrains the output to a
    JSON schema, JSON object, regex or choice (``docs/structured_outputs.md``).

    Invalid values raise ``InvalidRequestError`` (a ``ValueError``) naming the field;
    call ``validate()`` after mutating an instance.
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
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_tokens: int = 0
    structured_outputs: StructuredOutputsParams | None = None
    stop_strings: list[str] = field(init=False, repr=False, default_factory=list)
    row: RowParams = field(init=False, repr=False, compare=False, default=None)  # type: ignore[assignment]

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
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_finite_number(value) or not -2.0 <= value <= 2.0:
                raise InvalidRequestError(f"{name} must be a number in [-2, 2], got {value!r}")
        if (not isinstance(self.min_tokens, int) or isinstance(self.min_tokens, bool)
                or self.min_tokens < 0):
            raise InvalidRequestError(
                f"min_tokens must be an integer >= 0, got {self.min_tokens!r}"
            )
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidRequestError(
                f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}"
            )
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                raise InvalidRequestError(
                    "structured_outputs must be a StructuredOutputsParams or None, "
                    f"got {type(self.structured_outputs).__name__}"
                )
            self.structured_outputs.validate()
        self.row = self._row()

    def _row(self) -> RowParams:
        penalized = (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                     or self.frequency_penalty != 0.0)
        structured = self.structured_outputs is not None
        return RowParams(
            temperature=float(self.temperature),
            top_k=self.top_k if self.top_k > 0 else 0,
            top_p=float(self.top_p),
            min_p=float(self.min_p),
            repetition_penalty=float(self.repetition_penalty),
            presence_penalty=float(self.presence_penalty),
            frequency_penalty=float(self.frequency_penalty),
            min_tokens=self.min_tokens,
            seed=(self.seed & _U64) if self.seed is not None else 0,
            seeded=self.seed is not None,
            logprobs=self.logprobs if self.logprobs is not None else -1,
            structured=structured,
            penalized=penalized,
            plain=(self.greedy and not penalized and not structured and self.min_tokens == 0
                   and self.logprobs is None),
        )

    @property
    def needs_host_history(self) -> bool:
        """True when sampling needs the previous token on the host before the next step
        (a grammar advances on host token values); penalties are counted on the device."""
        return self.structured_outputs is not None

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
