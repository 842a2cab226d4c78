"""The catalogue of CUDA kernels under ``cuda/``: sources, NVRTC options, template names.

Everything here is plain Python (no cupy, no GPU) so that CPU tests can enumerate and
compile every instantiation the CUDA backend may ask for, and check the launch heuristics.
The backend (``cuda_backend.py``) asks only through these functions, so "what the tests
compile" and "what runs" cannot drift apart.
"""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

#: ``cuda/`` at the repository root (the kernels travel as source, compiled at run time).
CUDA_DIR = Path(__file__).resolve().parents[2] / "cuda"

PAGED_ATTENTION = "paged_attention.cu"
CACHE_OPS = "cache_ops.cu"
DECODE_TC = "paged_decode_tc.cu"
PREFILL_TC = "paged_prefill_tc.cu"

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


_INCLUDE = re.compile(r'^#include "([^"]+)"[^\n]*$', re.MULTILINE)


@functools.cache
def source(name: str) -> str:
    """The text of ``cuda/<name>`` with its ``#include "..."`` files of ``cuda/`` inlined
    (once each), so NVRTC needs no include path and cupy's cache key covers them."""
    seen: set[str] = set()

    def expand(file: str) -> str:
        text = (CUDA_DIR / file).read_text()

        def repl(m: re.Match[str]) -> str:
            inc = m.group(1)
            if inc in seen:
                return f"// {inc} (already included)"
            seen.add(inc)
            return expand(inc)

        return _INCLUDE.sub(repl, text)

    return expand(name)


def head_tile(group: int) -> int:
    """Query heads per CTA for ``group`` query heads per KV head: the next power of two,
    at most 8 (larger groups use several tiles, each re-reading K/V, mostly from L2)."""
    for gt in HEAD_TILES:
        if gt >= group:
            return gt
    return HEAD_TILES[-1]


def with_cap(name: str, capped: bool) -> str:
    """The soft-capped instantiation of an attention kernel's name expression when
    ``capped`` (the templates' trailing ``CAP = 1``), else ``name`` (``CAP`` defaults to 0)."""
    return f"{name[:-1]}, 1>" if capped else name


def decode_name(dtype: torch.dtype, head_dim: int, group: int, capped: bool = False) -> str:
    """Name expression of the decode kernel for this dtype / head size / GQA group
    (``capped``: a soft-capped layer's)."""
    return with_cap(f"paged_attention_decode<{DTYPE_CODE[dtype]}, {head_dim}, {head_tile(group)}>",
                    capped)


def reduce_name(dtype: torch.dtype) -> str:
    """Name expression of the split-K reduce kernel for this dtype."""
    return f"paged_attention_reduce<{DTYPE_CODE[dtype]}>"


def reshape_and_cache_name(unit: int) -> str:
    """Name expression of the cache-write kernel moving ``unit`` bytes per access."""
    return f"reshape_and_cache<{unit}>"


COPY_BLOCKS_NAME = "copy_blocks"


# -- tensor-core kernels (paged_decode_tc.cu, paged_prefill_tc.cu) ------------------------

#: Query dtypes the tensor-core kernels take (fp32 keeps paged_attention.cu).
TC_DTYPE_CODE: dict[torch.dtype, int] = {torch.float16: 1, torch.bfloat16: 2}

#: Head sizes compiled ahead of time (gpu_check's precompile); any multiple of 16 up to
#: 256 is served, compiled on first use.
TC_HEAD_SIZES: tuple[int, ...] = (32, 64, 80, 96, 112, 128, 160, 192, 256)

#: Query heads per decode CTA are 8 * NT; NT = 2 only while the accumulators fit 128
#: registers (HEAD_DIM * NT <= 256).
TC_MAX_SPLITS = 64

#: Tokens of the split granularity (4 warps x 16-token tiles).
TC_SPLIT_UNIT = 64

#: Shared memory per SM of the target (H100/H200: 228 KiB, 1 KiB reserved per CTA).
SMEM_PER_SM = 228 * 1024


