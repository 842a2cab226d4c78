"""Phi-3 and Phi-4 (``Phi3ForCausalLM``): the Llama implementation with three differences.

* Checkpoints ship q/k/v and gate/up fused (``qkv_proj``, ``gate_up_proj``, in that
  order), the layout of ``qworker.models.llama``'s fused layers: they load by name.
* ``longrope`` RoPE scaling (``su`` in older configs) with short and long factors and
  the attention factor of transformers' ``_compute_longrope_parameters``; the engine
  picks the factor set once, by its ``max_model_len`` (see ``qworker.models.rope`` and
  docs/models.md for how that differs from transformers past the original length).
* Partial rotary (``partial_rotary_factor``, Phi-4-mini): only the first part of each
  head rotates.

A config's ``sliding_window`` applies to every layer, as in transformers' Phi-3.

Tensor parallelism splits it as Llama (docs/tensor_parallel.md); each rank reads its
rows of every part of the fused checkpoint tensors (``fused_checkpoint``).
"""

from __future__ import annotations

from dataclasses import replace
from typing import ClassVar

from qworker.models.llama import LlamaForCausalLM
from qworker.models.tp_plan import TPPlan

_FUSED = (".qkv_proj", ".gate_up_proj")


class Phi3ForCausalLM(LlamaForCausalLM):
    """Phi-3 / Phi-4 causal LM over a paged KV cache (see the module docstring)."""

    partial_rotary = True
    tp_plan: ClassVar[TPPlan] = {
        pattern: replace(rule, fused_checkpoint=pattern.endswith(_FUSED))
        for pattern, rule in LlamaForCausalLM.tp_plan.items()
    }
