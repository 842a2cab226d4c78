"""The CUDA attention backend: raw kernels from ``cuda/`` compiled at run time through cupy.

Decodes (the first ``num_decodes`` sequences, one query row each): fp16/bf16 queries run the
tensor-core kernel ``paged_decode_tc`` (split-KV and its merge in one launch, see
:mod:`qworker.attention.cuda_tc`); fp32 keeps the CUDA-core ``paged_attention_decode`` (+
its reduce kernel when split, see :func:`qworker.attention.cuda_kernels.plan_decode`), as does
``decode="legacy"``. Prefill chunks: ``prefill="paged"`` runs the tensor-core
``paged_prefill_tc`` over the query tiles of all prefilling sequences in one launch (fp32:
the legacy decode kernel per token), ``"sdpa"`` gathers each sequence's context and calls
torch SDPA (:mod:`qworker.attention.sdpa_prefill`), and ``"auto"`` picks per step by
:func:`qworker.attention.cuda_kernels.prefill_choice`. Cache writes (quantizing for an FP8
cache, :mod:`qworker.attention.fp8`) and copy-on-write copies are kernels of
``cuda/cache_ops.cu``; swapping uses torch copies (see :meth:`swap_blocks`).

``decode="torch"`` and ``cache_write="torch"`` route one component to torch code while the
others keep their kernels: the engine's kernel self-test (:mod:`qworker.attention.selftest`,
docs/operations.md, "Kernel self-test") picks them for a kernel that failed it; :meth:`paths`
names what serves each component for a model's shape.

Everything runs on torch's current stream (read at each launch) on torch-owned memory,
zero-copy. Shapes the kernels do not cover (head size, dtype, block size), and tensors not
on a CUDA device, go to the torch reference with one log line per reason. The module imports
without cupy or a GPU; cupy loads at the first CUDA call.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch

from qworker.attention.backend import AttentionBackend, AttentionMetadata, KVCache
from qworker.attention.cuda_kernels import (
    CACHE_OPS,
    COPY_BLOCKS_NAME,
    DTYPE_CODE,
    PAGED_ATTENTION,
    THREADS,
    decode_name,
    layout_reason,
    plan_decode,
    prefill_choice,
    prefill_tc_supported,
    reduce_name,
    reshape_and_cache_fp8_name,
    reshape_and_cache_name,
    tc_supported,
    unsupported_reason,
)
from qworker.attention.cuda_tc import FixedDecodePlan, TcLauncher
from qworker.attention.fp8 import FP8_DTYPE, is_fp8, resolve_scales
from qworker.attention.kernel_cache import (
    KERNELS,
    KernelRunner,
    cupy_available,
    f32,
    i32,
    i64,
    ptr,
)
from qworker.attention.sdpa_prefill import sdpa_prefill
from qworker.attention.torch_ref import TorchAttentionBackend

logger = logging.getLogger(__name__)

_LOG2E = 1.0 / math.log(2.0)
_BLOCK = (THREADS, 1, 1)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` [tokens, heads, D] with heads D apart and D contiguous (a copy only if not)."""
    if t.stride(2) == 1 and t.stride(1) == t.shape[2]:
        return t
    return t.contiguous()


