"""Mixture-of-experts decoders: Mixtral, Qwen2-MoE and Qwen3-MoE.

Each is the Llama family's decoder (attention, norms, RoPE: ``qworker.models.llama``)
whose feed-forward blocks are ``SparseMoeBlock``s where its transformers config puts
them:

- Mixtral: every layer; ``num_local_experts`` experts of width ``intermediate_size``,
  top-``num_experts_per_tok`` renormalised, routing weights kept in fp32.
- Qwen2-MoE / Qwen3-MoE: layer ``i`` is sparse unless ``i`` is in ``mlp_only_layers``,
  when ``num_experts > 0`` and ``(i + 1) % decoder_sparse_step == 0``; otherwise a dense
  MLP of ``intermediate_size``. Experts are ``moe_intermediate_size`` wide, renormalised
  only with ``norm_topk_prob``. Qwen2-MoE adds a shared expert
  (``shared_expert_intermediate_size``) scaled by ``sigmoid(shared_expert_gate(x))``.

Checkpoint names (docs/moe.md): the per-expert tensors checkpoints carry
(``block_sparse_moe.experts.N.w1/w3/w2`` for Mixtral, ``mlp.experts.N.gate_proj/up_proj/
down_proj`` for Qwen) and transformers 5's fused ``mlp.experts.gate_up_proj`` /
``mlp.experts.down_proj`` both load.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from qworker.errors import ModelLoadError
from qworker.models.layers import activation
from qworker.models.llama import LlamaForCausalLM, LlamaMLP
from qworker.models.moe import FusedExperts, RouterSpec, SparseMoeBlock
from qworker.models.moe_exec import moe_graph_safe
from qworker.models.tp_plan import ShardKind, ShardRule, TPPlan
from qworker.models.weights import check_all_loaded, load_weights

_PER_EXPERT = re.compile(
    r"^(?P<layer>.*\.)(?:block_sparse_moe|mlp)\.experts\.(?P<expert>\d+)\."
    r"(?P<proj>w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$"
)
_FUSED = re.compile(r"^(?P<layer>.*\.)(?:block_sparse_moe|mlp)\.experts\."
                    r"(?P<param>gate_up_proj|down_proj)$")
_PARTS = {"w1": "gate", "w3": "up", "w2": "down",
          "gate_proj": "gate", "up_proj": "up", "down_proj": "down"}


def _positive_int(config: Any, name: str) -> int:
    value = getattr(config, name, None)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ModelLoadError(f"config.json: {name} must be an integer >= 1, got {value!r}")
    return value


def _router_spec(config: Any, num_experts: int, normalize: bool, in_model_dtype: bool
                 ) -> RouterSpec:
    top_k = _positive_int(config, "num_experts_per_tok")
    if top_k > num_experts:
        raise ModelLoadError(f"config.json: num_experts_per_tok={top_k} exceeds the "
                             f"{num_experts} experts")
    return RouterSpec(num_experts, top_k, normalize, in_model_dtype)


class MoeForCausalLM(LlamaForCausalLM):
    """The Llama decoder with ``SparseMoeBlock`` feed-forward layers (see subclasses)."""

    has_shared_expert = False

    def moe_block(self, config: Any, layer_idx: int) -> SparseMoeBlock | None:
        """Layer ``layer_idx``'s sparse block, or None where the layer is dense."""
        raise NotImplementedError

    def build_mlp(self, config: Any, layer_idx: int) -> nn.Module:
        """The sparse block where the config puts one, else the dense MLP."""
        block = self.moe_block(config, layer_idx)
        return block if block is not None else LlamaMLP(config)

    def graph_capturable(self, device: torch.device) -> bool:
        """Whether every sparse block runs without host syncs on ``device``
        (``qworker.models.moe_exec``)."""
        return all(moe_graph_safe(device, self.spec.dtype, m.hidden, m.inter)
                   for m in self.modules() if isinstance(m, FusedExperts))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Fill every parameter from transformers-named tensors (per-expert or fused expert
        tensors, see the module docstring); raise if any is missing."""
        skip: tuple[str, ...] = ("rotary_emb.inv_freq",)
        if self.tie_word_embeddings:
            skip = (*skip, "lm_head.weight")
        if self.has_shared_expert and not any(
                m.shared_expert is not None for m in self.modules()
                if isinstance(m, SparseMoeBlock)):
            # shared_expert_intermediate_size 0: transformers still writes the (empty)
            # shared expert and its gate; their product adds exactly 0
            skip = (*skip, ".mlp.shared_expert.", ".mlp.shared_expert_gate.")
        experts: dict[str, FusedExperts] = {}
        loaded = load_weights(self, self._route_experts(weights, experts), self.stacked_params,
                              skip)
        for prefix, module in experts.items():
            loaded.update(f"{prefix}.{name}" for name in module.complete())
        check_all_loaded(self, loaded)

    def _experts_at(self, layer: str, name: str, seen: dict[str, FusedExperts]
                    ) -> tuple[str, FusedExperts]:
        prefix = f"{layer}mlp.experts"
        try:
            module = self.get_submodule(prefix)
        except AttributeError:
            module = None
        if not isinstance(module, FusedExperts):
            raise ModelLoadError(f"checkpoint tensor {name!r} has no place in the model "
                                 "(that layer has no experts in this config)")
        seen[prefix] = module
        return prefix, module

    def _route_experts(self, weights: Iterable[tuple[str, torch.Tensor]],
                       seen: dict[str, FusedExperts]) -> Iterator[tuple[str, torch.Tensor]]:
        """Load expert tensors into their ``FusedExperts``; pass the rest on (Mixtral's
        ``block_sparse_moe.`` renamed ``mlp.``)."""
        for name, tensor in weights:
            per_expert = _PER_EXPERT.match(name)
            fused = None if per_expert else _FUSED.match(name)
            match = per_expert or fused
            if match is None:
                yield name.replace(".block_sparse_moe.", ".mlp."), tensor
                continue
            _, module = self._experts_at(match["layer"], name, seen)
            try:
                if per_expert:
                    part = _PARTS[match["proj"]]
                    module.load(part, module.checkpoint_slice(part, tensor, False),
                                int(match["expert"]))
                else:
                    part = match["param"]
                    module.load(part, module.checkpoint_slice(part, tensor, True))
            except ValueError as exc:
                raise ModelLoadError(f"checkpoint tensor {name!r}: {exc}") from exc


def _moe_plan(expert_field: str, shared: bool = False) -> TPPlan:
    """Llama's attention, embedding and head split; experts split by their intermediate
    dimension, routers replicated; dense MLPs (``mlp_only_layers``) as Llama's; the
    shared expert column/row split, its partial summed in the block's one all-reduce."""
    plan = {p: r for p, r in LlamaForCausalLM.tp_plan.items() if ".mlp." not in p}
    plan.update({
        "model.layers.*.mlp.gate_up_proj": ShardRule(ShardKind.COLUMN, "intermediate_size",
                                                     optional=True),
        "model.layers.*.mlp.down_proj": ShardRule(ShardKind.ROW, "intermediate_size",
                                                  optional=True),
        "model.layers.*.mlp.experts": ShardRule(ShardKind.EXPERTS, expert_field,
                                                optional=True),
    })
    if shared:
        field = "shared_expert_intermediate_size"
        plan.update({
            "model.layers.*.mlp.shared_expert.gate_up_proj": ShardRule(
                ShardKind.COLUMN, field, optional=True),
            "model.layers.*.mlp.shared_expert.down_proj": ShardRule(
                ShardKind.ROW, field, optional=True, partial=True),
        })
    return plan


