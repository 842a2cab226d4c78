"""Running the experts of a MoE block, grouped by expert.

The ``T * k`` (token, expert) pairs are sorted by expert id (a stable sort, so each
expert's rows keep token order), the tokens' hidden states gathered in that order, and
each expert's matmul pair runs over its contiguous run of rows:

- ``torch._grouped_mm`` does all experts in one call per projection, reading the run
  boundaries (``offs``, cumulative counts, int32) on the device. The counts come from a
  ``scatter_add_`` of ones (fixed shape), so nothing syncs with the host and the whole
  block is CUDA-graph capturable. Used where torch has a kernel for the device and
  dtype: bf16 on sm90+ GPUs (the CUTLASS kernel); on the CPU, every float dtype torch's
  CPU kernel takes (torch >= 2.9). Probed once per (device, dtype) against the loop.
- Otherwise the grouped loop: one matmul pair per active expert, whose row counts are
  read on the host (``tolist``). On a GPU that is a sync per MoE layer, so a model that
  runs it there turns CUDA graphs off (``moe_graph_safe``).

The weighted results are put back in (token, slot) order with ``index_copy_`` (unique
indices: deterministic, unlike an atomic ``index_add_``) and summed over the ``k`` slots
with fp32 accumulation.
"""

from __future__ import annotations

import contextlib
import enum
import logging
from collections.abc import Callable, Iterator

import torch

logger = logging.getLogger(__name__)


class ExpertPath(enum.Enum):
    """How the experts' matmuls run (see the module docstring)."""

    GROUPED_MM = "grouped_mm"
    LOOP = "loop"


_probed: dict[tuple[str, torch.dtype], bool] = {}
_forced: list[ExpertPath | None] = [None]


@contextlib.contextmanager
def force_path(path: ExpertPath | None) -> Iterator[None]:
    """Run every MoE block through ``path`` inside the block (tests compare the two)."""
    saved = _forced[0]
    _forced[0] = path
    try:
        yield
    finally:
        _forced[0] = saved


def _reference_grouped(a: torch.Tensor, b: torch.Tensor, offs: list[int]) -> torch.Tensor:
    out, start = [], 0
    for e, end in enumerate(offs):
        out.append(a[start:end] @ b[e])
        start = end
    return torch.cat(out)


