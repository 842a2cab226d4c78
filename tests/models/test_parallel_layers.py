"""Sharded layers against the whole layer: every rank's slice, combined by hand, gives
the plain torch result (column: side by side; row, embedding: summed), and a rank reads
only its rows or columns of a safetensors checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from qworker.models.checkpoint_tensor import CheckpointTensor
from qworker.models.parallel_layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    ShardInfo,
    VocabParallelEmbedding,
    even_range,
    kv_head_range,
    padded_range,
)


def _no_reduce(rank: int, world: int) -> ShardInfo:
    return ShardInfo(rank, world)  # partial sums come back unreduced: summed below


def test_ranges_split_evenly_pad_the_vocabulary_and_replicate_scarce_kv_heads() -> None:
    assert [(r.start, r.stop) for r in (even_range(8, i, 4) for i in range(4))] == [
        (0, 2), (2, 4), (4, 6), (6, 8)]
    vocab = [padded_range(509, i, 2) for i in range(2)]
    assert [(r.start, r.stop, r.size) for r in vocab] == [(0, 255, 255), (255, 509, 255)]
    # 2 KV heads of 16 over 4 ranks: ranks 0-1 read head 0, ranks 2-3 head 1.
    assert [(r.start, r.stop) for r in (kv_head_range(2, 16, i, 4) for i in range(4))] == [
        (0, 16), (0, 16), (16, 32), (16, 32)]
    # 4 KV heads over 2 ranks: two heads each.
    assert [(r.start, r.stop) for r in (kv_head_range(4, 16, i, 2) for i in range(2))] == [
        (0, 32), (32, 64)]
    with pytest.raises(ValueError, match="do not split"):
        even_range(6, 0, 4)


@pytest.mark.parametrize("world", [2, 4])
def test_column_parallel_qkv_shards_side_by_side_are_the_whole_projection(world: int) -> None:
    torch.manual_seed(0)
    heads, kv_heads, dim, hidden = 8, 2, 4, 24
    w = {"q": torch.randn(heads * dim, hidden), "k": torch.randn(kv_heads * dim, hidden),
         "v": torch.randn(kv_heads * dim, hidden)}
    b = {name: torch.randn(t.shape[0]) for name, t in w.items()}
    x = torch.randn(5, hidden)
    full = {name: F.linear(x, w[name], b[name]) for name in w}
    for rank in range(world):
        kv = kv_head_range(kv_heads, dim, rank, world)
        layer = ColumnParallelLinear(
            hidden, {"q": even_range(heads * dim, rank, world), "k": kv, "v": kv}, bias=True)
        for name in w:
            layer.load_checkpoint(name, "weight", w[name])
            layer.load_checkpoint(name, "bias", b[name])
        q, k, v = layer(x).split(layer.split_sizes, dim=-1)
        q_rows = even_range(heads * dim, rank, world)
        # The same dot products; a GEMM of another shape may round them differently.
        torch.testing.assert_close(q, full["q"][:, q_rows.start : q_rows.stop])
        torch.testing.assert_close(k, full["k"][:, kv.start : kv.stop])
        torch.testing.assert_close(v, full["v"][:, kv.start : kv.stop])


def test_fused_checkpoint_parts_are_read_from_one_tensor() -> None:
    """Phi-3 style: q, k and v stored in one checkpoint tensor, part after part."""
    torch.manual_seed(1)
    hidden, q_rows, kv_rows = 8, 8, 4
    fused = torch.randn(q_rows + 2 * kv_rows, hidden)
    q, k, v = fused.split([q_rows, kv_rows, kv_rows])
    layer = ColumnParallelLinear(
        hidden, {"q": even_range(q_rows, 1, 2), "k": even_range(kv_rows, 1, 2),
                 "v": even_range(kv_rows, 1, 2)}, bias=False, fused_checkpoint=True)
    layer.load_checkpoint(None, "weight", fused)
    assert torch.equal(layer.weight, torch.cat([q[4:], k[2:], v[2:]]))


@pytest.mark.parametrize("world", [2, 4])
def test_row_parallel_partials_sum_to_the_whole_projection(world: int) -> None:
    torch.manual_seed(2)
    w, b, x = torch.randn(6, 16), torch.randn(6), torch.randn(3, 16)
    total = torch.zeros(3, 6)
    for rank in range(world):
        cols = even_range(16, rank, world)
        layer = RowParallelLinear(cols, 6, bias=True, shard=_no_reduce(rank, world))
        layer.load_checkpoint(None, "weight", w)
        layer.load_checkpoint(None, "bias", b)
        total += layer(x[:, cols.start : cols.stop]) - b  # each rank adds the bias once
    torch.testing.assert_close(total + b, F.linear(x, w, b))


def test_vocab_parallel_embedding_and_head_cover_an_uneven_vocabulary() -> None:
    torch.manual_seed(3)
    vocab, dim, world = 11, 5, 3
    table = torch.randn(vocab, dim)
    ids = torch.tensor([0, 3, 4, 7, 8, 10, 10, 1])
    hidden = torch.randn(4, dim)
    summed = torch.zeros(len(ids), dim)
    logits = []
    for rank in range(world):
        rows = padded_range(vocab, rank, world)
        emb = VocabParallelEmbedding(rows, dim, _no_reduce(rank, 1))
        emb.shard = ShardInfo(rank, world)  # lookups masked as with 3 ranks, unreduced
        emb.load_checkpoint(None, "weight", table)
        summed += emb(ids)
        head = ColumnParallelLinear(dim, {"": rows}, bias=False)
        head.load_checkpoint(None, "weight", table)
        logits.append(F.linear(hidden, head.weight))
        assert rows.size == 4 and torch.count_nonzero(head.weight[rows.count :]) == 0
    assert torch.equal(summed, F.embedding(ids, table))
    torch.testing.assert_close(torch.cat(logits, dim=1)[:, :vocab], F.linear(hidden, table))


def test_checkpoint_shapes_that_do_not_fit_are_refused_naming_the_part() -> None:
    layer = ColumnParallelLinear(4, {"gate": even_range(8, 0, 2), "up": even_range(8, 0, 2)},
                                 bias=False)
    with pytest.raises(ValueError, match=r"gate\.weight"):
        layer.load_checkpoint("gate", "weight", torch.zeros(6, 4))
    with pytest.raises(KeyError, match="separately"):
        layer.load_checkpoint(None, "weight", torch.zeros(16, 4))
    with pytest.raises(KeyError, match="no bias"):
        layer.load_checkpoint("up", "bias", torch.zeros(8))


def test_a_rank_reads_only_its_slice_of_a_safetensors_tensor(tmp_path: Path) -> None:
    from safetensors import safe_open
    from safetensors.torch import save_file

    w = torch.arange(48, dtype=torch.float32).reshape(6, 8)
    save_file({"w": w}, str(tmp_path / "m.safetensors"))
    with safe_open(str(tmp_path / "m.safetensors"), framework="pt", device="cpu") as handle:
        lazy = CheckpointTensor(handle, "w")
        assert lazy.shape == (6, 8)
        row = RowParallelLinear(even_range(8, 1, 2), 6, bias=False, shard=_no_reduce(1, 2))
        row.load_checkpoint(None, "weight", lazy)
        col = ColumnParallelLinear(8, {"": even_range(6, 0, 2)}, bias=False)
        col.load_checkpoint(None, "weight", lazy)
        assert torch.equal(lazy.read(), w)
    assert torch.equal(row.weight, w[:, 4:])
    assert torch.equal(col.weight, w[:3])
