"""Prefill over a paged, partly cached context: gather the context, then torch SDPA.

A prefill chunk of ``q_len`` tokens at the end of a ``seq_len``-token context attends to
everything before it in the cache plus the causal part of itself: the causal mask is
*bottom-right* aligned (query row ``r`` sees keys ``[0, seq_len - q_len + r]``). Per prefill
sequence (a handful per step) the context's blocks are gathered with one ``index_select``
per K and V, and ``torch.nn.functional.scaled_dot_product_attention`` runs with
``causal_lower_right`` (FlashAttention on CUDA), GQA through ``enable_gqa`` where the
installed torch serves it, else with K/V heads repeated. A sliding window becomes an
explicit boolean mask. An FP8 cache is gathered as stored and widened times its scales
(``kv_scales``, see :mod:`qworker.attention.fp8`). Runs on any device torch supports, which
lets CPU tests check it against :mod:`qworker.attention.torch_ref`.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

logger = logging.getLogger(__name__)

_gqa_native: dict[str, bool] = {}


def gather_context(cache: torch.Tensor, table_row: torch.Tensor, ctx_len: int) -> torch.Tensor:
    """The first ``ctx_len`` tokens of one sequence from one layer's cache
    ``[num_blocks, heads, block_size, D]``, as ``[heads, ctx_len, D]`` (a new tensor)."""
    block_size = cache.shape[2]
    num_blocks = (ctx_len + block_size - 1) // block_size
    blocks = cache.index_select(0, table_row[:num_blocks].long())  # [nb, H, B, D]
    heads, dim = cache.shape[1], cache.shape[3]
    return blocks.transpose(0, 1).reshape(heads, num_blocks * block_size, dim)[:, :ctx_len]


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor:
    """SDPA of ``q`` [1, Hq, Lq, D] over ``k``/``v`` [1, Hkv, Lk, D], bottom-right causal."""
    q_len, k_len = q.shape[2], k.shape[2]
    group = q.shape[1] // k.shape[1]
    mask: torch.Tensor | object | None = None
    is_causal = False
    if sliding_window is not None:
        q_pos = torch.arange(k_len - q_len, k_len, device=q.device).unsqueeze(1)
        k_pos = torch.arange(k_len, device=q.device).unsqueeze(0)
        mask = (k_pos <= q_pos) & (k_pos > q_pos - sliding_window)
    elif q_len == k_len:
        is_causal = True
    else:
        mask = causal_lower_right(q_len, k_len)
    if group > 1:
        key = q.device.type
        if _gqa_native.get(key, True):
            try:
                return F.scaled_dot_product_attention(
                    q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale, enable_gqa=True
                )
            except (RuntimeError, TypeError) as exc:
                _gqa_native[key] = False
                logger.info("SDPA enable_gqa unavailable on %s (%s); repeating K/V heads", key, exc)
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale)


def sdpa_prefill(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_starts: list[int],
    seq_lens: list[int],
    first_seq: int,
    scale: float,
    out: torch.Tensor,
    sliding_window: int | None = None,
    kv_scales: torch.Tensor | None = None,
) -> None:
    """Attend the query rows of sequences ``first_seq..`` (host lists ``query_starts``, one
    longer than ``seq_lens``) over their cached context, writing into ``out``.

    ``query``/``out`` are ``[num_tokens, Hq, D]``; the caches one layer's
    ``[num_blocks, Hkv, block_size, D]``, already holding this step's K/V; ``kv_scales``
    the layer's ``{k_scale, v_scale}`` when they hold FP8.
    """
    for s in range(first_seq, len(seq_lens)):
        q0, q1 = query_starts[s], query_starts[s + 1]
        if q1 == q0:
            continue
        ctx = seq_lens[s]
        k = gather_context(key_cache, block_tables[s], ctx).unsqueeze(0)
        v = gather_context(value_cache, block_tables[s], ctx).unsqueeze(0)
        q = query[q0:q1].transpose(0, 1).unsqueeze(0)  # [1, Hq, Lq, D]
        if kv_scales is not None:
            k = (k.float() * kv_scales[0]).to(q.dtype)
            v = (v.float() * kv_scales[1]).to(q.dtype)
        elif k.dtype != q.dtype:
            k, v = k.to(q.dtype), v.to(q.dtype)
        o = _attend(q, k, v, scale, sliding_window)
        out[q0:q1] = o[0].transpose(0, 1).to(out.dtype)
