"""The kernel self-test at engine start (``kernel_selftest``: "on" | "strict" | "off"; see
docs/operations.md, "Kernel self-test").

With the CUDA attention backend, before the pool is sized, :func:`run_selftest` checks the
kernels the engine selected against the torch reference at the model's dtype, head size,
GQA group, block size, sliding windows and KV cache dtype (FP8 included):
:func:`qworker.attention.selftest.select_attention` (cache write, decode, prefill) and
:func:`qworker.models.fused_selftest.check_fused_ops` (the fused small ops). Once the decode
CUDA graphs are captured, :func:`check_graph_replay` replays one decode step and compares it
with the same step run eagerly.

A failing check is logged as an error naming the kernel, the shape and the error; "on" then
runs that component on the path that passed (the CUDA-core decode kernel or gather + SDPA,
the torch scatter, the op's torch form, eager decode steps), "strict" refuses to start with
:class:`KernelSelfTestError` (one line). ``EngineStats.kernel_selftest`` and
``EngineStats.kernel_paths`` say what passed and what runs.
"""

from __future__ import annotations

import enum
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from qworker.attention.backend import AttentionBackend
from qworker.attention.paged_attention import attention_layers
from qworker.attention.selftest import (
    CheckResult,
    SelftestShape,
    rel_err,
    select_attention,
)
from qworker.engine.step_inputs import StepInput
from qworker.models.base import ModelSpec
from qworker.models.fused_kernels import OPS, FusedKernels
from qworker.models.fused_selftest import FusedShape, check_fused_ops, passing_ops

logger = logging.getLogger(__name__)

MODES = ("on", "strict", "off")

#: Relative error bound of a replayed decode step's logits against the eager step's (the
#: padding rows change the matmuls' batch shape, so the last bits differ).
GRAPH_BOUND: dict[torch.dtype, float] = {
    torch.float32: 1e-4,
    torch.float16: 5e-3,
    torch.bfloat16: 2.5e-2,
}


class SelftestState(enum.Enum):
    """How the self-test ended."""

    PASSED = "passed"  # every selected kernel matched the reference
    FELL_BACK = "fell_back"  # a kernel failed; its component runs the path that passed
    OFF = "off"  # kernel_selftest="off"
    NOT_APPLICABLE = "not_applicable"  # no CUDA kernels selected (CPU or torch backend)


class KernelSelfTestError(RuntimeError):
    """A selected kernel failed the self-test under ``kernel_selftest="strict"``."""


@dataclass(slots=True)
class SelftestReport:
    """Every check made at start, what runs per component, and the state."""

    mode: str
    state: SelftestState
    shape: str = ""
    checks: list[CheckResult] = field(default_factory=list)
    paths: dict[str, str] = field(default_factory=dict)
    attention_backend: str = ""
    seconds: float = 0.0

    def failed(self) -> list[CheckResult]:
        """The checks that did not pass."""
        return [c for c in self.checks if not c.passed]

    def as_dict(self) -> dict[str, Any]:
        """A JSON-ready copy."""
        return {"mode": self.mode, "state": self.state.value, "shape": self.shape,
                "paths": dict(self.paths), "attention_backend": self.attention_backend,
                "seconds": round(self.seconds, 3), "checks": [c.as_dict() for c in self.checks]}


def _fail_strict(report: SelftestReport) -> None:
    bad = report.failed()
    if report.mode == "strict" and bad:
        raise KernelSelfTestError(
            f"kernel self-test failed ({report.shape}; kernel_selftest='strict' refuses to "
            f"start): {bad[0].describe()}"
            + (f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""))


def _log(report: SelftestReport, checks: list[CheckResult]) -> None:
    for check in checks:
        if check.passed:
            logger.debug("kernel self-test: %s passed: %s", report.shape, check.describe())
        else:
            logger.error("kernel self-test: %s FAILED: %s", report.shape, check.describe())


def _mlp_width(model: torch.nn.Module, hidden: int) -> int:
    for module in model.modules():
        proj = getattr(module, "gate_up_proj", None)
        sizes = getattr(proj, "split_sizes", None)
        if sizes:
            return int(sizes[0])
    return 4 * hidden


def _summary(paths: dict[str, str]) -> str:
    return ", ".join(f"{k} {v}" for k, v in paths.items())


