"""Sharding plans: what each rank holds, the one-line errors for splits that are not
even, and a whole sharded forward (ranks as threads summing through a shared reducer)
against the unsharded model, for every architecture with a plan."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from qworker.attention.cpu_backend import CpuAttentionBackend
from qworker.engine.model_runner import ModelRunner
from qworker.engine.step_inputs import StepInput
from qworker.models.loader import check_tensor_parallel, load_model
from qworker.models.moe import FusedExperts
from qworker.models.parallel_layers import ShardInfo, even_range
from qworker.models.tp_plan import TensorParallelConfigError
from tests.engine.reference import random_prompts
from tests.fixtures.models import make_tiny_model_dir


class ThreadReducer:
    """Ranks as threads of one process: ``all_reduce`` sums every rank's tensor in rank
    order (so every rank gets the same bits, as gloo and NCCL give them)."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.slots: list[torch.Tensor | None] = [None] * world
        self.barrier = threading.Barrier(world, timeout=60)

    def rank(self, rank: int) -> ShardInfo:
        reducer = self

        class _One:
            def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
                reducer.slots[rank] = tensor.clone()
                reducer.barrier.wait()
                total = sum(reducer.slots[1:], reducer.slots[0].clone())  # type: ignore[union-attr]
                reducer.barrier.wait()
                return tensor.copy_(total)

        return ShardInfo(rank, self.world, _One())


def _runner(path: Path, shard: ShardInfo | None) -> ModelRunner:
    loaded = load_model(path, torch.float32, "cpu", shard=shard)
    return ModelRunner(loaded.model, loaded.spec, torch.device("cpu"), 16, 32,
                       CpuAttentionBackend(), max_model_len=256)


