"""Turn one step's logits into next tokens, one row per sampling sequence.

Order of processing, as in ``transformers``: repetition penalty (over prompt and
generated ids), then greedy argmax, or temperature, top-k, top-p, min-p and a draw.
A draw is ``argmax(probs / q)`` with ``q ~ Exp(1)`` (an exact categorical sample);
for a seeded request ``q`` comes from a generator seeded by (seed, completion index,
index of the token being generated), so the draw does not depend on which other rows
share the batch, nor on preemption. Unseeded rows draw from torch's global RNG.

Log-probabilities are those of the model's raw distribution (``log_softmax`` of the
unprocessed logits, vLLM's default); they are computed only for rows that ask.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qworker.engine.sequence import Sequence

_SEED_MASK = (1 << 63) - 1


@dataclass(slots=True)
class SamplerOutput:
    """Chosen token per row; for rows that asked, its raw logprob and the top-k dict."""

    token_ids: list[int]
    logprobs: list[float | None]
    top_logprobs: list[dict[int, float] | None]


def row_seed(seed: int, index: int, position: int) -> int:
    """The generator seed of one draw: completion ``index``'s ``position``-th output token."""
    return hash((seed, index, position)) & _SEED_MASK


class Sampler:
    """Stateless sampler; ``sample`` handles any mix of per-row settings."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)

    def sample(
        self,
        logits: torch.Tensor,
        seqs: list[Sequence],
        output_positions: list[int] | None = None,
    ) -> SamplerOutput:
        """Choose a token for each row of fp32 ``logits`` ``[len(seqs), vocab]``.

        ``output_positions[i]`` is the index of the token being generated for row ``i``
        (default: the sequence's current number of output tokens).
        """
        num_rows = len(seqs)
        params = [s.request.params for s in seqs]
        if output_positions is None:
            output_positions = [s.num_output_tokens for s in seqs]
        lp_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        raw_lp = torch.log_softmax(logits[lp_rows], dim=-1) if lp_rows else None

        penalized = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]
        if penalized:
            logits = logits.clone()
            for i in penalized:
                ids = torch.tensor(seqs[i].token_ids, dtype=torch.long, device=logits.device)
                score = logits[i].gather(0, ids)
                pen = params[i].repetition_penalty
                score = torch.where(score < 0, score * pen, score / pen)
                logits[i].scatter_(0, ids, score)

        random_rows = [i for i, p in enumerate(params) if not p.greedy]
        tokens = logits.argmax(dim=-1)
        if random_rows:
            drawn = self._draw(
                logits[random_rows],
                [seqs[i] for i in random_rows],
                [output_positions[i] for i in random_rows],
            )
            tokens[random_rows] = drawn
        token_list = tokens.tolist()

        chosen_lp: list[float | None] = [None] * num_rows
        tops: list[dict[int, float] | None] = [None] * num_rows
        if raw_lp is not None:
            chosen = raw_lp.gather(1, tokens[lp_rows].unsqueeze(1)).squeeze(1).tolist()
            max_k = max(params[i].logprobs or 0 for i in lp_rows)
            top_vals = top_ids = None
            if max_k:
                top_vals, top_ids = raw_lp.topk(max_k, dim=-1)
                top_vals, top_ids = top_vals.tolist(), top_ids.tolist()
            for j, i in enumerate(lp_rows):
                k = params[i].logprobs or 0
                d = {}
                if k and top_ids is not None and top_vals is not None:
                    d = dict(zip(top_ids[j][:k], top_vals[j][:k], strict=True))
                d[token_list[i]] = chosen[j]
                chosen_lp[i] = chosen[j]
                tops[i] = d
        return SamplerOutput(token_ids=token_list, logprobs=chosen_lp, top_logprobs=tops)

    def _draw(
        self, logits: torch.Tensor, seqs: list[Sequence], positions: list[int]
    ) -> torch.Tensor:
        params = [s.request.params for s in seqs]
        dev = logits.device
        temps = torch.tensor([p.temperature for p in params], dtype=logits.dtype, device=dev)
        logits = logits / temps.unsqueeze(1)
        vocab = logits.shape[-1]
        top_ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
        top_ps = [p.top_p for p in params]
        if any(k < vocab for k in top_ks) or any(p < 1.0 for p in top_ps):
            sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
            ranks = torch.arange(vocab, device=dev).unsqueeze(0)
            k_t = torch.tensor(top_ks, device=dev).unsqueeze(1)
            cut = ranks >= k_t
            sorted_logits = sorted_logits.masked_fill(cut, float("-inf"))
            p_t = torch.tensor(top_ps, dtype=logits.dtype, device=dev).unsqueeze(1)
            probs_sorted = sorted_logits.softmax(dim=-1)
            # keep the smallest prefix whose mass reaches top_p (always the first token)
            before = probs_sorted.cumsum(dim=-1) - probs_sorted
            sorted_logits = sorted_logits.masked_fill(before >= p_t, float("-inf"))
            logits = torch.full_like(logits, float("-inf")).scatter(1, sorted_idx, sorted_logits)
        probs = logits.softmax(dim=-1)
        min_ps = [p.min_p for p in params]
        if any(m > 0 for m in min_ps):
            m_t = torch.tensor(min_ps, dtype=probs.dtype, device=dev).unsqueeze(1)
            probs = probs.masked_fill(probs < probs.max(dim=-1, keepdim=True).values * m_t, 0.0)
        q = torch.empty_like(probs)
        unseeded = [j for j, p in enumerate(params) if p.seed is None]
        if unseeded:
            q[unseeded] = torch.empty(len(unseeded), vocab, device=dev).exponential_()
        for j, (seq, p) in enumerate(zip(seqs, params, strict=True)):
            if p.seed is not None:
                gen = torch.Generator(device=dev)
                gen.manual_seed(row_seed(p.seed, seq.index, positions[j]))
                q[j].exponential_(generator=gen)
        return (probs / q).argmax(dim=-1)
