"""Prefill over a paged, partly cached context: gather the context, then torch SDPA.

A prefill chunk of ``q_len`` tokens at the end of a ``seq_len``-token context attends to
everything before it in the cache plus the causal part of itself: the causal mask is
*bottom-right* aligned (query row ``r`` sees keys ``[0, seq_len - q_len + r]``). Per prefill
sequence (a handful per step) the context's blocks are gathered with one ``index_select``
per K and V, and ``torch.nn.functional.scaled_dot_product_attention`` runs with
``causal_lower_right`` (FlashAttention on CUDA), GQA through ``enable_gqa`` where the
installed torch serves it, else with K/V heads repeated. A sliding window becomes an
explicit boolean mask. SDPA has no soft-cap, so a soft-capped layer (Gemma 2) attends
through an explicit fp32 form instead (scores, ``cap * tanh(s / cap)``, mask, softmax,
values), a bounded number of query rows at a time so its score matrix stays small
(``CAPPED_SCORE_ELEMS``); the choice is logged once. An FP8 cache is gathered as stored
and widened times its scales (``kv_scales``, see :mod:`qworker.attention.fp8`). Runs on
any device torch supports, which lets CPU tests check it against
:mod:`qworker.attention.torch_ref`.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

logger = logging.getLogger(__name__)

_gqa_native: dict[str, bool] = {}
_capped_logged: set[str] = set()

#: Most fp32 score elements (heads x query rows x keys) the soft-capped form holds at once.
CAPPED_SCORE_ELEMS = 1 << 25


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


_fp32_out_bmm: dict[str, bool] = {}


def _bmm32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` (3-d) as fp32. On a GPU with 16-bit operands, the tensor cores' fp32
    accumulator is kept (``out_dtype``, where the installed torch has it); else fp32 math."""
    key = a.device.type
    if a.is_cuda and a.dtype in (torch.float16, torch.bfloat16) and _fp32_out_bmm.get(key, True):
        try:
            return torch.bmm(a, b.to(a.dtype), out_dtype=torch.float32)
        except (RuntimeError, TypeError) as exc:
            _fp32_out_bmm[key] = False
            logger.info("bmm(out_dtype=float32) unavailable on %s (%s); fp32 matmuls", key, exc)
    return torch.bmm(a.float(), b.float())


def _attend_capped(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    sliding_window: int | None,
    soft_cap: float,
) -> torch.Tensor:
    """Soft-capped attention of ``q`` [1, Hq, Lq, D] over ``k``/``v`` [1, Hkv, Lk, D],
    bottom-right causal; ``q``'s dtype out. Scores, cap, mask and softmax are fp32 (the
    contract's precision); with 16-bit operands on a GPU the products run on tensor cores
    with fp32 accumulation and the probabilities meet V in the query dtype, as the
    tensor-core kernels do."""
    _, heads, q_len, dim = q.shape
    kv_heads, k_len = k.shape[1], k.shape[2]
    group = heads // kv_heads
    if q.device.type not in _capped_logged:
        _capped_logged.add(q.device.type)
        logger.info("soft-capped prefill on %s: explicit attention (SDPA has no soft-cap)",
                    q.device.type)
    kt = k[0].transpose(-1, -2)  # [Hkv, D, Lk]
    vv = v[0]  # [Hkv, Lk, D]
    out = torch.empty((heads, q_len, dim), dtype=q.dtype, device=q.device)
    rows = max(1, CAPPED_SCORE_ELEMS // max(1, heads * k_len))
    k_pos = torch.arange(k_len, device=q.device).unsqueeze(0)
    for r0 in range(0, q_len, rows):
        r1 = min(q_len, r0 + rows)
        n = r1 - r0
        qs = q[0, :, r0:r1].reshape(kv_heads, group * n, dim)  # GQA: a group shares K/V
        scores = (_bmm32(qs, kt) * scale).view(kv_heads, group, n, k_len)
        scores = torch.tanh(scores / soft_cap) * soft_cap
        q_pos = torch.arange(k_len - q_len + r0, k_len - q_len + r1, device=q.device)
        q_pos = q_pos.unsqueeze(1)
        mask = k_pos > q_pos
        if sliding_window is not None:
            mask |= k_pos <= q_pos - sliding_window
        scores.masked_fill_(mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1).view(kv_heads, group * n, k_len)
        if q.is_cuda and q.dtype != torch.float32:
            probs = probs.to(q.dtype)
        out[:, r0:r1] = _bmm32(probs, vv).view(heads, n, dim).to(q.dtype)
    return out.unsqueeze(0)


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
    soft_cap: float | None = None,
) -> None:
    """Attend the query rows of sequences ``first_seq..`` (host lists ``query_starts``, one
    longer than ``seq_lens``) over their cached context, writing into ``out``.

    ``query``/``out`` are ``[num_tokens, Hq, D]``; the caches one layer's
    ``[num_blocks, Hkv, block_size, D]``, already holding this step's K/V; ``kv_scales``
    the layer's ``{k_scale, v_scale}`` when they hold FP8; ``soft_cap`` the layer's
    logit soft-cap (None: none).
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
        if soft_cap is not None:
            o = _attend_capped(q, k, v, scale, sliding_window, soft_cap)
        else:
            o = _attend(q, k, v, scale, sliding_window)
        out[q0:q1] = o[0].transpose(0, 1).to(out.dtype)
