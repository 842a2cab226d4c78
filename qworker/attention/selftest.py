"""The attention half of the engine's kernel self-test: the CUDA backend's kernels against the
torch reference on small random paged batches of the model's own shape.

At engine start (``kernel_selftest``, docs/configuration.md) :func:`select_attention` runs,
on the device, with the engine's backend and kernel runner (cupy on a GPU; the CPU emulator of
``tests/attention/emulator`` in tests, so the very same code runs both ways):

1. the cache write (``reshape_and_cache``, or ``reshape_and_cache_fp8`` for an FP8 cache)
   against the reference's scatter, on the slots of a step;
2. the decode kernel on three sequences (one token, a block and one, a context of several
   64-token partitions), unsplit and split, per kind of attention layer of the model
   (sliding window, soft-cap);
3. a mixed step (a decode, a fresh prompt, a chunk over a cached prefix) through the paged
   prefill kernel.

Each is compared with :class:`~qworker.attention.torch_ref.TorchAttentionBackend` on the same
inputs by ``||out - ref|| / ||ref||`` against :data:`BOUNDS` (output rounding of the dtype,
with room: a wrong kernel is off by far more; docs/operations.md, "Kernel self-test"). Every
pool slot that no sequence owns is NaN, so a kernel that reads a wrong block or past a
context fails with an infinite error. A component whose kernel fails falls back to the next
path (decode: tensor cores, then the CUDA-core kernel, then gather + SDPA; prefill: the paged
kernel, then gather + SDPA; cache write: the kernel, then the torch scatter) until one
passes; the result names every check, its kernels and its error.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from qworker.attention.backend import AttentionBackend, AttentionMetadata
from qworker.attention.cuda_kernels import (
    DTYPE_CODE,
    HEAD_SIZES,
    TC_SPLIT_UNIT,
    tc_supported,
)
from qworker.attention.fp8 import FP8_MAX, is_fp8, quantize
from qworker.attention.kernel_cache import KernelRunner
from qworker.attention.torch_ref import TorchAttentionBackend

logger = logging.getLogger(__name__)

#: Relative error bounds per query dtype: 5-10x what output rounding gives on these small
#: contexts (bf16 ~1e-3, fp16 ~2e-4, fp32 ~2e-7 measured on the emulator), inside the kernel
#: tests' tolerances (tests/attention/cases.py), far below what a wrong kernel gives.
BOUNDS: dict[torch.dtype, float] = {
    torch.float32: 1e-4,
    torch.float16: 2e-3,
    torch.bfloat16: 1e-2,
}

#: Query magnitude: sharper softmax rows than unit-variance queries give, as trained models
#: have, so a wrong scale or a dropped token moves the output visibly.
QUERY_GAIN = 2.0

_REF = TorchAttentionBackend()


#: One kind of attention layer: (sliding window, logits soft-cap), None meaning off.
LayerKind = tuple[int | None, float | None]


@dataclass(slots=True)
class CheckResult:
    """One self-test comparison: which component and path, the kernels it launched, the
    relative error against the reference (inf for NaN) and the bound, or the exception."""

    component: str
    path: str
    kernels: list[str]
    rel_err: float
    bound: float
    detail: str = ""
    error: str | None = None

    @property
    def passed(self) -> bool:
        """Within the bound and raised nothing (NaN never passes)."""
        return self.error is None and self.rel_err <= self.bound

    def describe(self) -> str:
        """One line: component, path, kernels, error vs bound (or the exception)."""
        kernels = ", ".join(dict.fromkeys(self.kernels)) or "no kernel"
        detail = f" {self.detail}" if self.detail else ""
        what = f"{self.component} [{self.path}: {kernels}]{detail}"
        if self.error is not None:
            return f"{what}: raised {self.error}"
        return f"{what}: relative error {self.rel_err:.3g} (bound {self.bound:g})"

    def as_dict(self) -> dict[str, Any]:
        """A JSON-ready copy (``rel_err`` inf becomes None)."""
        err = self.rel_err if math.isfinite(self.rel_err) else None
        return {"component": self.component, "path": self.path, "kernels": self.kernels,
                "rel_err": err, "bound": self.bound, "detail": self.detail,
                "error": self.error, "passed": self.passed}


@dataclass(slots=True, frozen=True)
class SelftestShape:
    """The model's attention shape the self-test runs at."""

    dtype: torch.dtype
    kv_dtype: torch.dtype
    head_dim: int
    num_q_heads: int
    num_kv_heads: int
    block_size: int
    #: the model's kinds of attention layer: (sliding window, logits soft-cap), None = off
    layer_kinds: tuple[LayerKind, ...] = ((None, None),)
    max_model_len: int = 4096

    def describe(self) -> str:
        """``bfloat16 head 128 GQA 32/8 block 16 [kv fp8]`` for log lines."""
        kv = "" if self.kv_dtype == self.dtype else f" kv {str(self.kv_dtype)[6:]}"
        windows = sorted({w for w, _ in self.layer_kinds if w is not None})
        caps = sorted({c for _, c in self.layer_kinds if c is not None})
        win = (f" windows {windows}" if windows else "") + (f" soft-caps {caps}" if caps else "")
        return (f"{str(self.dtype).removeprefix('torch.')} head {self.head_dim} GQA "
                f"{self.num_q_heads}/{self.num_kv_heads} block {self.block_size}{kv}{win}")