def run_selftest(mode: str, backend: AttentionBackend, fused: FusedKernels | None,
                 spec: ModelSpec, model: torch.nn.Module, kv_dtype: torch.dtype,
                 block_size: int, max_model_len: int, device: torch.device
                 ) -> tuple[AttentionBackend, FusedKernels | None, SelftestReport]:
    """Check ``backend`` (when it is the CUDA backend) and ``fused`` for the model's shape;
    return the attention backend and fused kernels to run, and the report. Raises
    :class:`KernelSelfTestError` for a failure under "strict"."""
    if mode not in MODES:
        raise ValueError(f"kernel_selftest must be one of {', '.join(MODES)}, got {mode!r}")
    kinds = tuple(dict.fromkeys((a.sliding_window, a.logits_soft_cap)
                                for a in attention_layers(model))) or ((None, None),)
    shape = SelftestShape(spec.dtype, kv_dtype, spec.head_dim, spec.num_q_heads,
                          spec.num_kv_heads, block_size, kinds, max_model_len)
    report = SelftestReport(mode, SelftestState.NOT_APPLICABLE, shape.describe())
    paths_of = getattr(backend, "paths", None)
    if paths_of is None:  # the torch reference or the CPU backend: nothing to check
        report.paths = {"decode": backend.name, "prefill": backend.name,
                        "cache_write": backend.name}
        report.paths.update({op: "cuda" if fused is not None and op in fused.ops else "torch"
                             for op in OPS} if device.type == "cuda" else {})
        report.attention_backend = backend.name
        return backend, fused, report
    wanted = paths_of(spec.dtype, kv_dtype, spec.head_dim, spec.num_q_heads,
                      spec.num_kv_heads, block_size)
    if mode == "off":
        report.state = SelftestState.OFF
    else:
        started = time.perf_counter()
        selection = select_attention(backend, shape, device)
        backend = selection.backend
        report.checks += selection.checks
        if fused is not None:
            fshape = FusedShape(spec.dtype, spec.hidden_size, _mlp_width(model, spec.hidden_size),
                                spec.num_q_heads, spec.num_kv_heads, spec.head_dim)
            fused_checks = check_fused_ops(fused, fshape, device)
            report.checks += fused_checks
            fused = passing_ops(fused, fused_checks)
        report.seconds = time.perf_counter() - started
        report.state = SelftestState.FELL_BACK if report.failed() else SelftestState.PASSED
        _log(report, report.checks)
        _fail_strict(report)
    paths_of = getattr(backend, "paths", None)
    if paths_of is None:
        report.paths = {"decode": "torch", "prefill": "torch", "cache_write": "torch"}
    else:
        report.paths = paths_of(spec.dtype, kv_dtype, spec.head_dim, spec.num_q_heads,
                                spec.num_kv_heads, block_size)
    if device.type == "cuda" or fused is not None:
        report.paths.update({op: "cuda" if fused is not None and op in fused.ops else "torch"
                             for op in OPS})
    attn = {k: report.paths[k] for k in ("decode", "prefill", "cache_write")}
    if all(v == "torch" for v in attn.values()):
        report.attention_backend = "torch"
    elif attn == wanted and wanted["decode"] != "torch":
        report.attention_backend = "cuda"
    else:  # a component fell back, or the kernels serve only part of this shape
        report.attention_backend = "mixed"
    if report.state is SelftestState.PASSED:
        logger.info("kernel self-test passed in %.2fs (%d checks, %s): %s", report.seconds,
                    len(report.checks), report.shape, _summary(report.paths))
    elif report.state is SelftestState.FELL_BACK:
        logger.error("kernel self-test: %d of %d checks failed (%s); running %s",
                     len(report.failed()), len(report.checks), report.shape,
                     _summary(report.paths))
    return backend, fused, report


def check_graph_replay(runner: Any) -> CheckResult:
    """One decode step of (up to) two short sequences replayed from the captured graphs against the
    same step run eagerly (after an eager prefill), by the relative error of the logits.

    Uses the first blocks of the freshly allocated pool; an FP8 pool's scales are put back
    uncalibrated afterwards, so the first real prefill calibrates them as it would have."""
    bs, vocab = runner.block_size, runner.spec.vocab_size
    lens = [5, bs + 3][: min(2, max(runner.graphs.sizes))]
    prompts = [[(17 * i + 7 * j + 3) % vocab for j in range(n)] for i, n in enumerate(lens)]
    tables, first = [], 0
    for n in lens:
        count = -(-(n + 1) // bs)
        tables.append(list(range(first, first + count)))
        first += count
    step = StepInput([[11 + i] for i in range(len(lens))], lens, tables, [1] * len(lens))
    scales = runner.kv_cache.scales
    saved = None if scales is None else (scales.values.clone(), list(scales.calibrated))
    bucket = None
    try:
        with torch.inference_mode():
            runner.forward(runner.inputs.build(StepInput(prompts, [0] * len(lens), tables,
                                                         [1] * len(lens))))
            replayed = runner.prepare(step)
            bucket = replayed.graph_size
            if bucket is None:
                raise RuntimeError("the decode step did not go to a captured graph")
            got = runner.forward(replayed)
            want = runner.forward(runner.inputs.build(step))
            if runner.device.type == "cuda":
                torch.cuda.synchronize(runner.device)
            err, error = rel_err(got, want), None
    except Exception as exc:  # a failed replay is a failed check
        err, error = float("inf"), f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
    finally:
        if scales is not None and saved is not None:
            scales.values.copy_(saved[0])
            scales.calibrated[:] = saved[1]
    return CheckResult("cuda_graph", "replay", [f"decode graph of bucket {bucket}"], err,
                       GRAPH_BOUND.get(runner.spec.dtype, 2.5e-2), f"{len(lens)} sequences", error)


def check_graphs(report: SelftestReport, runner: Any) -> None:
    """Run :func:`check_graph_replay` when graphs were captured and the self-test is on;
    a failure drops the graphs (decode steps run eagerly) or, under "strict", raises."""
    if report.mode == "off" or runner.graphs is None or not runner.graphs.captured:
        return
    if report.state is SelftestState.NOT_APPLICABLE:
        report.state = SelftestState.PASSED
    result = check_graph_replay(runner)
    report.checks.append(result)
    _log(report, [result])
    if not result.passed:
        report.state = SelftestState.FELL_BACK
        _fail_strict(report)
        logger.error("kernel self-test: CUDA graph replay disagrees with the eager step; "
                     "decode steps run eagerly")
        runner.drop_cuda_graphs()
