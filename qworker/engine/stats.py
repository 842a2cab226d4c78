"""``EngineStats``: the typed snapshot ``Engine.stats()`` / ``LLM.stats()`` return."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class EngineStats:
    """Pool figures and counters of one engine, taken at the end of a step.

    Counters (``prompt_tokens``, ``generation_tokens``, ``num_preemptions``,
    ``prefix_cache_queries``, ``prefix_cache_hits`` — both in tokens) only grow.
    ``stats["key"]`` and ``stats.get("key", default)`` keep working for code written
    against the old dict; new code reads attributes. ``attention_backend`` is what runs:
    "cuda", "torch", "cpu", or "mixed" when the kernel self-test moved some component to
    torch code; ``kernel_paths`` names the implementation of each component (decode,
    prefill, cache_write, and on a GPU each fused op) and ``kernel_selftest`` how the
    self-test ended. Reference: ``docs/configuration.md``.
    """

    num_kv_blocks: int = 0
    block_size: int = 16
    kv_blocks_used: int = 0
    kv_cache_usage_perc: float = 0.0
    num_free_blocks: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    num_swap_outs: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    num_requests_running: int = 0
    num_requests_waiting: int = 0
    num_requests_swapped: int = 0
    waiting_prompt_blocks: int = 0
    max_model_len: int = 0
    max_num_seqs: int = 0
    max_concurrent_full_length_seqs: int = 0
    attention_backend: str = ""
    kv_cache_dtype: str = "auto"
    cuda_graphs: bool = False
    kernel_selftest: str = "not_applicable"
    kernel_paths: dict[str, str] = field(default_factory=dict)

    def __getitem__(self, key: str) -> Any:
        if key not in _FIELDS:
            raise KeyError(key)
        return getattr(self, key)

    def __contains__(self, key: object) -> bool:
        return key in _FIELDS

    def __iter__(self) -> Iterator[str]:
        return iter(_FIELDS)

    def get(self, key: str, default: Any = None) -> Any:
        """The value of ``key``, or ``default`` when there is no such figure."""
        return getattr(self, key) if key in _FIELDS else default

    def keys(self) -> tuple[str, ...]:
        """The figure names, in declaration order."""
        return _FIELDS

    def as_dict(self) -> dict[str, Any]:
        """A plain dict copy (for JSON reports)."""
        return dataclasses.asdict(self)


_FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(EngineStats))