class MixtralForCausalLM(MoeForCausalLM):
    """Mixtral: every layer sparse, top-k renormalised, fp32 routing weights."""

    tp_plan = _moe_plan("intermediate_size")

    def moe_block(self, config: Any, layer_idx: int) -> SparseMoeBlock | None:
        """Every layer's sparse block."""
        num_experts = _positive_int(config, "num_local_experts")
        router = _router_spec(config, num_experts, normalize=True, in_model_dtype=False)
        return SparseMoeBlock(config.hidden_size, config.intermediate_size, router,
                              activation(config.hidden_act))


class Qwen2MoeForCausalLM(MoeForCausalLM):
    """Qwen2-MoE: sparse layers per ``decoder_sparse_step`` / ``mlp_only_layers``, plus a
    sigmoid-gated shared expert."""

    has_shared_expert = True
    tp_plan = _moe_plan("moe_intermediate_size", shared=True)

    def moe_block(self, config: Any, layer_idx: int) -> SparseMoeBlock | None:
        """The sparse block where transformers' Qwen MoE decoder layer puts one."""
        num_experts = getattr(config, "num_experts", 0) or 0
        step = _positive_int(config, "decoder_sparse_step")
        dense = set(getattr(config, "mlp_only_layers", None) or [])
        if layer_idx in dense or num_experts <= 0 or (layer_idx + 1) % step != 0:
            return None
        router = _router_spec(config, num_experts, bool(config.norm_topk_prob),
                              in_model_dtype=True)
        shared = getattr(config, "shared_expert_intermediate_size", 0) if \
            self.has_shared_expert else 0
        return SparseMoeBlock(config.hidden_size, _positive_int(config, "moe_intermediate_size"),
                              router, activation(config.hidden_act), shared_inter=shared or None)


class Qwen3MoeForCausalLM(Qwen2MoeForCausalLM):
    """Qwen3-MoE: Qwen2-MoE's layer placement and router, no shared expert, q/k norms."""

    has_shared_expert = False
    tp_plan = _moe_plan("moe_intermediate_size")