class RecordingKernels:
    """A kernel runner that notes every kernel looked up through it, then defers to ``inner``."""

    def __init__(self, inner: KernelRunner) -> None:
        self.inner = inner
        self.names: list[str] = []

    def get(self, source_name: str, name_expression: str, device: torch.device) -> Any:
        """``inner.get``, noting ``name_expression``."""
        self.names.append(name_expression)
        return self.inner.get(source_name, name_expression, device)

    def launch(self, kernel: Any, grid: tuple[int, int, int], block: tuple[int, int, int],
               args: tuple[Any, ...], device: torch.device, shared_mem: int = 0) -> None:
        """``inner.launch`` unchanged."""
        self.inner.launch(kernel, grid, block, args, device, shared_mem=shared_mem)


@dataclass(slots=True)
class Case:
    """One random step over one layer's paged cache, with its new tokens' K/V."""

    query: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    meta: AttentionMetadata
    new_key: torch.Tensor
    new_value: torch.Tensor
    scales: torch.Tensor | None
    scale: float


def make_case(shape: SelftestShape, q_lens: list[int], seq_lens: list[int],
              window: int | None, device: torch.device, seed: int,
              soft_cap: float | None = None) -> Case:
    """Sequences (decodes, query length 1, first) whose contexts before this step's tokens
    are cached in randomly placed blocks; every slot no sequence owns (block 0 included) is
    NaN. An FP8 cache gets per-tensor scales with headroom, passed explicitly."""
    bs, dim = shape.block_size, shape.head_dim
    gen = torch.Generator(device="cpu").manual_seed(seed)
    blocks = [-(-n // bs) for n in seq_lens]
    num_blocks = 2 + sum(blocks)
    perm = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    tables = torch.zeros(len(seq_lens), max(blocks) + 1, dtype=torch.int32)
    owned = torch.zeros(num_blocks, bs, dtype=torch.bool)
    used = 0
    for s, n in enumerate(seq_lens):
        tables[s, : blocks[s]] = torch.tensor(perm[used : used + blocks[s]], dtype=torch.int32)
        used += blocks[s]
        pos = torch.arange(n)
        owned[tables[s, pos // bs].long(), pos % bs] = True
    pool_shape = (num_blocks, shape.num_kv_heads, bs, dim)
    key = torch.randn(pool_shape, generator=gen)
    value = torch.randn(pool_shape, generator=gen)
    slots = [int(tables[s, p // bs]) * bs + p % bs
             for s, (q, n) in enumerate(zip(q_lens, seq_lens, strict=True))
             for p in range(n - q, n)]
    tokens = len(slots)
    new_key = torch.randn(tokens, shape.num_kv_heads, dim, generator=gen)
    new_value = torch.randn(tokens, shape.num_kv_heads, dim, generator=gen)
    query = torch.randn(tokens, shape.num_q_heads, dim, generator=gen) * QUERY_GAIN
    scales = None
    if is_fp8(shape.kv_dtype):
        amax = torch.stack([key.abs().max(), value.abs().max()])
        scales = (amax * 2.0 / FP8_MAX).float().to(device)
    for pool in (key, value):
        pool.transpose(1, 2)[~owned] = float("nan")
    if scales is not None:
        key_cache, value_cache = quantize(key, scales[0].cpu()), quantize(value, scales[1].cpu())
    else:
        key_cache, value_cache = key.to(shape.kv_dtype), value.to(shape.kv_dtype)
    starts = [0]
    for q in q_lens:
        starts.append(starts[-1] + q)
    num_decodes = 0
    while num_decodes < len(q_lens) and q_lens[num_decodes] == 1:
        num_decodes += 1
    meta = AttentionMetadata(
        num_seqs=len(seq_lens), num_tokens=tokens, num_decodes=num_decodes,
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=tables.to(device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        max_query_len=max(q_lens), max_seq_len=max(seq_lens), sliding_window=window,
        logits_soft_cap=soft_cap,
    )
    return Case(query.to(device, shape.dtype), key_cache.to(device), value_cache.to(device),
                meta, new_key.to(device, shape.dtype), new_value.to(device, shape.dtype),
                scales, dim**-0.5)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``||out - ref|| / ||ref||`` in float64; inf when ``out`` holds a NaN or an inf."""
    o, r = out.double(), ref.double()
    if not bool(torch.isfinite(o).all()):
        return math.inf
    return float((o - r).norm() / r.norm().clamp_min(1e-30))


def _attend(backend: AttentionBackend, case: Case) -> torch.Tensor:
    """Write the step's K/V into a copy of the case's cache, then attend."""
    kc, vc = case.key_cache.clone(), case.value_cache.clone()
    backend.write_kv(case.new_key, case.new_value, kc, vc, case.meta.slot_mapping, case.scales)
    return backend.forward(case.query, kc, vc, case.meta, case.scale, case.scales)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _run_check(component: str, path: str, detail: str, bound: float,
               recorder: RecordingKernels, device: torch.device, body: Any) -> CheckResult:
    """Run ``body() -> (out, ref)`` and compare; an exception is a failed check."""
    try:
        out, ref = body()
        _sync(device)
        err = rel_err(out, ref)
        return CheckResult(component, path, list(recorder.names), err, bound, detail)
    except Exception as exc:  # a compile or launch failure fails the check, nothing else
        return CheckResult(component, path, list(recorder.names), math.inf, bound, detail,
                           error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}")


def check_cache_write(backend: Any, shape: SelftestShape, device: torch.device) -> CheckResult:
    """The backend's cache write against the reference's, on a step of 3 sequences: the
    written pools must agree (byte copies exactly; FP8 quantization within rounding)."""
    case = make_case(shape, [1, 5, 2 * shape.block_size + 1],
                     [9, 5, 3 * shape.block_size + 2], None, device, seed=11)
    recorder = RecordingKernels(backend.kernel_runner)
    candidate = backend.variant(kernels=recorder)

    def body() -> tuple[torch.Tensor, torch.Tensor]:
        got = (case.key_cache.clone(), case.value_cache.clone())
        want = (case.key_cache.clone(), case.value_cache.clone())
        for b, (k, v) in ((candidate, got), (_REF, want)):
            b.write_kv(case.new_key, case.new_value, k, v, case.meta.slot_mapping, case.scales)
        slots = case.meta.slot_mapping
        rows = [torch.stack([_slot_rows(c, slots) for c in pair]) for pair in (got, want)]
        return _dequant(rows[0], case.scales), _dequant(rows[1], case.scales)

    bound = 1e-2 if case.scales is not None else 1e-6
    return _run_check("cache_write", "cuda", "", bound, recorder, device, body)


def _slot_rows(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """The ``[len(slots), heads, D]`` rows of a ``[blocks, heads, B, D]`` cache at ``slots``."""
    bs = cache.shape[2]
    raw = cache.view(torch.uint8) if is_fp8(cache.dtype) else cache  # no float8 gather
    rows = raw[torch.div(slots, bs, rounding_mode="floor"), :, slots % bs]
    return rows.view(cache.dtype)


def _dequant(rows: torch.Tensor, scales: torch.Tensor | None) -> torch.Tensor:
    if scales is None:
        return rows.float()
    return torch.stack([rows[0].float() * scales[0], rows[1].float() * scales[1]])


def decode_cases(shape: SelftestShape) -> list[tuple[LayerKind, list[int]]]:
    """((window, soft-cap), context lengths) of the decode checks: per kind of layer, one
    token, a block and one, and a context of several 64-token partitions (past the window,
    if any)."""
    bs, top = shape.block_size, max(2, shape.max_model_len - 1)
    cases = []
    for kind in dict.fromkeys(shape.layer_kinds):
        window = kind[0]
        long = 3 * TC_SPLIT_UNIT + bs // 2 + 5 if window is None else window + 2 * TC_SPLIT_UNIT + 5
        cases.append((kind, sorted({1, min(top, bs + 1), min(top, long)})))
    return cases


def _kind_detail(kind: LayerKind) -> str:
    window, cap = kind
    return (f" window {window}" if window else "") + (f" soft-cap {cap:g}" if cap else "")


def check_decode(backend: Any, shape: SelftestShape, device: torch.device,
                 path: str) -> list[CheckResult]:
    """Decode through ``backend`` (its routes as set) unsplit and split (64-token partitions),
    per window, against the reference."""
    results = []
    for kind, lens in decode_cases(shape):
        case = make_case(shape, [1] * len(lens), lens, kind[0], device, seed=sum(lens),
                         soft_cap=kind[1])
        for split in (False, True):
            recorder = RecordingKernels(backend.kernel_runner)
            candidate = backend.variant(kernels=recorder, split_k=split,
                                        partition_size=TC_SPLIT_UNIT if split else None)
            detail = f"contexts {lens}{' split' if split else ''}" + _kind_detail(kind)

            def body(c: Any = candidate, case: Case = case) -> tuple[torch.Tensor, torch.Tensor]:
                return _attend(c, case), _attend(_REF, case)

            results.append(_run_check("decode", path, detail, BOUNDS[shape.dtype], recorder,
                                      device, body))
    return results


def check_prefill(backend: Any, shape: SelftestShape, device: torch.device,
                  path: str) -> list[CheckResult]:
    """A mixed step (a decode, a fresh 7-token prompt, a chunk after a cached prefix) through
    ``backend``, per window, against the reference."""
    bs, top = shape.block_size, max(8, shape.max_model_len - 1)
    results = []
    for kind in dict.fromkeys(shape.layer_kinds):
        window = kind[0]
        chunk = 2 * bs + 3
        past = bs + 5 if window is None else window + 9
        q_lens = [1, 7, min(chunk, top - 1)]
        lens = [min(top, 40), 7, min(top, q_lens[2] + past)]
        case = make_case(shape, q_lens, lens, window, device, seed=7 + sum(lens),
                         soft_cap=kind[1])
        recorder = RecordingKernels(backend.kernel_runner)
        candidate = backend.variant(kernels=recorder)
        detail = f"chunks {q_lens} of contexts {lens}" + _kind_detail(kind)

        def body(c: Any = candidate, case: Case = case) -> tuple[torch.Tensor, torch.Tensor]:
            return _attend(c, case), _attend(_REF, case)

        results.append(_run_check("prefill", path, detail, BOUNDS[shape.dtype], recorder,
                                  device, body))
    return results


def decode_routes(backend: Any, shape: SelftestShape) -> list[tuple[str, str]]:
    """(``decode`` setting, path name) candidates, preferred first, ending with torch."""
    routes = []
    tc = tc_supported(shape.dtype, shape.head_dim)
    legacy_ok = (not is_fp8(shape.kv_dtype) and shape.dtype in DTYPE_CODE
                 and shape.head_dim in HEAD_SIZES)
    if backend.decode_kernel == "auto" and tc:
        routes.append(("auto", "tensor_core"))
    if backend.decode_kernel in ("auto", "legacy") and legacy_ok:
        routes.append(("legacy" if tc else "auto", "legacy"))
    routes.append(("torch", "torch"))
    return routes


@dataclass(slots=True)
class AttentionSelection:
    """What :func:`select_attention` chose: the backend to run, every check made, and
    whether any kernel failed (``fell_back``)."""

    backend: AttentionBackend
    checks: list[CheckResult] = field(default_factory=list)
    fell_back: bool = False
    seconds: float = 0.0


def select_attention(backend: Any, shape: SelftestShape, device: torch.device
                     ) -> AttentionSelection:
    """Check the CUDA backend's kernels for ``shape`` on ``device`` and return a backend whose
    every component passed (the reference itself when nothing did). Never raises for a
    failing kernel: the caller decides (log or refuse, ``kernel_selftest``)."""
    started = time.perf_counter()
    checks: list[CheckResult] = []
    write = check_cache_write(backend.variant(cache_write="kernel"), shape, device)
    checks.append(write)
    chosen = backend.variant(cache_write="kernel" if write.passed else "torch")
    decode_ok = False
    for setting, path in decode_routes(backend, shape):
        results = check_decode(chosen.variant(decode=setting), shape, device, path)
        checks += results
        if all(r.passed for r in results):
            chosen, decode_ok = chosen.variant(decode=setting), True
            break
    prefill_ok = False
    routes = [("paged", "tensor_core")] if chosen.paths(
        shape.dtype, shape.kv_dtype, shape.head_dim, shape.num_q_heads, shape.num_kv_heads,
        shape.block_size)["prefill"] == "tensor_core" else []
    for setting, path in [*routes, ("sdpa", "sdpa")]:
        results = check_prefill(chosen.variant(prefill=setting), shape, device, path)
        checks += results
        if all(r.passed for r in results):
            chosen = chosen.variant(prefill=backend.prefill if setting == "paged" else setting)
            prefill_ok = True
            break
    final: AttentionBackend = chosen if decode_ok and prefill_ok else TorchAttentionBackend()
    return AttentionSelection(final, checks, any(not c.passed for c in checks),
                              time.perf_counter() - started)
