"""Mixture-of-experts blocks: the router, the experts' weights and their grouped execution.

A sparse MoE block routes each token to its ``top_k`` experts (softmax over the router's
logits, top-k, optionally renormalised), runs every expert once over the tokens routed
to it and sums the expert outputs weighted by the routing weights. Tokens are never
looped over in Python: the ``T * top_k`` (token, expert) pairs are sorted by expert, so
each expert sees one contiguous run of rows, and the results are scattered back with
one weighted ``index_add_`` (``qworker.models.moe_exec`` runs the matmuls).

The expert weights are stored fused, as transformers 5 holds them in memory:
``experts.gate_up_proj`` ``[E, 2 * inter, hidden]`` (gate rows first, then up) and
``experts.down_proj`` ``[E, hidden, inter]``. Checkpoints name them per expert
(Mixtral's ``experts.N.w1/w3/w2``, Qwen's ``experts.N.gate_proj/up_proj/down_proj``)
or fused; ``FusedExperts.load`` takes both (docs/moe.md).

Under tensor parallelism (docs/tensor_parallel.md) each rank holds every expert's slice
``inter_range`` of the intermediate dimension (gate/up rows, down columns;
``checkpoint_slice`` reads only those), computes the same routing and its partial
expert outputs, and the block sums them (with the shared expert's partial) in one
all-reduce.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from qworker.models.checkpoint_tensor import (
    Readable,
    read_all,
    read_cols,
    read_narrow,
    read_rows,
)
from qworker.models.layers import FusedLinear, Linear
from qworker.models.moe_exec import run_experts
from qworker.models.ops import gated_act
from qworker.models.parallel_layers import RowRange, ShardInfo

#: The parts of one expert a per-expert checkpoint tensor can fill.
EXPERT_PARTS = ("gate", "up", "down")


@dataclass(frozen=True, slots=True)
class RouterSpec:
    """How a router turns logits into weights.

    ``normalize``: renormalise the top-k probabilities to sum to 1 (Mixtral always;
    Qwen's ``norm_topk_prob``). ``weights_in_model_dtype``: cast the weights to the
    activations' dtype before they scale the expert outputs (Qwen) instead of keeping
    them in fp32 (Mixtral), as transformers does for each.
    """

    num_experts: int
    top_k: int
    normalize: bool
    weights_in_model_dtype: bool


def route(logits: torch.Tensor, spec: RouterSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights [T, k], expert ids [T, k] int64)`` of router ``logits`` ``[T, E]``.

    Softmax in fp32, top-k on the device; nothing is read back to the host.
    """
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, spec.top_k, dim=-1)
    if spec.normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if spec.weights_in_model_dtype:
        weights = weights.to(logits.dtype)
    return weights, ids


