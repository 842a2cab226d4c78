"""The attention layer every model calls, bound to its slice of the paged KV pool.

A model builds one ``PagedAttention`` per decoder layer with what the layer knows
(heads, head size, scale, sliding window, logit soft-cap, layer index). The model runner
binds every layer to its cache slice and the attention backend once (``bind_kv_cache``,
again after the pool is reallocated), and wraps each forward in ``forward_context(meta)``,
which carries the step's ``AttentionMetadata`` — built once per step, shared by every
layer. A layer with its own sliding window or soft-cap gets the step's metadata with
those, derived once per step and (window, cap) pair (Qwen2-style models mix windowed and
full layers; Gemma alternates them, Gemma 2 soft-caps every layer's scores).

So no model threads ``(kv_cache, meta, backend)`` through its forwards, and the cache
write plus attention call live here only.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from qworker.attention.backend import AttentionBackend, AttentionMetadata, KVCache

#: What a layer's metadata is derived for: (sliding window, logit soft-cap).
LayerKey = tuple[int | None, float | None]


class _State(threading.local):
    meta: AttentionMetadata | None = None
    by_window: dict[LayerKey, AttentionMetadata] | None = None
    plans: dict[int | None, Any] | None = None


_STATE = _State()


@contextlib.contextmanager
def forward_context(meta: AttentionMetadata,
                    decode_plans: dict[int | None, Any] | None = None
                    ) -> Iterator[AttentionMetadata]:
    """Make ``meta`` the current step's metadata for every ``PagedAttention`` layer (this
    thread) until the block ends; contexts nest (the outer one is restored).

    ``decode_plans`` (CUDA-graph capture) gives each sliding window its fixed decode
    launch plan (``AttentionMetadata.decode_plan``)."""
    saved = (_STATE.meta, _STATE.by_window, _STATE.plans)
    _STATE.meta, _STATE.by_window, _STATE.plans = meta, {}, decode_plans
    try:
        yield meta
    finally:
        _STATE.meta, _STATE.by_window, _STATE.plans = saved


def current_metadata(sliding_window: int | None, logits_soft_cap: float | None = None
                     ) -> AttentionMetadata:
    """The current step's metadata for a layer with ``sliding_window`` (None: full) and
    ``logits_soft_cap`` (None: no cap)."""
    by_window = _STATE.by_window
    if by_window is None or _STATE.meta is None:
        raise RuntimeError("PagedAttention called outside forward_context(): the model "
                           "runner sets the step's metadata around each forward")
    key = (sliding_window, logits_soft_cap)
    meta = by_window.get(key)
    if meta is None:
        # Tensors are shared: only the window, the cap (and the window's fixed plan)
        # differ, made once per step and (window, cap).
        meta = _STATE.meta
        plans = _STATE.plans
        if plans is not None:
            meta = dataclasses.replace(meta, sliding_window=sliding_window,
                                       logits_soft_cap=logits_soft_cap,
                                       decode_plan=plans.get(sliding_window))
        elif (meta.sliding_window, meta.logits_soft_cap) != key:
            meta = dataclasses.replace(meta, sliding_window=sliding_window,
                                       logits_soft_cap=logits_soft_cap)
        by_window[key] = meta
    return meta


class PagedAttention(nn.Module):
    """Write this step's K/V into the layer's cache slice, then attend over the pages.

    ``scale`` multiplies the query-key dot products (``head_dim ** -0.5`` for most
    models; 1.0 where the model pre-scales its queries, as OPT does; Gemma's
    ``query_pre_attn_scalar ** -0.5``). ``sliding_window``: keys more than ``window - 1``
    positions back are not seen; ``logits_soft_cap``: scaled scores become
    ``cap * tanh(s / cap)`` before the mask and softmax. The layer holds no parameters;
    its cache and backend come from ``bind_kv_cache``.
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 layer_idx: int, sliding_window: int | None = None,
                 logits_soft_cap: float | None = None) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"{num_heads} query heads are not a multiple of "
                             f"{num_kv_heads} KV heads")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.layer_idx = layer_idx
        self.sliding_window = sliding_window
        if logits_soft_cap is not None and not logits_soft_cap > 0:
            raise ValueError(f"logits_soft_cap must be positive, got {logits_soft_cap}")
        self.logits_soft_cap = logits_soft_cap
        self.key_cache: torch.Tensor | None = None
        self.value_cache: torch.Tensor | None = None
        self.backend: AttentionBackend | None = None

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor
                ) -> torch.Tensor:
        """``query`` ``[T, Hq * D]`` (or ``[T, Hq, D]``), ``key``/``value`` ``[T, Hkv * D]``;
        returns ``[T, Hq * D]`` in the query's dtype."""
        backend, key_cache, value_cache = self.backend, self.key_cache, self.value_cache
        if backend is None or key_cache is None or value_cache is None:
            raise RuntimeError(f"attention layer {self.layer_idx} has no KV cache: the "
                               "model runner binds one with bind_kv_cache()")
        meta = current_metadata(self.sliding_window, self.logits_soft_cap)
        num_tokens = query.shape[0]
        q = query.view(num_tokens, self.num_heads, self.head_dim)
        k = key.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = value.view(num_tokens, self.num_kv_heads, self.head_dim)
        backend.write_kv(k, v, key_cache, value_cache, meta.slot_mapping)
        out = backend.forward(q, key_cache, value_cache, meta, self.scale)
        return out.view(num_tokens, self.num_heads * self.head_dim)

    def extra_repr(self) -> str:
        return (f"layer={self.layer_idx}, heads={self.num_heads}, kv_heads={self.num_kv_heads}, "
                f"head_dim={self.head_dim}, window={self.sliding_window}, "
                f"soft_cap={self.logits_soft_cap}")


def attention_layers(model: nn.Module) -> list[PagedAttention]:
    """The model's ``PagedAttention`` layers, in layer order."""
    layers = [m for m in model.modules() if isinstance(m, PagedAttention)]
    return sorted(layers, key=lambda m: m.layer_idx)


def describe_layers(model: nn.Module) -> str:
    """The model's attention layers by (window, soft-cap), for a log line, e.g.
    ``"26 layers: 13 window 4096 soft-cap 50, 13 full soft-cap 50"``."""
    counts: dict[LayerKey, int] = {}
    layers = attention_layers(model)
    for layer in layers:
        key = (layer.sliding_window, layer.logits_soft_cap)
        counts[key] = counts.get(key, 0) + 1
    parts = []
    for (window, cap), n in counts.items():
        text = f"{n} " + (f"window {window}" if window is not None else "full")
        parts.append(text + (f" soft-cap {cap:g}" if cap is not None else ""))
    return f"{len(layers)} layers: " + ", ".join(parts)


def bind_kv_cache(model: nn.Module, kv_cache: KVCache, backend: AttentionBackend) -> None:
    """Point every attention layer of ``model`` at its slice of ``kv_cache`` and at
    ``backend`` (call again after the pool is reallocated)."""
    layers = attention_layers(model)
    if len(layers) != kv_cache.key.shape[0]:
        raise ValueError(f"the model has {len(layers)} attention layers, the KV pool "
                         f"{kv_cache.key.shape[0]}")
    for layer in layers:
        layer.key_cache = kv_cache.key[layer.layer_idx]
        layer.value_cache = kv_cache.value[layer.layer_idx]
        layer.backend = backend


def unbind_kv_cache(model: nn.Module) -> None:
    """Drop every attention layer's references to the pool (so it can be freed)."""
    for layer in attention_layers(model):
        layer.key_cache = layer.value_cache = None
