"""Engine configuration: a plain record built once at the edge and passed inward."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class EngineConfig:
    """Every knob of the engine, with DESIGN.md's names and defaults.

    ``num_kv_blocks`` fixes the pool size exactly; otherwise it is derived from
    ``kv_cache_memory`` (bytes; CPU default 1 GiB) or, on GPU, from
    ``gpu_memory_utilization`` after a profiling forward. ``max_model_len`` None means
    the model's ``max_position_embeddings``.
    """

    model: str
    dtype: str = "auto"
    device: str = "auto"
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory: int | None = None
    gpu_memory_utilization: float = 0.90
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    preemption_mode: str = "recompute"
    swap_space: int = 4 << 30
    attention_backend: str = "auto"
    seed: int = 0
    tokenizer: str | None = None
