"""Drive a ``CausalLM`` through the paged path without the engine (test helper).

``PagedRunner`` owns a small KV pool, hands each sequence blocks in allocation order
(so several sequences interleave their blocks), builds the step's ``AttentionMetadata``
and returns the logits of every token it ran.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from qworker.attention.backend import AttentionBackend, AttentionMetadata, KVCache
from qworker.attention.paged_attention import bind_kv_cache, forward_context
from qworker.attention.torch_ref import TorchAttentionBackend
from qworker.models.base import CausalLM


class PagedRunner:
    """A minimal model runner: per-sequence block tables over one preallocated pool."""

    def __init__(
        self,
        model: CausalLM,
        block_size: int = 16,
        num_blocks: int = 64,
        sliding_window: int | None = None,
        backend: AttentionBackend | None = None,
    ) -> None:
        spec = model.spec
        param = next(model.parameters())
        self.model = model
        self.block_size = block_size
        self.device = param.device
        self.sliding_window = sliding_window
        self.kv = KVCache.allocate(
            spec.num_layers,
            num_blocks,
            spec.num_kv_heads,
            block_size,
            spec.head_dim,
            param.dtype,
            self.device,
        )
        self.backend = backend or TorchAttentionBackend()
        bind_kv_cache(model, self.kv, self.backend)
        self.next_block = 0
        self.tables: dict[int, list[int]] = {}
        self.lens: dict[int, int] = {}

    def _slot(self, seq: int, pos: int) -> int:
        table = self.tables.setdefault(seq, [])
        while len(table) <= pos // self.block_size:
            table.append(self.next_block)
            self.next_block += 1
        return table[pos // self.block_size] * self.block_size + pos % self.block_size

    @torch.inference_mode()
    def step(self, chunks: dict[int, list[int]]) -> dict[int, torch.Tensor]:
        """Run one step over ``{seq_id: new tokens}``; return ``{seq_id: fp32 logits [n, vocab]}``.

        Sequences with one new token are placed first (decodes), as the contract asks.
        """
        order = sorted(chunks, key=lambda s: len(chunks[s]) != 1)
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        starts = [0]
        seq_lens: list[int] = []
        for seq in order:
            start = self.lens.get(seq, 0)
            toks = chunks[seq]
            for i, tok in enumerate(toks):
                ids.append(tok)
                positions.append(start + i)
                slots.append(self._slot(seq, start + i))
            self.lens[seq] = start + len(toks)
            starts.append(len(ids))
            seq_lens.append(self.lens[seq])
        width = max(len(self.tables[s]) for s in order)
        tables = [self.tables[s] + [0] * (width - len(self.tables[s])) for s in order]
        dev = self.device
        meta = AttentionMetadata(
            num_seqs=len(order),
            num_tokens=len(ids),
            num_decodes=sum(1 for s in order if len(chunks[s]) == 1),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=torch.tensor(tables, dtype=torch.int32, device=dev),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            max_query_len=max(len(chunks[s]) for s in order),
            max_seq_len=max(seq_lens),
            sliding_window=self.sliding_window,
        )
        with forward_context(meta):
            hidden = self.model(
                torch.tensor(ids, dtype=torch.int64, device=dev),
                torch.tensor(positions, dtype=torch.int64, device=dev),
            )
        logits = self.model.compute_logits(hidden)
        return {seq: logits[starts[i] : starts[i + 1]] for i, seq in enumerate(order)}


def hf_reference(model_dir: Path, gguf_file: str | None = None) -> Any:
    """The transformers model for ``model_dir`` in fp32 (see ``load_hf_reference``)."""
    from tests.fixtures.models import load_hf_reference

    return load_hf_reference(model_dir, gguf_file)


def paged_vs_hf_max_diff(
    model: CausalLM,
    hf_model: Any,
    prompts: list[list[int]],
    *,
    block_size: int = 8,
    decode_steps: int = 4,
    prefill_chunk: int | None = None,
    sliding_window: int | None = None,
    backend: AttentionBackend | None = None,
) -> float:
    """Prefill ``prompts`` together (in chunks of ``prefill_chunk`` tokens if given), then
    decode ``decode_steps`` greedy tokens for all of them in batched steps; return the
    largest absolute difference between the paged logits and transformers' logits of
    each full sequence run in one forward.
    """
    runner = PagedRunner(
        model, block_size=block_size, num_blocks=256, sliding_window=sliding_window,
        backend=backend,
    )
    seqs = {i: list(p) for i, p in enumerate(prompts)}
    logits: dict[int, list[torch.Tensor]] = {i: [] for i in seqs}
    chunk = prefill_chunk or max(len(p) for p in prompts)
    done = dict.fromkeys(seqs, 0)
    while any(done[i] < len(prompts[i]) for i in seqs):
        step = {i: prompts[i][done[i] : done[i] + chunk] for i in seqs if done[i] < len(prompts[i])}
        for i, out in runner.step(step).items():
            logits[i].append(out)
            done[i] += len(step[i])
    for _ in range(decode_steps):
        step = {i: [int(logits[i][-1][-1].argmax())] for i in seqs}
        for i, tok in step.items():
            seqs[i] += tok
        for i, out in runner.step(step).items():
            logits[i].append(out)
    worst = 0.0
    with torch.inference_mode():
        for i, seq in seqs.items():
            ours = torch.cat(logits[i])
            ref = hf_model(torch.tensor([seq])).logits[0].float()
            worst = max(worst, float((ours - ref).abs().max()))
    return worst


def random_prompts(lengths: list[int], vocab: int, seed: int = 0) -> list[list[int]]:
    """Seeded random token-id prompts of the given lengths (ids 3.. to avoid bos/eos/pad)."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]