class CudaAttentionBackend(AttentionBackend):
    """Paged attention through the raw CUDA kernels; a drop-in for the torch reference.

    ``split_k`` None lets the heuristic choose per call (True/False force it, with
    ``partition_size`` tokens per partition when given); ``prefill`` is ``"auto"``,
    ``"sdpa"`` (gather + SDPA) or ``"paged"`` (one batched kernel launch); ``decode`` is
    ``"auto"`` (tensor cores for fp16/bf16), ``"legacy"`` (the CUDA-core kernel, fp16/bf16/
    fp32, not for an FP8 cache) or ``"torch"`` (gather + SDPA, no kernel); it chooses the
    decode kernel only, prefill keeps its own. ``cache_write`` is ``"kernel"`` or ``"torch"``
    (the reference's scatter). One instance serves every layer; compiled kernels are
    shared process-wide. ``last_decode`` records the plan of the latest decode launch (tests
    and benchmarks read it).

    ``kernels`` replaces the cupy runner (the CPU emulator of ``tests/attention/emulator``
    runs the same sources on host threads); tensors on any device are then accepted and
    ``num_sms`` stands in for the device's multiprocessor count.
    """

    name = "cuda"

    def __init__(
        self,
        split_k: bool | None = None,
        partition_size: int | None = None,
        prefill: str = "auto",
        kernels: KernelRunner | None = None,
        num_sms: int | None = None,
        decode: str = "auto",
        cache_write: str = "kernel",
    ) -> None:
        if prefill not in ("auto", "sdpa", "paged"):
            raise ValueError(f"prefill must be 'auto', 'sdpa' or 'paged', not {prefill!r}")
        if decode not in ("auto", "legacy", "torch"):
            raise ValueError(f"decode must be 'auto', 'legacy' or 'torch', not {decode!r}")
        if cache_write not in ("kernel", "torch"):
            raise ValueError(f"cache_write must be 'kernel' or 'torch', not {cache_write!r}")
        if partition_size is not None and partition_size <= 0:
            raise ValueError(f"partition_size must be positive, not {partition_size}")
        self.split_k = split_k
        self.partition_size = partition_size
        self.prefill = prefill
        self.decode_kernel = decode
        self.cache_write = cache_write
        self.last_decode: object | None = None
        self.last_prefill: str | None = None
        self._ref = TorchAttentionBackend()
        self._logged: set[str] = set()
        self._num_sms: dict[int, int] = {}
        # keyed on the step's slot_mapping, shared by every layer's metadata of one step
        self._host_meta: tuple[torch.Tensor, list[int], list[int]] | None = None
        self._cupy: bool | None = None
        self._kernels: KernelRunner = kernels if kernels is not None else KERNELS
        self._emulated = kernels is not None
        self._fixed_sms = num_sms
        self._tc = TcLauncher(self._kernels, self._emulated)

    @staticmethod
    def available() -> bool:
        """Whether this backend can launch kernels here (CUDA device and cupy present)."""
        return torch.cuda.is_available() and cupy_available()

    @property
    def kernel_runner(self) -> KernelRunner:
        """The runner this backend launches through (cupy's cache, or an injected one)."""
        return self._kernels

    def variant(self, kernels: KernelRunner | None = None, **routes: Any) -> CudaAttentionBackend:
        """A sibling backend with some constructor settings changed (``routes``: split_k,
        partition_size, prefill, decode, cache_write), sharing this one's kernel runner
        (or ``kernels``, a wrapper of it), emulation and multiprocessor count."""
        settings: dict[str, Any] = {
            "split_k": self.split_k, "partition_size": self.partition_size,
            "prefill": self.prefill, "decode": self.decode_kernel,
            "cache_write": self.cache_write, **routes,
        }
        other = CudaAttentionBackend(**settings, num_sms=self._fixed_sms)
        other._kernels = kernels if kernels is not None else self._kernels
        other._emulated = self._emulated
        other._tc = TcLauncher(other._kernels, other._emulated)
        return other

    def paths(self, dtype: torch.dtype, kv_dtype: torch.dtype, head_dim: int,
              num_q_heads: int, num_kv_heads: int, block_size: int) -> dict[str, str]:
        """What serves each component for this shape: ``decode`` (``tensor_core`` |
        ``legacy`` | ``torch``), ``prefill`` (``tensor_core``, i.e. the paged kernel where
        :func:`~qworker.attention.cuda_kernels.prefill_choice` picks it and SDPA elsewhere |
        ``legacy`` | ``sdpa``), ``cache_write`` (``cuda`` | ``torch``); all ``torch`` when the
        kernels cannot serve the shape at all (the cache write has its own kernel)."""
        q = torch.empty((0, num_q_heads, head_dim), dtype=dtype)
        kc = torch.empty((0, num_kv_heads, block_size, head_dim), dtype=kv_dtype)
        reason, path = self._path(q, kc, kc)
        write = "torch" if self.cache_write == "torch" else "cuda"
        if reason is not None:
            return {"decode": "torch", "prefill": "torch", "cache_write": write}
        decode = {"tc": "tensor_core", "legacy": "legacy"}[path]
        if self.decode_kernel == "torch":
            decode = "torch"
        tc_prefill = tc_supported(dtype, head_dim) and prefill_tc_supported(dtype, head_dim)
        prefill = "sdpa"
        if self.prefill != "sdpa" and tc_prefill:
            prefill = "tensor_core"
        elif self.prefill == "paged" and not tc_supported(dtype, head_dim):
            prefill = "legacy"
        return {"decode": decode, "prefill": prefill, "cache_write": write}

    # -- helpers -------------------------------------------------------------------------

    def _fallback(self, reason: str) -> None:
        if reason not in self._logged:
            self._logged.add(reason)
            logger.warning("cuda attention backend: %s; using the torch path", reason)

    def _usable(self, *tensors: torch.Tensor) -> bool:
        if self._emulated:
            return True
        if not all(t.is_cuda for t in tensors):
            return False
        if self._cupy is None:
            self._cupy = cupy_available()
        if not self._cupy:
            self._fallback("cupy is not importable")
        return self._cupy

    def _sms(self, device: torch.device) -> int:
        if self._fixed_sms is not None:
            return self._fixed_sms
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index not in self._num_sms:
            self._num_sms[index] = torch.cuda.get_device_properties(index).multi_processor_count
        return self._num_sms[index]

    def _host_lists(self, meta: AttentionMetadata) -> tuple[list[int], list[int]]:
        """``query_start_loc`` and ``seq_lens`` on the host, fetched once per step's meta."""
        cached = self._host_meta
        if cached is None or cached[0] is not meta.slot_mapping:
            starts = meta.host_query_start_loc
            lens = meta.host_seq_lens
            starts = meta.query_start_loc.tolist() if starts is None else list(starts)
            lens = meta.seq_lens.tolist() if lens is None else list(lens)
            cached = (meta.slot_mapping, starts, lens)
            self._host_meta = cached
        return cached[1], cached[2]

    def plan_decode(
        self,
        max_seqs: int,
        max_seq_len: int,
        num_q_heads: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        kv_cache_dtype: torch.dtype | None = None,
        sliding_window: int | None = None,
        device: torch.device | str = "cuda",
    ) -> FixedDecodePlan:
        """A fixed decode launch plan for up to ``max_seqs`` sequences of at most
        ``max_seq_len`` tokens, with its own workspace: set it as ``meta.decode_plan`` when
        capturing a CUDA graph (the grid no longer depends on the step; each sequence's
        split count comes from the device ``seq_lens``). Only for the tensor-core decode
        (fp16/bf16 queries); make it before capture (it allocates)."""
        device = torch.device(device)
        if not tc_supported(dtype, head_dim) or self.decode_kernel != "auto":
            raise ValueError(f"no tensor-core decode for {dtype} head size {head_dim}")
        kv8 = kv_cache_dtype is not None and is_fp8(kv_cache_dtype)
        sms = self._sms(device)
        return self._tc.plan_decode(dtype, kv8, head_dim, max_seqs, num_q_heads, num_kv_heads,
                                    max_seq_len, sms, device, sliding_window)  # fmt: skip

    # -- AttentionBackend ----------------------------------------------------------------

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        kv_scales: torch.Tensor | None = None,
    ) -> None:
        """Store new K/V rows at their slots with ``reshape_and_cache`` (quantizing with
        ``reshape_and_cache_fp8`` for an FP8 cache); -1 slots skipped."""
        if self.cache_write == "torch" or not self._usable(key_cache, value_cache, key, value):
            return self._ref.write_kv(key, value, key_cache, value_cache, slot_mapping, kv_scales)
        if not (key_cache.is_contiguous() and value_cache.is_contiguous()):
            self._fallback("non-contiguous KV cache")
            return self._ref.write_kv(key, value, key_cache, value_cache, slot_mapping, kv_scales)
        num_tokens = key.shape[0]
        if num_tokens == 0:
            return None
        slots = slot_mapping
        if slots.dtype != torch.int64 or slots.device != key_cache.device:
            slots = slots.to(device=key_cache.device, dtype=torch.int64)
        slots = slots.contiguous()
        _, heads, block_size, dim = key_cache.shape
        if is_fp8(key_cache.dtype):
            scales, pool, layer = resolve_scales(key_cache, kv_scales)
            if pool is not None:
                pool.calibrate(layer, key, value, slots)
            dtype = key.dtype if key.dtype in DTYPE_CODE else torch.float32
            key, value = _rows(key.to(dtype)), _rows(value.to(dtype))
            name = reshape_and_cache_fp8_name(dtype)
            kernel = self._kernels.get(CACHE_OPS, name, key_cache.device)
            args = (
                ptr(key), ptr(value), ptr(key_cache), ptr(value_cache), ptr(slots), ptr(scales),
                i64(key.stride(0)), i64(value.stride(0)), i32(heads), i32(dim), i32(block_size),
                i64(key_cache.stride(0)), i64(key_cache.stride(1)),
            )  # fmt: skip
            self._kernels.launch(kernel, (num_tokens, 1, 1), _BLOCK, args, key_cache.device)
            return None
        key = _rows(key.to(key_cache.dtype))
        value = _rows(value.to(value_cache.dtype))
        elem = key_cache.element_size()
        row_bytes = dim * elem
        key_stride, value_stride = key.stride(0) * elem, value.stride(0) * elem
        addresses = (
            key.data_ptr(), value.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(),
            key_stride, value_stride, row_bytes,
        )  # fmt: skip
        unit = 16 if all(a % 16 == 0 for a in addresses) else elem
        kernel = self._kernels.get(CACHE_OPS, reshape_and_cache_name(unit), key_cache.device)
        args = (
            ptr(key), ptr(value), ptr(key_cache), ptr(value_cache), ptr(slots),
            i64(key_stride), i64(value_stride), i32(heads), i32(row_bytes), i32(block_size),
            i64(key_cache.stride(0) * elem), i64(key_cache.stride(1) * elem),
        )  # fmt: skip
        self._kernels.launch(kernel, (num_tokens, 1, 1), _BLOCK, args, key_cache.device)
        return None

    def _path(
        self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor
    ) -> tuple[str | None, str]:
        """(reason to use the torch reference or None, "tc" | "legacy"): the decode kernel
        (``decode="torch"`` keeps "tc" where tensor cores serve the shape, for prefill)."""
        _, q_heads, dim = query.shape
        _, kv_heads, block_size, _ = key_cache.shape
        kv8 = is_fp8(key_cache.dtype)
        tc = self.decode_kernel != "legacy" and tc_supported(query.dtype, dim)
        if kv8:
            if not tc:
                return f"FP8 cache with {query.dtype} queries of head size {dim}", "tc"
            reason = layout_reason(block_size, q_heads, kv_heads)
        elif query.dtype != key_cache.dtype:
            return f"query dtype {query.dtype} differs from cache dtype {key_cache.dtype}", "tc"
        elif tc:
            reason = layout_reason(block_size, q_heads, kv_heads)
        else:
            reason = unsupported_reason(key_cache.dtype, dim, block_size, q_heads, kv_heads)
        if reason is None and not (key_cache.is_contiguous() and value_cache.is_contiguous()):
            reason = "non-contiguous KV cache"
        return reason, "tc" if tc else "legacy"

    def forward(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        kv_scales: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Decodes through the decode kernel; prefill chunks per ``self.prefill``."""
        if not self._usable(query, key_cache, value_cache):
            return self._ref.forward(query, key_cache, value_cache, meta, scale, kv_scales)
        reason, path = self._path(query, key_cache, value_cache)
        if reason is not None:
            self._fallback(reason)
            return self._ref.forward(query, key_cache, value_cache, meta, scale, kv_scales)
        scales = None
        if is_fp8(key_cache.dtype):
            scales = resolve_scales(key_cache, kv_scales)[0]
        query = _rows(query)
        dim = query.shape[2]
        out = torch.empty_like(query)
        tables = meta.block_tables
        if tables.dtype != torch.int32 or tables.stride(-1) != 1:
            tables = tables.to(torch.int32).contiguous()
        num_decodes = meta.num_decodes
        if num_decodes > 0:
            ctx = meta.seq_lens[:num_decodes]
            if ctx.dtype != torch.int32:
                ctx = ctx.to(torch.int32)
            if self.decode_kernel == "torch":
                starts, lens = self._host_lists(meta)
                sdpa_prefill(query, key_cache, value_cache, tables, starts, lens[:num_decodes],
                             0, scale, out, meta.sliding_window, scales,
                             soft_cap=meta.logits_soft_cap)  # fmt: skip
            elif path == "tc":
                self._tc.decode(query, out, key_cache, value_cache, tables, ctx.contiguous(),
                                meta, scale, scales, self._sms(query.device), self.split_k,
                                self.partition_size)  # fmt: skip
                self.last_decode = self._tc.last_decode
            else:
                self.decode(query, out, key_cache, value_cache, tables, ctx.contiguous(), None,
                            meta.max_seq_len, scale, meta.sliding_window,
                            meta.logits_soft_cap)  # fmt: skip
        if num_decodes < meta.num_seqs:
            starts, lens = self._host_lists(meta)
            mode = self.prefill
            # the tensor-core prefill serves its shapes whichever decode kernel runs
            tc_prefill = tc_supported(query.dtype, dim) and prefill_tc_supported(query.dtype, dim)
            if mode == "auto":  # the legacy per-token path never wins (cuda/NOTES.md)
                mode = "sdpa"
                if tc_prefill:
                    mode = prefill_choice(meta.num_seqs - num_decodes, meta.max_query_len)
            if mode == "paged" and tc_supported(query.dtype, dim) and not tc_prefill:
                mode = "sdpa"  # past PREFILL_TC_MAX_HEAD
            self.last_prefill = mode
            if mode == "sdpa":
                sdpa_prefill(query, key_cache, value_cache, tables, starts, lens, num_decodes,
                             scale, out, meta.sliding_window, scales,
                             soft_cap=meta.logits_soft_cap)  # fmt: skip
            elif tc_prefill:
                self._tc.prefill(query, out, key_cache, value_cache, tables, meta, starts, lens,
                                 scale, scales)  # fmt: skip
            else:
                self._paged_prefill(query, out, key_cache, value_cache, tables, meta, starts, scale)
        return out

    def _paged_prefill(
        self,
        query: torch.Tensor,
        out: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        tables: torch.Tensor,
        meta: AttentionMetadata,
        starts: list[int],
        scale: float,
    ) -> None:
        """Every prefill token as a decode work item whose context ends at its position."""
        first, last = starts[meta.num_decodes], starts[meta.num_seqs]
        if last == first:
            return
        device = query.device
        qsl = meta.query_start_loc.to(torch.int64)
        q_lens = qsl[1:] - qsl[:-1]
        seq_ids = torch.repeat_interleave(
            torch.arange(meta.num_decodes, meta.num_seqs, device=device),
            q_lens[meta.num_decodes :],
            output_size=last - first,
        )
        rows = torch.arange(first, last, device=device)
        ends = qsl[1:][seq_ids]
        ctx = (meta.seq_lens.to(torch.int64)[seq_ids] - ends + 1 + rows).to(torch.int32)
        self.decode(query[first:last], out[first:last], key_cache, value_cache, tables, ctx,
                    seq_ids.to(torch.int32), meta.max_seq_len, scale,
                    sliding_window=meta.sliding_window,
                    soft_cap=meta.logits_soft_cap)  # fmt: skip

    def decode(
        self,
        query: torch.Tensor,
        out: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        block_tables: torch.Tensor,
        ctx_lens: torch.Tensor,
        work_seq: torch.Tensor | None,
        max_ctx: int,
        scale: float,
        sliding_window: int | None = None,
        soft_cap: float | None = None,
    ) -> None:
        """Launch the decode kernel (and the reduce when split) for ``len(ctx_lens)`` items.

        Item ``w`` reads query row ``w`` of ``query`` [items, Hq, D] (rows may be strided),
        block-table row ``work_seq[w]`` (``w`` when None) and context ``[.., ctx_lens[w])``;
        it writes row ``w`` of ``out``. ``ctx_lens``/``work_seq``/``block_tables`` are int32
        on the device; ``max_ctx`` bounds every ``ctx_lens`` entry (launch sizing only);
        ``soft_cap`` caps the scaled scores (``cap * tanh(s / cap)``, None: no cap).
        """
        num_work = ctx_lens.shape[0]
        if num_work == 0:
            return
        device = query.device
        _, q_heads, dim = query.shape
        _, kv_heads, block_size, _ = key_cache.shape
        group = q_heads // kv_heads
        plan = plan_decode(num_work, kv_heads, group, max_ctx, self._sms(device), self.split_k,
                           self.partition_size, sliding_window)  # fmt: skip
        self.last_decode = plan
        window = sliding_window or 0
        name = decode_name(key_cache.dtype, dim, group, capped=soft_cap is not None)
        kernel = self._kernels.get(PAGED_ATTENTION, name, device)
        part_out = part_max = part_sum = None
        if plan.split:
            shape = (num_work, q_heads, plan.num_partitions)
            part_out = torch.empty((*shape, dim), dtype=torch.float32, device=device)
            part_max = torch.empty(shape, dtype=torch.float32, device=device)
            part_sum = torch.empty(shape, dtype=torch.float32, device=device)
        args = (
            ptr(out), ptr(part_out), ptr(part_max), ptr(part_sum), ptr(query), ptr(key_cache),
            ptr(value_cache), ptr(block_tables), ptr(work_seq), ptr(ctx_lens),
            i64(query.stride(0)), i64(out.stride(0)), i32(block_tables.stride(0)),
            i32(kv_heads), i32(group), i32(plan.head_tiles),
            i64(key_cache.stride(0)), i64(key_cache.stride(1)), i32(block_size.bit_length() - 1),
            f32(scale * _LOG2E), i32(window), i32(plan.partition_size), i32(plan.num_partitions),
            f32((soft_cap or 0.0) * _LOG2E),
        )  # fmt: skip
        grid = (num_work, kv_heads * plan.head_tiles, plan.num_partitions)
        self._kernels.launch(kernel, grid, _BLOCK, args, device)
        if plan.split:
            reduce = self._kernels.get(PAGED_ATTENTION, reduce_name(key_cache.dtype), device)
            args = (
                ptr(out), ptr(part_out), ptr(part_max), ptr(part_sum), ptr(ctx_lens),
                i64(out.stride(0)), i32(q_heads), i32(dim), i32(plan.partition_size),
                i32(plan.num_partitions), i32(window),
            )  # fmt: skip
            self._kernels.launch(reduce, (q_heads, num_work, 1), _BLOCK, args, device,
                           shared_mem=4 * plan.num_partitions)  # fmt: skip

    def copy_blocks(self, kv_cache: KVCache, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy blocks ``src[i] -> dst[i]`` in every layer with one ``copy_blocks`` launch.

        ``src`` and ``dst`` must not share blocks (pairs are copied in parallel).
        """
        pool = kv_cache.key
        if not self._usable(pool, kv_cache.value):
            return self._ref.copy_blocks(kv_cache, src, dst)
        num_pairs = src.numel()
        if num_pairs == 0:
            return None
        layers, num_blocks = pool.shape[0], pool.shape[1]
        block_bytes = pool[0, 0].numel() * pool.element_size()
        bases = (block_bytes, pool.data_ptr(), kv_cache.value.data_ptr())
        aligned = all(a % 16 == 0 for a in bases)
        if not (aligned and pool.is_contiguous() and kv_cache.value.is_contiguous()):
            self._fallback("KV pool not 16-byte aligned or not contiguous for copy_blocks")
            return self._ref.copy_blocks(kv_cache, src, dst)
        src = src.to(device=pool.device, dtype=torch.int64).contiguous()
        dst = dst.to(device=pool.device, dtype=torch.int64).contiguous()
        kernel = self._kernels.get(CACHE_OPS, COPY_BLOCKS_NAME, pool.device)
        args = (
            ptr(pool), ptr(kv_cache.value), ptr(src), ptr(dst),
            i64(num_blocks * block_bytes), i64(block_bytes),
        )  # fmt: skip
        self._kernels.launch(kernel, (num_pairs, layers, 2), _BLOCK, args, pool.device)
        return None

    def swap_blocks(
        self, src_cache: KVCache, dst_cache: KVCache, src: torch.Tensor, dst: torch.Tensor
    ) -> None:
        """Move blocks between the device pool and the pinned host pool with torch copies.

        Per K and V: one ``index_select`` gathers the blocks on the source side into a
        contiguous (pinned, on the host) staging tensor, one ``cudaMemcpyAsync`` moves it,
        one ``index_copy_`` scatters it on the destination side. Torch copies rather than a
        kernel touching host memory: they need no mapped-memory assumptions about how the
        host pool was pinned, and each direction is one large transfer. Device -> host ends
        with a stream synchronize (the host-side scatter must see the data); host -> device
        stays asynchronous (torch's pinned allocator keeps the staging alive until done).
        """
        s_dev, d_dev = src_cache.key.device, dst_cache.key.device
        if s_dev.type != "cuda" and d_dev.type != "cuda":
            return self._ref.swap_blocks(src_cache, dst_cache, src, dst)
        if src.numel() == 0:
            return None
        src_idx = src.to(device=s_dev, dtype=torch.int64)
        dst_idx = dst.to(device=d_dev, dtype=torch.int64)
        pending: list[tuple[torch.Tensor, torch.Tensor]] = []
        for s_pool, d_pool in ((src_cache.key, dst_cache.key), (src_cache.value, dst_cache.value)):
            if s_pool.dtype == FP8_DTYPE:  # torch lacks index_copy_ for float8: move bytes
                s_pool, d_pool = s_pool.view(torch.uint8), d_pool.view(torch.uint8)
            if s_dev == d_dev:
                d_pool.index_copy_(1, dst_idx, s_pool.index_select(1, src_idx))
            elif d_dev.type == "cuda":  # host -> device
                shape = (s_pool.shape[0], src_idx.numel(), *s_pool.shape[2:])
                staged = torch.empty(shape, dtype=s_pool.dtype, pin_memory=True)
                torch.index_select(s_pool, 1, src_idx, out=staged)
                d_pool.index_copy_(1, dst_idx, staged.to(d_dev, non_blocking=True))
            else:  # device -> host
                staged = s_pool.index_select(1, src_idx)
                host = torch.empty(staged.shape, dtype=staged.dtype, pin_memory=True)
                host.copy_(staged, non_blocking=True)
                pending.append((d_pool, host))
        if pending:
            torch.cuda.current_stream(s_dev).synchronize()
            for d_pool, host in pending:
                d_pool.index_copy_(1, dst_idx, host)
        return None