def grouped_mm_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``torch._grouped_mm`` serves ``dtype`` on ``device`` here (probed once)."""
    key = (str(device), dtype)
    if key in _probed:
        return _probed[key]
    ok = hasattr(torch, "_grouped_mm")
    if ok and device.type == "cuda":
        ok = dtype == torch.bfloat16 and torch.cuda.get_device_capability(device) >= (9, 0)
    elif ok and device.type != "cpu":
        ok = False
    if ok:
        try:
            gen = torch.Generator(device="cpu").manual_seed(0)
            a = torch.randn(24, 32, generator=gen).to(device, dtype)
            b = torch.randn(3, 48, 32, generator=gen).to(device, dtype)
            offs = [5, 5, 24]
            got = torch._grouped_mm(a, b.transpose(1, 2),
                                    offs=torch.tensor(offs, dtype=torch.int32, device=device))
            want = _reference_grouped(a.float(), b.transpose(1, 2).float(), offs)
            ok = bool(torch.allclose(got.float(), want, rtol=2e-2, atol=2e-2))
        except (RuntimeError, NotImplementedError, TypeError) as exc:
            logger.info("torch._grouped_mm unavailable for %s on %s: %s", dtype, device, exc)
            ok = False
    _probed[key] = ok
    logger.info("MoE experts on %s (%s): %s", device, dtype,
                "torch._grouped_mm" if ok else "grouped loop")
    return ok


def expert_path(device: torch.device, dtype: torch.dtype, hidden: int, inter: int
                ) -> ExpertPath:
    """The path experts of these sizes take on ``device`` in ``dtype``."""
    if _forced[0] is not None:
        return _forced[0]
    # The kernels (CUDA and CPU) want every row of both operands 16-byte aligned.
    size = torch.empty((), dtype=dtype).element_size()
    aligned = (hidden * size) % 16 == 0 and (inter * size) % 16 == 0
    if aligned and grouped_mm_available(device, dtype):
        return ExpertPath.GROUPED_MM
    return ExpertPath.LOOP


def moe_graph_safe(device: torch.device, dtype: torch.dtype, hidden: int, inter: int) -> bool:
    """Whether a MoE block of these sizes runs without host syncs (CUDA-graph capturable)."""
    return device.type != "cuda" or expert_path(device, dtype, hidden, inter) is \
        ExpertPath.GROUPED_MM


def sort_pairs(x: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor,
                                                         torch.Tensor]:
    """``(flat ids [T*k], order [T*k], xs [T*k, H])``: the (token, slot) pairs sorted by
    expert (stable) and the tokens' hidden states gathered in that order."""
    flat = ids.reshape(-1)
    order = torch.sort(flat, stable=True).indices
    return flat, order, x.index_select(0, order // ids.shape[1])


def expert_offsets(flat: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Cumulative row counts per expert (int32 ``[E]``), computed on the device."""
    counts = torch.zeros(num_experts, dtype=torch.int32, device=flat.device)
    counts.scatter_add_(0, flat.to(torch.int64), torch.ones_like(flat, dtype=torch.int32))
    return counts.cumsum(0, dtype=torch.int32)


def combine(ys: torch.Tensor, weights: torch.Tensor, order: torch.Tensor, num_tokens: int,
            dtype: torch.dtype) -> torch.Tensor:
    """The weighted expert outputs ``ys`` (sorted rows) summed per token in fp32."""
    k = weights.shape[1]
    weighted = ys * weights.reshape(-1)[order].unsqueeze(-1)
    unsorted = torch.empty_like(weighted).index_copy_(0, order, weighted)
    summed = unsorted.view(num_tokens, k, ys.shape[-1]).sum(dim=1, dtype=torch.float32)
    return summed.to(dtype)


def run_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                gate_up: torch.Tensor, down: torch.Tensor,
                act: Callable[[torch.Tensor], torch.Tensor],
                act_quant: Callable[[torch.Tensor], torch.Tensor] | None = None
                ) -> torch.Tensor:
    """``out[t] = sum_j weights[t, j] * down[e] @ (act(gate[e] @ x[t]) * up[e] @ x[t])``
    with ``e = ids[t, j]``; ``gate_up`` ``[E, 2I, H]``, ``down`` ``[E, H, I]``.
    ``act_quant`` (the CPU's FP8 emulation) is applied to each matmul's input rows."""
    num_tokens, hidden = x.shape
    num_experts, two_inter, _ = gate_up.shape
    inter = two_inter // 2
    flat, order, xs = sort_pairs(x, ids)
    quant = act_quant or (lambda t: t)
    xs = quant(xs)
    path = expert_path(x.device, x.dtype, hidden, inter)
    if path is ExpertPath.GROUPED_MM:
        offs = expert_offsets(flat, num_experts)
        h = torch._grouped_mm(xs, gate_up.transpose(1, 2), offs=offs)
        gate, up = h.split(inter, dim=-1)
        ys = torch._grouped_mm(quant(act(gate) * up), down.transpose(1, 2), offs=offs)
    else:
        counts_host = torch.bincount(flat, minlength=num_experts).tolist()
        ys = torch.empty_like(xs)
        start = 0
        for e, count in enumerate(counts_host):
            if count:
                rows = xs[start : start + count]
                gate, up = (rows @ gate_up[e].t()).split(inter, dim=-1)
                torch.mm(quant(act(gate) * up), down[e].t(), out=ys[start : start + count])
                start += count
    return combine(ys, weights, order, num_tokens, x.dtype)