#: Largest head size of the tensor-core prefill kernel: its 16 x HEAD_DIM fp32 accumulator
#: per warp spills past it (ptxas), so larger heads prefill through gather + SDPA.
PREFILL_TC_MAX_HEAD = 160


def tc_supported(dtype: torch.dtype, head_dim: int) -> bool:
    """Whether the tensor-core decode kernel serves this query dtype and head size."""
    return dtype in TC_DTYPE_CODE and head_dim % 16 == 0 and 16 <= head_dim <= 256


def prefill_tc_supported(dtype: torch.dtype, head_dim: int) -> bool:
    """Whether the tensor-core prefill kernel serves this query dtype and head size."""
    return tc_supported(dtype, head_dim) and head_dim <= PREFILL_TC_MAX_HEAD


@dataclass(slots=True, frozen=True)
class TcLayout:
    """Shared-memory plan of a tensor-core kernel (mirrors DecodeLayout / PrefillLayout)."""

    warps: int
    stages: int
    smem_bytes: int


def decode_tc_layout(kv8: bool, head_dim: int) -> TcLayout:
    """``DecodeLayout<KV8, HEAD_DIM>`` of paged_decode_tc.cu, computed the same way."""
    row = head_dim * (1 if kv8 else 2)
    srow = row + (16 if (row // 16) % 2 == 0 else 0)
    stage_warp = 2 * 16 * srow
    budget = 110 * 1024
    warps = 4 if budget // (4 * stage_warp) >= 2 and row <= 320 else 2
    stages = min(4, budget // (warps * stage_warp))
    q_bytes = 16 * (head_dim * 2 + 16)
    return TcLayout(warps, stages, q_bytes + warps * stages * stage_warp)


def prefill_tc_layout(kv8: bool, head_dim: int) -> TcLayout:
    """``PrefillLayout<KV8, HEAD_DIM>`` of paged_prefill_tc.cu."""
    row = head_dim * (1 if kv8 else 2)
    srow = row + (16 if (row // 16) % 2 == 0 else 0)
    q_bytes = 64 * (head_dim * 2 + 16)
    return TcLayout(4, 2, q_bytes + 2 * 2 * 32 * srow)


def decode_tc_nt(group: int, head_dim: int) -> int:
    """Query heads per decode CTA, in units of 8: 2 for groups of 9+ while registers allow."""
    return 2 if group > 8 and head_dim <= 128 else 1


def decode_tc_name(dtype: torch.dtype, kv8: bool, head_dim: int, group: int,
                   capped: bool = False) -> str:
    """Name expression of the tensor-core decode kernel (``capped``: soft-capped layer)."""
    nt = decode_tc_nt(group, head_dim)
    return with_cap(f"paged_decode_tc<{TC_DTYPE_CODE[dtype]}, {int(kv8)}, {head_dim}, {nt}>",
                    capped)


def prefill_tc_name(dtype: torch.dtype, kv8: bool, head_dim: int, capped: bool = False) -> str:
    """Name expression of the tensor-core prefill kernel (``capped``: soft-capped layer)."""
    return with_cap(f"paged_prefill_tc<{TC_DTYPE_CODE[dtype]}, {int(kv8)}, {head_dim}>", capped)


def reshape_and_cache_fp8_name(dtype: torch.dtype) -> str:
    """Name expression of the quantizing cache write for input ``dtype``."""
    return f"reshape_and_cache_fp8<{DTYPE_CODE[dtype]}>"


def ctas_per_sm(threads: int, smem_bytes: int, regs: int = 128) -> int:
    """CTAs one SM holds (shared memory, registers, 2048 threads, 32 CTAs)."""
    by_smem = SMEM_PER_SM // (smem_bytes + 1024)
    by_regs = 65536 // (threads * regs)
    return max(1, min(by_smem, by_regs, 2048 // threads, 32))


def num_splits_heuristic(base_ctas: int, wave: int, num_units: int, max_splits: int) -> int:
    """FlashAttention's wave-efficiency rule (flash_api.cpp ``num_splits_heuristic``): no
    split when the unsplit grid nearly fills a wave; else, among split counts that change
    the per-split length, the smallest within 85% of the best wave efficiency
    (``n_waves / ceil(n_waves)``)."""
    if base_ctas >= 0.8 * wave:
        return 1
    max_splits = max(1, min(max_splits, wave, num_units))
    eff = []
    for s in range(1, max_splits + 1):
        waves = base_ctas * s / wave
        eff.append(waves / math.ceil(waves))
    best = max(eff)
    for s in range(1, max_splits + 1):
        if s > 1 and math.ceil(num_units / s) == math.ceil(num_units / (s - 1)):
            continue
        if eff[s - 1] >= 0.85 * best:
            return s
    return 1


@dataclass(slots=True, frozen=True)
class DecodeTcPlan:
    """How one tensor-core decode launch is cut: grid, split, shared memory.

    ``num_splits`` is grid z; ``partition_size`` tokens per split (0 = one split); the
    kernel derives each sequence's own split count from its ``seq_lens`` entry, so a plan
    made for an upper bound (``fixed``) stays valid while sequences grow. ``name`` is the
    kernel of layers without a soft-cap; ``kernel_name(True)`` that of soft-capped ones
    (one plan serves both: the grid does not depend on the cap).
    """

    name: str
    nt: int
    head_tiles: int
    num_splits: int
    partition_size: int
    warps: int
    smem_bytes: int
    fixed: bool = False

    @property
    def split(self) -> bool:
        """Whether partitions are merged in-launch."""
        return self.num_splits > 1

    def kernel_name(self, capped: bool) -> str:
        """The kernel this plan launches for a layer with (``capped``) or without a
        soft-cap."""
        return with_cap(self.name, capped)


@functools.lru_cache(maxsize=4096)
def plan_decode_tc(
    dtype: torch.dtype,
    kv8: bool,
    head_dim: int,
    num_seqs: int,
    num_kv_heads: int,
    group: int,
    max_seq_len: int,
    num_sms: int,
    sliding_window: int | None = None,
    split_k: bool | None = None,
    partition_size: int | None = None,
    fixed: bool = False,
) -> DecodeTcPlan:
    """Plan a tensor-core decode launch for ``num_seqs`` sequences of at most
    ``max_seq_len`` tokens (an upper bound is fine: see :class:`DecodeTcPlan`).

    The split count comes from :func:`num_splits_heuristic` over 64-token units with a
    wave of ``num_sms * ctas_per_sm``; ``split_k`` False forbids splitting, True with
    ``partition_size`` fixes it.
    """
    nt = decode_tc_nt(group, head_dim)
    tiles = math.ceil(group / (8 * nt))
    layout = decode_tc_layout(kv8, head_dim)
    name = f"paged_decode_tc<{TC_DTYPE_CODE[dtype]}, {int(kv8)}, {head_dim}, {nt}>"
    span = max(1, max_seq_len if sliding_window is None else min(max_seq_len, sliding_window + 15))
    units = math.ceil(span / TC_SPLIT_UNIT)
    base = num_seqs * num_kv_heads * tiles
    if split_k is False:
        splits = 1
    elif split_k is True and partition_size is not None:
        size = max(TC_SPLIT_UNIT, math.ceil(partition_size / TC_SPLIT_UNIT) * TC_SPLIT_UNIT)
        splits = min(TC_MAX_SPLITS, math.ceil(span / size))
        size = max(size, math.ceil(math.ceil(span / splits) / TC_SPLIT_UNIT) * TC_SPLIT_UNIT)
        splits = math.ceil(span / size)
        return DecodeTcPlan(name, nt, tiles, splits, size if splits > 1 else 0, layout.warps,
                            layout.smem_bytes, fixed)  # fmt: skip
    else:
        wave = num_sms * ctas_per_sm(layout.warps * 32, layout.smem_bytes)
        splits = num_splits_heuristic(base, wave, units, TC_MAX_SPLITS)
        if split_k is True:
            splits = max(2, splits) if units > 1 else 1
    if splits <= 1:
        return DecodeTcPlan(name, nt, tiles, 1, 0, layout.warps, layout.smem_bytes, fixed)
    size = math.ceil(units / splits) * TC_SPLIT_UNIT
    splits = math.ceil(span / size)
    return DecodeTcPlan(name, nt, tiles, splits, size if splits > 1 else 0, layout.warps,
                        layout.smem_bytes, fixed)  # fmt: skip


#: Prefill choice (``prefill="auto"``): the batched paged kernel when at least this many
#: sequences prefill in the step (gather + SDPA loops over them) ...
PREFILL_PAGED_MIN_SEQS = 2
#: ... or when the one prefill chunk is at most this long. Both are starting points that
#: ``scripts/bench_kernels.py`` (prefill table, run by scripts/gpu_check.sh) measures.
PREFILL_PAGED_MAX_CHUNK = 1024


def prefill_choice(num_prefill_seqs: int, max_query_len: int) -> str:
    """``"paged"`` (one batched tensor-core launch) or ``"sdpa"`` (gather + torch SDPA per
    sequence) for a step's prefill chunks (see the two constants above)."""
    if num_prefill_seqs >= PREFILL_PAGED_MIN_SEQS or max_query_len <= PREFILL_PAGED_MAX_CHUNK:
        return "paged"
    return "sdpa"


def layout_reason(block_size: int, num_q_heads: int, num_kv_heads: int) -> str | None:
    """Why the kernels cannot serve this block size / head layout (None when they can)."""
    if block_size < MIN_BLOCK_SIZE or block_size & (block_size - 1):
        return f"block size {block_size} is not a power of two >= {MIN_BLOCK_SIZE}"
    if num_kv_heads <= 0 or num_q_heads % num_kv_heads:
        return f"{num_q_heads} query heads are not a multiple of {num_kv_heads} KV heads"
    return None


def unsupported_reason(
    dtype: torch.dtype, head_dim: int, block_size: int, num_q_heads: int, num_kv_heads: int
) -> str | None:
    """Why the decode kernel cannot serve this shape (None when it can)."""
    if dtype not in DTYPE_CODE:
        return f"dtype {dtype} not in {sorted(str(d) for d in DTYPE_CODE)}"
    if head_dim not in HEAD_SIZES:
        return f"head size {head_dim} is not one of {HEAD_SIZES}"
    return layout_reason(block_size, num_q_heads, num_kv_heads)


def all_instantiations(soft_capped: bool = False) -> dict[str, list[str]]:
    """Every name expression the backend can request, per source file; ``soft_capped``
    adds every attention kernel's ``CAP = 1`` instantiation (only soft-capped models,
    Gemma 2, request them: they compile on first use unless precompiled from this list)."""
    decode = [
        f"paged_attention_decode<{code}, {d}, {gt}>"
        for code in DTYPE_CODE.values()
        for d in HEAD_SIZES
        for gt in HEAD_TILES
    ]
    reduce = [f"paged_attention_reduce<{code}>" for code in DTYPE_CODE.values()]
    cache = [reshape_and_cache_name(u) for u in (2, 4, 16)] + [COPY_BLOCKS_NAME]
    cache += [reshape_and_cache_fp8_name(dt) for dt in DTYPE_CODE]
    tc_decode = [
        f"paged_decode_tc<{code}, {kv8}, {d}, {nt}>"
        for code in TC_DTYPE_CODE.values()
        for kv8 in (0, 1)
        for d in TC_HEAD_SIZES
        for nt in ((1, 2) if d <= 128 else (1,))
    ]
    tc_prefill = [
        f"paged_prefill_tc<{code}, {kv8}, {d}>"
        for code in TC_DTYPE_CODE.values()
        for kv8 in (0, 1)
        for d in TC_HEAD_SIZES
        if d <= PREFILL_TC_MAX_HEAD
    ]
    if soft_capped:
        decode += [with_cap(n, True) for n in decode]
        tc_decode += [with_cap(n, True) for n in tc_decode]
        tc_prefill += [with_cap(n, True) for n in tc_prefill]
    return {
        PAGED_ATTENTION: decode + reduce,
        CACHE_OPS: cache,
        DECODE_TC: tc_decode,
        PREFILL_TC: tc_prefill,
    }


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
