"""How a model is split over tensor-parallel ranks: a plan per model class, applied once.

A model class declares ``tp_plan`` (``qworker.models.base.CausalLM``): module-name
patterns (``*`` stands for a layer index) mapped to a ``ShardRule``. ``shard_model``
replaces each matching module, on the ``meta`` device before any weight exists, by its
``qworker.models.parallel_layers`` counterpart sized for one rank, so a rank allocates
and loads only its slice. Every other module (norms, rotary tables, OPT's projections)
is replicated. Attention modules learn their per-rank head counts here, and so does the
model's ``spec`` (the KV pool and the kernels' launch plans are per rank).

A new architecture slots in by declaring its plan; a new kind of layer adds a
``ShardKind`` and its constructor below (docs/tensor_parallel.md). MoE experts are
split by their intermediate dimension (``EXPERTS``): every rank routes every token the
same way, computes its partial expert outputs, and the block sums them in one
all-reduce. FP8 layers are made from the sharded ones afterwards
(``qworker.models.quant.prepare``), their scales sliced with their weights.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum
from typing import Any

from torch import nn

from qworker.attention.paged_attention import PagedAttention
from qworker.errors import ModelLoadError
from qworker.models.parallel_layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    RowRange,
    ShardInfo,
    VocabParallelEmbedding,
    even_range,
    kv_head_range,
    padded_range,
)


class ShardKind(Enum):
    """How one module is split (see ``qworker.models.parallel_layers``)."""

    #: Fused q/k/v projection: query heads split, KV heads split or replicated.
    QKV = "qkv"
    #: Output features split; each part of a fused projection (gate/up) on its own.
    COLUMN = "column"
    #: Input features split, partial sums all-reduced, bias added once.
    ROW = "row"
    #: Token embedding table: vocabulary rows split, lookups all-reduced.
    VOCAB_EMBEDDING = "vocab_embedding"
    #: LM head: vocabulary rows split, logits gathered on rank 0 by the model runner.
    VOCAB_HEAD = "vocab_head"
    #: A MoE block's stacked experts: every expert's intermediate dimension split (w1/w3
    #: rows, w2 columns); the enclosing ``SparseMoeBlock`` all-reduces its output once.
    EXPERTS = "experts"


@dataclass(frozen=True, slots=True)
class ShardRule:
    """One entry of a plan: the kind of split, the config field a divisibility error
    names (``intermediate_size``, ``ffn_dim``, ...), and whether the checkpoint stores a
    fused projection's parts in one tensor (Phi-3's ``qkv_proj`` / ``gate_up_proj``).

    ``optional``: the pattern may match no module (a MoE model's dense MLPs, present only
    in its ``mlp_only_layers``). ``partial`` (ROW only): the layer leaves its partial sum
    to the enclosing block's one all-reduce (Qwen2-MoE's shared expert)."""

    kind: ShardKind
    field: str = ""
    fused_checkpoint: bool = False
    optional: bool = False
    partial: bool = False


#: A model class's plan: module-name pattern -> rule.
TPPlan = dict[str, ShardRule]


class TensorParallelConfigError(ModelLoadError):
    """The model cannot be split over ``tensor_parallel_size`` ranks (names the field)."""


def _pattern(pattern: str) -> re.Pattern[str]:
    return re.compile("^" + re.escape(pattern).replace(r"\*", r"\d+") + "$")


def shard_model(model: Any, shard: ShardInfo) -> None:
    """Replace the modules ``model``'s class plan names by rank ``shard.rank``'s slices
    (call on the meta device, before weights are allocated); updates ``model.spec``'s
    head counts to this rank's. Raises ``TensorParallelConfigError`` naming the field
    when a split is not even, or the architecture has no plan."""
    plan: TPPlan | None = getattr(type(model), "tp_plan", None)
    n = shard.world_size
    if not plan:
        raise TensorParallelConfigError(
            f"tensor_parallel_size={n}: {type(model).__name__} has no tensor-parallel plan "
            "yet (use tensor_parallel_size=1)")
    if n == 1:
        return
    patterns = [(_pattern(p), p, rule) for p, rule in plan.items()]
    matched: set[str] = set()
    heads: tuple[int, int] | None = None
    for name, module in list(model.named_modules()):
        for regex, pattern, rule in patterns:
            if not regex.match(name):
                continue
            matched.add(pattern)
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            replacement, local_heads = _parallel(rule, name, module, parent, shard)
            heads = heads or local_heads
            setattr(parent, child, replacement)
            break
    missing = [p for _, p, rule in patterns if p not in matched and not rule.optional]
    if missing:
        raise ModelLoadError(f"{type(model).__name__}'s tensor-parallel plan names modules "
                             f"it does not have: {', '.join(missing)}")
    if heads is not None:
        model.spec.num_q_heads, model.spec.num_kv_heads = heads
    if hasattr(model, "tie_weights"):
        model.tie_weights()  # the head and the embedding are new modules


def _parallel(rule: ShardRule, name: str, module: nn.Module, parent: nn.Module,
              shard: ShardInfo) -> tuple[nn.Module, tuple[int, int] | None]:
    """The sharded module replacing ``module`` (and per-rank (q, kv) heads for QKV)."""
    kind, rank, n = rule.kind, shard.rank, shard.world_size
    if kind is ShardKind.QKV:
        return _qkv(rule, name, module, parent, shard)
    if kind is ShardKind.ROW:
        in_features, out_features = _linear_shape(name, module)
        _check_even(in_features, n, rule.field or f"{name} input features")
        return RowParallelLinear(even_range(in_features, rank, n), out_features,
                                 module.bias is not None, shard, reduce=not rule.partial), None
    if kind is ShardKind.EXPERTS:
        return _experts(rule, name, module, parent, shard), None
    if kind is ShardKind.COLUMN:
        in_features, out_features = _linear_shape(name, module)
        sizes = dict(getattr(module, "shards", None) or {"": out_features})
        for size in sizes.values():
            _check_even(size, n, rule.field or f"{name} output features")
        parts = {part: even_range(size, rank, n) for part, size in sizes.items()}
        return ColumnParallelLinear(in_features, parts, module.bias is not None,
                                    rule.fused_checkpoint), None
    if kind is ShardKind.VOCAB_EMBEDDING:
        if not isinstance(module, nn.Embedding):
            raise ModelLoadError(f"tensor-parallel plan: {name} is not an embedding")
        rows = padded_range(module.num_embeddings, rank, n)
        return VocabParallelEmbedding(rows, module.embedding_dim, shard), None
    if kind is ShardKind.VOCAB_HEAD:
        in_features, out_features = _linear_shape(name, module)
        return ColumnParallelLinear(in_features, {"": padded_range(out_features, rank, n)},
                                    module.bias is not None), None
    raise ModelLoadError(f"tensor-parallel plan: no rule for {kind}")


def _qkv(rule: ShardRule, name: str, module: nn.Module, parent: nn.Module,
         shard: ShardInfo) -> tuple[nn.Module, tuple[int, int]]:
    rank, n = shard.rank, shard.world_size
    attns = [m for m in parent.modules() if isinstance(m, PagedAttention)]
    sizes = getattr(module, "shards", None)
    if len(attns) != 1 or not sizes or list(sizes) != ["q", "k", "v"]:
        raise ModelLoadError(f"tensor-parallel plan: {name} is not a fused q/k/v projection "
                             "beside one attention layer")
    attn = attns[0]
    q_heads, kv_heads, head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
    if q_heads % n:
        raise TensorParallelConfigError(
            f"tensor_parallel_size={n} must divide num_attention_heads={q_heads} (query "
            "heads are split evenly over the ranks)")
    if kv_heads % n and n % kv_heads:
        raise TensorParallelConfigError(
            f"tensor_parallel_size={n} must divide num_key_value_heads={kv_heads} or be a "
            "multiple of it (KV heads are split over the ranks, or replicated when there "
            "are fewer of them than ranks)")
    local_q, local_kv = q_heads // n, max(1, kv_heads // n)
    q = even_range(q_heads * head_dim, rank, n)
    kv = kv_head_range(kv_heads, head_dim, rank, n)
    parts: dict[str, RowRange] = {"q": q, "k": kv, "v": kv}
    replacement = ColumnParallelLinear(_linear_shape(name, module)[0], parts,
                                       getattr(module, "bias", None) is not None,
                                       rule.fused_checkpoint)
    attn.num_heads, attn.num_kv_heads = local_q, local_kv
    if hasattr(parent, "num_heads"):
        parent.num_heads = local_q
    if hasattr(parent, "num_kv_heads"):
        parent.num_kv_heads = local_kv
    return replacement, (local_q, local_kv)


def _experts(rule: ShardRule, name: str, module: nn.Module, parent: nn.Module,
             shard: ShardInfo) -> nn.Module:
    """Rank ``shard.rank``'s slice of every expert (``FusedExperts`` of ``I / N`` rows);
    the parent ``SparseMoeBlock`` learns to all-reduce its output."""
    from qworker.models.moe import FusedExperts, SparseMoeBlock

    if type(module) is not FusedExperts or not isinstance(parent, SparseMoeBlock):
        raise ModelLoadError(f"tensor-parallel plan: {name} is not the experts of a MoE block")
    n = shard.world_size
    _check_even(module.inter, n, rule.field or f"{name} intermediate size")
    sliced = FusedExperts(module.num_experts, module.hidden, module.inter // n, module.act,
                          inter_range=even_range(module.inter, shard.rank, n))
    parent.shard = shard
    return sliced


def _linear_shape(name: str, module: nn.Module) -> tuple[int, int]:
    weight = getattr(module, "weight", None)
    if weight is None or weight.dim() != 2:
        raise ModelLoadError(f"tensor-parallel plan: {name} is not a linear layer")
    return int(weight.shape[1]), int(weight.shape[0])


def _check_even(size: int, n: int, field: str) -> None:
    if size % n:
        raise TensorParallelConfigError(
            f"tensor_parallel_size={n} must divide {field}={size} (it is split evenly over "
            "the ranks)")