def _prefill(prompts: list[list[int]]) -> StepInput:
    tables, start = [], 0
    for p in prompts:
        n = -(-len(p) // 16)
        tables.append(list(range(start, start + n)))
        start += n
    return StepInput(prompts, [0] * len(prompts), tables, [1] * len(prompts))


def _sharded_logits(path: Path, world: int, step: StepInput) -> tuple[torch.Tensor, list[int]]:
    reducer = ThreadReducer(world)
    runners = [_runner(path, reducer.rank(r)) for r in range(world)]
    outs: list[torch.Tensor | None] = [None] * world
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            outs[rank] = runners[rank].execute(step)
        except BaseException as exc:  # surfaced below
            errors.append(exc)
            reducer.barrier.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    vocab = runners[0].spec.vocab_size
    sizes = [sum(p.numel() * p.element_size() for p in r.model.parameters()) for r in runners]
    return torch.cat(outs, dim=1)[:, :vocab], sizes  # type: ignore[arg-type]


@pytest.mark.parametrize(("arch", "overrides", "world"), [
    pytest.param("llama", {}, 2, id="llama-gqa-4:2"),
    pytest.param("llama", {"num_key_value_heads": 1}, 2, id="llama-mqa-replicated"),
    pytest.param("llama", {"vocab_size": 509}, 2, id="llama-odd-vocab"),
    pytest.param("llama", {"num_key_value_heads": 2}, 4, id="llama-4-ranks-kv-replicated"),
    pytest.param("qwen2", {}, 2, id="qwen2-tied-bias"),
    pytest.param("qwen3", {}, 2, id="qwen3-qk-norm"),
    pytest.param("opt", {}, 2, id="opt"),
    pytest.param("gemma2", {}, 2, id="gemma2-softcaps-tied"),
    pytest.param("gemma3", {}, 2, id="gemma3-mqa-per-type-rope"),
    pytest.param("phi3", {}, 2, id="phi3-longrope-fused-checkpoint"),
    pytest.param("mixtral", {}, 2, id="mixtral-8-experts-top-2"),
    pytest.param("qwen2_moe", {}, 2, id="qwen2-moe-shared-expert"),
    pytest.param("qwen3_moe", {"mlp_only_layers": [1]}, 2, id="qwen3-moe-16-top-4-dense-layer"),
    pytest.param("qwen3_moe", {}, 4, id="qwen3-moe-4-ranks"),
])
def test_sharded_forward_matches_the_whole_model(
        tmp_path: Path, arch: str, overrides: dict[str, int], world: int) -> None:
    path = make_tiny_model_dir(arch, tmp_path / arch, seed=7, **overrides)
    prompts = random_prompts(3, 5, 30, vocab=overrides.get("vocab_size", 512), seed=4)
    step = _prefill(prompts)
    whole = _runner(path, None)
    expected = whole.execute(step)
    got, sizes = _sharded_logits(path, world, step)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    assert torch.equal(got.argmax(-1), expected.argmax(-1))
    total = sum(p.numel() * p.element_size() for p in whole.model.parameters())
    for size in sizes:  # norms (and KV heads shared by several ranks) are replicated
        assert total / world <= size < 1.35 * total / world


def test_each_rank_holds_its_heads_and_the_pool_is_sized_for_them(tmp_path: Path) -> None:
    path = make_tiny_model_dir("llama", tmp_path / "m", num_key_value_heads=1)
    loaded = load_model(path, torch.float32, "cpu", shard=ShardInfo(1, 2))
    attn = loaded.model.model.layers[0].self_attn
    assert (loaded.spec.num_q_heads, loaded.spec.num_kv_heads) == (2, 1)
    assert (attn.num_heads, attn.num_kv_heads, attn.attn.num_heads) == (2, 1, 2)
    assert attn.qkv_proj.split_sizes == [32, 16, 16]
    assert tuple(loaded.model.model.embed_tokens.weight.shape) == (256, 64)


@pytest.mark.parametrize(("overrides", "world", "message"), [
    ({}, 3, "tensor_parallel_size=3 must divide num_attention_heads=4"),
    ({"hidden_size": 96, "num_attention_heads": 12, "num_key_value_heads": 6, "head_dim": 8},
     4,
     "must divide num_key_value_heads=6 or be a multiple of it"),
    ({"intermediate_size": 130}, 4, "must divide intermediate_size=130"),
    pytest.param({"arch": "mixtral", "intermediate_size": 66}, 4,
                 "must divide intermediate_size=66", id="mixtral-experts"),
    pytest.param({"arch": "qwen2_moe", "moe_intermediate_size": 34}, 4,
                 "must divide moe_intermediate_size=34", id="qwen2-moe-experts"),
    pytest.param({"arch": "qwen2_moe", "shared_expert_intermediate_size": 66}, 4,
                 "must divide shared_expert_intermediate_size=66", id="qwen2-moe-shared"),
    pytest.param({"arch": "gemma2", "intermediate_size": 130}, 4,
                 "must divide intermediate_size=130", id="gemma2"),
])
def test_a_split_that_is_not_even_is_a_one_line_error_naming_the_field(
        tmp_path: Path, overrides: dict[str, Any], world: int, message: str) -> None:
    overrides = dict(overrides)
    path = make_tiny_model_dir(overrides.pop("arch", "llama"), tmp_path / "m", **overrides)
    with pytest.raises(TensorParallelConfigError, match=message) as info:
        check_tensor_parallel(path, world)
    assert "\n" not in str(info.value)


def test_check_passes_for_a_model_that_splits(tmp_path: Path) -> None:
    path = make_tiny_model_dir("opt", tmp_path / "m")
    assert check_tensor_parallel(path, 4) == path


def test_fused_expert_tensors_load_each_ranks_intermediate_slice() -> None:
    # transformers 5's fused layout: gate_up_proj [E, 2I, H] (gate rows, then up rows),
    # down_proj [E, H, I]; rank 1 of 2 holds rows/columns 3..6 of I = 6 in both.
    gen = torch.Generator().manual_seed(0)
    gate_up, down = torch.randn(3, 12, 5, generator=gen), torch.randn(3, 5, 6, generator=gen)
    sliced = FusedExperts(3, 5, 3, torch.nn.functional.silu, inter_range=even_range(6, 1, 2))
    for part, tensor in (("gate_up_proj", gate_up), ("down_proj", down)):
        sliced.load(part, sliced.checkpoint_slice(part, tensor, True))
    assert torch.equal(sliced.gate_up_proj.data,
                       torch.cat([gate_up[:, 3:6], gate_up[:, 9:12]], dim=1))
    assert torch.equal(sliced.down_proj.data, down[:, :, 3:6])
    per_expert = sliced.checkpoint_slice("up", gate_up[0, 6:12], False)
    assert torch.equal(per_expert, gate_up[0, 9:12])
    with pytest.raises(ValueError, match="intermediate size"):
        sliced.checkpoint_slice("down", torch.zeros(5, 8), False)
