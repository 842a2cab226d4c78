"""The catalogue of CUDA kernels under ``cuda/``: sources, NVRTC options, template names.

Everything here is plain Python (no cupy, no GPU) so that CPU tests can enumerate and
compile every instantiation the CUDA backend may ask for, and check the launch heuristics.
The backend (``cuda_backend.py``) asks only through these functions, so "what the tests
compile" and "what runs" cannot drift apart.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

#: ``cuda/`` at the repository root (the kernels travel as source, compiled at run time).
CUDA_DIR = Path(__file__).resolve().parents[2] / "cuda"

PAGED_ATTENTION = "paged_attention.cu"
CACHE_OPS = "cache_ops.cu"

#: Options shared by the runtime (cupy.RawModule) and the compile-only tests. The kernels
#: include no headers, so no include path is needed with any NVRTC version.
NVRTC_OPTIONS: tuple[str, ...] = ("-std=c++17",)

#: Template code of each storage dtype in the kernels.
DTYPE_CODE: dict[torch.dtype, int] = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}

#: Head sizes the decode kernel is instantiated for. Every multiple of 16 up to 256 would
#: compile, but each size costs 12 instantiations of compile time in CI; other sizes fall
#: back to the torch path with a log line.
HEAD_SIZES: tuple[int, ...] = (32, 64, 80, 96, 128, 256)

#: Query heads one CTA serves (the template parameter GT).
HEAD_TILES: tuple[int, ...] = (1, 2, 4, 8)

#: Tokens per split-K partition the heuristic chooses among (largest first).
PARTITION_SIZES: tuple[int, ...] = (2048, 1024, 512, 256)

#: Block sizes the kernels handle: powers of two from 8 (the shared-memory table assumes >= 8).
MIN_BLOCK_SIZE = 8

#: Threads per CTA of every kernel (kThreads in the sources).
THREADS = 128

#: The most partitions a split launch may have (the reduce keeps one float each in 48 KiB).
MAX_PARTITIONS = 12288


def source(name: str) -> str:
    """The text of ``cuda/<name>``."""
    return (CUDA_DIR / name).read_text()


def head_tile(group: int) -> int:
    """Query heads per CTA for ``group`` query heads per KV head: the next power of two,
    at most 8 (larger groups use several tiles, each re-reading K/V, mostly from L2)."""
    for gt in HEAD_TILES:
        if gt >= group:
            return gt
    return HEAD_TILES[-1]


def decode_name(dtype: torch.dtype, head_dim: int, group: int) -> str:
    """Name expression of the decode kernel for this dtype / head size / GQA group."""
    return f"paged_attention_decode<{DTYPE_CODE[dtype]}, {head_dim}, {head_tile(group)}>"


def reduce_name(dtype: torch.dtype) -> str:
    """Name expression of the split-K reduce kernel for this dtype."""
    return f"paged_attention_reduce<{DTYPE_CODE[dtype]}>"


def reshape_and_cache_name(unit: int) -> str:
    """Name expression of the cache-write kernel moving ``unit`` bytes per access."""
    return f"reshape_and_cache<{unit}>"


COPY_BLOCKS_NAME = "copy_blocks"


def unsupported_reason(
    dtype: torch.dtype, head_dim: int, block_size: int, num_q_heads: int, num_kv_heads: int
) -> str | None:
    """Why the decode kernel cannot serve this shape (None when it can)."""
    if dtype not in DTYPE_CODE:
        return f"dtype {dtype} not in {sorted(str(d) for d in DTYPE_CODE)}"
    if head_dim not in HEAD_SIZES:
        return f"head size {head_dim} is not one of {HEAD_SIZES}"
    if block_size < MIN_BLOCK_SIZE or block_size & (block_size - 1):
        return f"block size {block_size} is not a power of two >= {MIN_BLOCK_SIZE}"
    if num_kv_heads <= 0 or num_q_heads % num_kv_heads:
        return f"{num_q_heads} query heads are not a multiple of {num_kv_heads} KV heads"
    return None


def all_instantiations() -> dict[str, list[str]]:
    """Every name expression the backend can request, per source file."""
    decode = [
        f"paged_attention_decode<{code}, {d}, {gt}>"
        for code in DTYPE_CODE.values()
        for d in HEAD_SIZES
        for gt in HEAD_TILES
    ]
    reduce = [f"paged_attention_reduce<{code}>" for code in DTYPE_CODE.values()]
    cache = [reshape_and_cache_name(u) for u in (2, 4, 16)] + [COPY_BLOCKS_NAME]
    return {PAGED_ATTENTION: decode + reduce, CACHE_OPS: cache}


@dataclass(slots=True, frozen=True)
class DecodeLaunch:
    """How one decode call is cut: grid dimensions and the split-K partitioning."""

    head_tiles: int
    partition_size: int  # 0 = not split
    num_partitions: int

    @property
    def split(self) -> bool:
        """Whether partitions are merged by the reduce kernel."""
        return self.partition_size > 0


def plan_decode(
    num_work: int,
    num_kv_heads: int,
    group: int,
    max_seq_len: int,
    num_sms: int,
    split_k: bool | None = None,
    partition_size: int | None = None,
    sliding_window: int | None = None,
) -> DecodeLaunch:
    """Choose head tiles and split-K for a decode launch.

    Without a split a launch has ``num_work * num_kv_heads * head_tiles`` CTAs. When that
    is under four waves' worth for the device (``4 * num_sms``; a few CTAs fit on an SM at
    once) and the context is longer than the smallest partition, each item's context is cut
    into partitions: the largest of :data:`PARTITION_SIZES` that still yields four waves,
    else the smallest. ``split_k`` forces the choice (``partition_size`` then fixes the
    size); the answer never has more than :data:`MAX_PARTITIONS` partitions.
    """
    tiles = math.ceil(group / head_tile(group))
    span = max(1, max_seq_len if sliding_window is None else min(max_seq_len, sliding_window))
    base = num_work * num_kv_heads * tiles
    target = 4 * num_sms
    if split_k is None:
        split_k = base < target and span > PARTITION_SIZES[-1]
    if not split_k:
        return DecodeLaunch(tiles, 0, 1)
    if partition_size is None:
        partition_size = PARTITION_SIZES[-1]
        for size in PARTITION_SIZES:
            if base * math.ceil(span / size) >= target:
                partition_size = size
                break
    partition_size = max(partition_size, math.ceil(span / MAX_PARTITIONS))
    return DecodeLaunch(tiles, partition_size, math.ceil(span / partition_size))