class FusedExperts(nn.Module):
    """Every expert's gated MLP weights in two 3-D parameters (see the module docstring).

    ``load`` copies one checkpoint tensor (a whole fused parameter, or one part of one
    expert) into place; ``complete`` says which parameters every part has reached.
    ``inter_range``: the checkpoint's intermediate rows this tensor-parallel rank holds
    (``inter`` of them); None holds them all.
    """

    def __init__(self, num_experts: int, hidden: int, inter: int,
                 act: Callable[[torch.Tensor], torch.Tensor],
                 inter_range: RowRange | None = None) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.hidden = hidden
        self.inter = inter
        self.act = act
        self.inter_range = inter_range
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * inter, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, inter))
        self._seen: dict[str, set[tuple[int, str]]] = {"gate_up_proj": set(), "down_proj": set()}

    def load(self, part: str, tensor: torch.Tensor, expert: int | None = None) -> str:
        """Copy ``tensor`` into place; return the parameter name it filled.

        ``expert`` None: ``part`` is ``"gate_up_proj"`` or ``"down_proj"`` and ``tensor``
        the whole fused parameter. Otherwise ``part`` is ``"gate"``, ``"up"`` or ``"down"``
        and ``tensor`` that expert's ``[out, in]`` matrix. Raises ValueError on a shape or
        index that does not fit.
        """
        if expert is None:
            param = getattr(self, part)
            self._check(part, tuple(tensor.shape), tuple(param.shape))
            param.data.copy_(tensor)
            self._seen[part] = {(e, p) for e in range(self.num_experts) for p in EXPERT_PARTS}
            return part
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"expert {expert} is out of range: the config has "
                             f"{self.num_experts} experts")
        name = "down_proj" if part == "down" else "gate_up_proj"
        param = getattr(self, name)
        if part == "down":
            target = param.data[expert]
        else:
            start = 0 if part == "gate" else self.inter
            target = param.data[expert, start : start + self.inter]
        self._check(f"expert {expert} {part}", tuple(tensor.shape), tuple(target.shape))
        target.copy_(tensor)
        self._seen[name].add((expert, part))
        return name

    def checkpoint_slice(self, part: str, tensor: Readable, fused: bool) -> torch.Tensor:
        """This rank's slice of checkpoint tensor ``tensor`` (reading only it) for ``load``:
        ``part`` as ``load`` takes it, ``fused`` for a whole fused parameter."""
        rng = self.inter_range
        if rng is None:
            return read_all(tensor)
        shape = tuple(tensor.shape)
        if part in ("down", "down_proj"):
            dim = 2 if fused else 1
            self._check(f"{part} intermediate size", shape[dim:dim + 1], (rng.total,))
            return (read_narrow(tensor, 2, rng.start, rng.stop) if fused
                    else read_cols(tensor, rng.start, rng.stop))
        if fused:  # gate_up_proj [E, 2I, H]: this rank's gate rows, then its up rows
            self._check(f"{part} rows", shape[1:2], (2 * rng.total,))
            return torch.cat([read_narrow(tensor, 1, rng.start, rng.stop),
                              read_narrow(tensor, 1, rng.total + rng.start,
                                          rng.total + rng.stop)], dim=1)
        self._check(f"{part} rows", shape[:1], (rng.total,))
        return read_rows(tensor, rng.start, rng.stop)

    @staticmethod
    def _check(what: str, got: tuple[int, ...], want: tuple[int, ...]) -> None:
        if got != want:
            raise ValueError(f"{what}: checkpoint shape {got} != {want}")

    def complete(self) -> list[str]:
        """The parameters whose every expert part has been loaded."""
        needed = {"gate_up_proj": ("gate", "up"), "down_proj": ("down",)}
        return [name for name, parts in needed.items()
                if all((e, p) in self._seen[name] for e in range(self.num_experts)
                       for p in parts)]

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """``sum_j weights[t, j] * expert_{ids[t, j]}(x[t])`` for every token ``t``, in fp32
        accumulation cast back to ``x``'s dtype."""
        return run_experts(x, weights, ids, self.gate_up_proj, self.down_proj, self.act)


class GatedMLP(nn.Module):
    """``down(act(gate(x)) * up(x))`` of a given width (Qwen2-MoE's shared expert)."""

    def __init__(self, hidden: int, inter: int, act: Callable[[torch.Tensor], torch.Tensor]
                 ) -> None:
        super().__init__()
        self.gate_up_proj = FusedLinear(hidden, {"gate": inter, "up": inter}, bias=False)
        self.down_proj = Linear(inter, hidden, bias=False)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the MLP to ``[num_tokens, hidden]``."""
        return self.down_proj(gated_act(self.gate_up_proj(x), self.act))


class SparseMoeBlock(nn.Module):
    """Router + experts (+ Qwen2-MoE's sigmoid-gated shared expert), transformers' names:
    ``gate`` (the router), ``experts``, ``shared_expert``, ``shared_expert_gate``.

    ``shard`` (set by ``qworker.models.tp_plan``): the experts and the shared expert
    return this rank's partial sums; their combination is all-reduced once."""

    def __init__(self, hidden: int, inter: int, router: RouterSpec,
                 act: Callable[[torch.Tensor], torch.Tensor],
                 shared_inter: int | None = None) -> None:
        super().__init__()
        self.router = router
        self.gate = Linear(hidden, router.num_experts, bias=False)
        self.experts = FusedExperts(router.num_experts, hidden, inter, act)
        self.shared_expert: GatedMLP | None = None
        self.shared_expert_gate: Linear | None = None
        if shared_inter:
            self.shared_expert = GatedMLP(hidden, shared_inter, act)
            self.shared_expert_gate = Linear(hidden, 1, bias=False)
        self.shard: ShardInfo | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The block's output for ``[num_tokens, hidden]``."""
        weights, ids = route(self.gate(x), self.router)
        out = self.experts(x, weights, ids)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        if self.shard is not None:
            out = self.shard.all_reduce(out)
        return out

