"""Sharding plans: what each rank holds, the one-line errors for splits that are not
even, and a whole sharded forward (ranks as threads summing through a shared reducer)
against the unsharded model, for every architecture with a plan."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from qworker.attention.cpu_backend import CpuAttentionBackend
from qworker.engine.model_runner import ModelRunner
from qworker.engine.step_inputs import StepInput
from qworker.models.checkpoint_tensor import read_cols, read_rows
from qworker.models.loader import (
    _build,
    _iter_safetensors,
    _parse_config,
    _safetensors_files,
    check_tensor_parallel,
    load_model,
)
from qworker.models.moe import FusedExperts
from qworker.models.parallel_layers import ShardInfo, even_range
from qworker.models.quant import plan_quantization, weight_bytes
from qworker.models.quant.fp8 import dequantize_weight, quantize_weight_per_channel
from qworker.models.quant.fp8_experts import Fp8FusedExperts
from qworker.models.quant.fp8_linear import Fp8FusedLinear
from qworker.models.quant.fp8_mm import MatmulKind
from qworker.models.quant.fp8_parallel import DequantizedSlices
from qworker.models.quant.scheme import WeightScales
from qworker.models.registry import resolve_architecture
from qworker.models.tp_plan import TensorParallelConfigError
from tests.engine.reference import random_prompts
from tests.fixtures.models import make_tiny_model_dir
from tests.models.quant.checkpoints import (
    block_quantize,
    write_block_fp8,
    write_compressed_tensors,
)


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


# ---- FP8 weights split over the ranks ------------------------------------------------

#: A Llama whose every rank boundary is a whole 128 x 128 block under 2 ranks (q 256,
#: k/v 128 and gate/up 128 rows a rank; o_proj 256 and down_proj 128 columns a rank).
_BLOCK_LLAMA = {"hidden_size": 256, "intermediate_size": 256, "num_attention_heads": 4,
                "num_key_value_heads": 2, "head_dim": 128}


def _fp8_runner(path: Path, shard: ShardInfo | None, gpu_layout: bool,
                quantization: str = "auto", lazy: bool = True) -> ModelRunner:
    """A runner over the FP8 model at ``path``; ``gpu_layout``: the GPU's FP8 layers and
    experts built on the CPU, their kernels replaced by the fp32 reference of what they
    compute (as ``tests/models/quant/test_fp8_linear.py`` does); ``lazy=False``: every
    tensor arrives read whole, as GGUF's do."""
    if not gpu_layout:
        loaded = load_model(path, torch.float32, "cpu", shard=shard, quantization=quantization)
        model, spec = loaded.model, loaded.spec
    else:
        raw = json.loads((path / "config.json").read_text())
        files = _safetensors_files(path)
        quant = plan_quantization(raw, quantization, torch.float32, torch.device("cpu"), files)
        assert quant is not None
        quant.keep_fp8, quant.fp8_experts = True, True
        model = _build(resolve_architecture(raw), _parse_config(path, raw), torch.float32,
                       torch.device("cpu"), quant, shard)
        model.load_weights(quant.adapt(_iter_safetensors(files,
                                                          lazy=lazy and shard is not None)))
        kind = (MatmulKind.BLOCKWISE if quant.scheme.weights is WeightScales.BLOCK
                else MatmulKind.ROWWISE)
        for m in model.modules():
            if isinstance(m, Fp8FusedLinear):
                m.kind, m.use_reference = kind, True
            if isinstance(m, Fp8FusedExperts):
                m.use_reference = True
        model.eval()
        spec = model.spec
        assert any(isinstance(m, Fp8FusedLinear) for m in model.modules())
    return ModelRunner(model, spec, torch.device("cpu"), 16, 32, CpuAttentionBackend(),
                       max_model_len=256)


def _fp8_sharded(path: Path, world: int, step: StepInput, **kwargs: Any
                 ) -> tuple[torch.Tensor, list[ModelRunner]]:
    reducer = ThreadReducer(world)
    runners = [_fp8_runner(path, reducer.rank(r), **kwargs) for r in range(world)]
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
    return torch.cat(outs, dim=1)[:, :vocab], runners  # type: ignore[arg-type]


def _bytes(runner: ModelRunner) -> int:
    return weight_bytes(runner.model)


@pytest.fixture(scope="module")
def fp8_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A dense Llama and its compressed-tensors FP8 (per-channel FP8_DYNAMIC, and static
    per-tensor FP8); a Qwen3-MoE with FP8 experts in 16 x 16 blocks; a dense
    Llama of whole 128-blocks and its block-FP8 checkpoint; a dense Qwen3-MoE."""
    root = tmp_path_factory.mktemp("tp_fp8")
    dense = make_tiny_model_dir("llama", root / "dense", seed=41, attention_bias=True)
    block_dense = make_tiny_model_dir("llama", root / "block_dense", seed=43, **_BLOCK_LLAMA)
    return {
        "dense": dense,
        "channel": write_compressed_tensors(dense, root / "channel", "FP8_DYNAMIC"),
        "static": write_compressed_tensors(dense, root / "static", "FP8",
                                           calibration=random_prompts(3, 5, 30, seed=9)),
        "block": write_block_fp8(block_dense, root / "block", (128, 128)),
        "block_dense": block_dense,
        "moe": make_tiny_model_dir("qwen2_moe", root / "moe", seed=44),
        "moe_block_dense": (moe3 := make_tiny_model_dir("qwen3_moe", root / "moe3", seed=45)),
        "moe_block": write_block_fp8(moe3, root / "moe_block", (16, 16)),
    }


@pytest.mark.parametrize(("checkpoint", "quantization", "gpu_layout", "exact", "lazy"), [
    # Block scales, 128-aligned slices: activation groups fall on the same columns, so
    # the split model computes what the whole one does; so do static per-tensor input
    # scales (replicated) over per-tensor weight scales.
    pytest.param("block", "auto", False, True, True, id="block-128-cpu-dequantized"),
    pytest.param("block", "auto", True, True, True, id="block-128-gpu-layout"),
    pytest.param("moe_block", "auto", False, True, True, id="moe-experts-block-16-cpu"),
    # FP8 experts of the GPU requantize each rank's slice per channel (down_proj's rows
    # over the rank's columns)
    pytest.param("moe_block", "auto", True, False, True, id="moe-experts-block-16-gpu-layout"),
    # Dynamic per-token activation scales of a row-parallel layer come from the rank's
    # input slice (as on the GPU), so the split model rounds differently: it must stay
    # as close to the dense model as the whole FP8 model is.
    pytest.param("channel", "auto", False, False, True, id="ct-per-channel-cpu-emulated"),
    pytest.param("channel", "auto", True, False, True, id="ct-per-channel-gpu-layout"),
    pytest.param("dense", "fp8", True, False, True, id="online-fp8-gpu-layout"),
    pytest.param("dense", "fp8", True, False, False, id="online-fp8-gpu-layout-whole-tensors"),
    pytest.param("static", "auto", False, True, True, id="ct-static-per-tensor-cpu-emulated"),
    pytest.param("static", "auto", True, True, True, id="ct-static-per-tensor-gpu-layout"),
    pytest.param("moe", "fp8", False, False, True, id="online-fp8-moe-experts-cpu-emulated"),
    pytest.param("moe", "fp8", True, False, True, id="online-fp8-moe-experts-gpu-layout"),
])
def test_fp8_sharded_forward_matches_the_whole_fp8_model(
        fp8_dirs: dict[str, Path], checkpoint: str, quantization: str, gpu_layout: bool,
        exact: bool, lazy: bool) -> None:
    path = fp8_dirs[checkpoint]
    step = _prefill(random_prompts(3, 5, 30, vocab=512, seed=4))
    whole = _fp8_runner(path, None, gpu_layout, quantization)
    expected = whole.execute(step)
    got, runners = _fp8_sharded(path, 2, step, gpu_layout=gpu_layout,
                                quantization=quantization, lazy=lazy)
    if exact:
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    else:
        dense_path = fp8_dirs[{"block": "block_dense", "moe": "moe",
                               "moe_block": "moe_block_dense"}.get(checkpoint, "dense")]
        dense = _runner(dense_path, None).execute(step)
        whole_err = float((expected - dense).abs().max())
        split_err = float((got - dense).abs().max())
        assert whole_err > 1e-4  # FP8 really changed the logits
        assert split_err < 2 * whole_err, (split_err, whole_err)
        assert float((got - expected).abs().max()) < 2 * whole_err
    assert torch.equal(got.argmax(-1), expected.argmax(-1))
    total = _bytes(whole)
    for runner in runners:  # about half: norms (and routers) replicated
        assert total / 2 <= _bytes(runner) < 0.62 * total, ([_bytes(r) for r in runners],
                                                             total)


def test_fp8_block_scales_that_a_rank_boundary_cuts_are_a_one_line_error(
        fp8_dirs: dict[str, Path], tmp_path: Path) -> None:
    # head_dim 16: a rank's 32 query rows are a quarter of a 128-row block.
    fp8 = write_block_fp8(fp8_dirs["dense"], tmp_path / "fp8", (128, 128))
    with pytest.raises(TensorParallelConfigError,
                       match=r"splits the output rows of model\.layers\.0\.self_attn\.qkv_proj "
                             r"\(q\) into 32-wide slices, not a multiple of the FP8 weight "
                             r"block 128") as info:
        load_model(fp8, torch.float32, "cpu", shard=ShardInfo(0, 2))
    assert "\n" not in str(info.value)
    with pytest.raises(TensorParallelConfigError, match="not a multiple of the FP8 weight"):
        check_tensor_parallel(fp8, 2)  # before any rank starts
    assert check_tensor_parallel(fp8, 2, quantization="none") == fp8  # dequantized: any split


@pytest.mark.parametrize("block", [None, (128, 128)])
def test_an_fp8_weight_dequantized_slice_by_slice_equals_the_whole_dequantized(
        block: tuple[int, int] | None) -> None:
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(200, 300, generator=gen)
    if block is None:
        w8, scales = quantize_weight_per_channel(w)
    else:
        w8, scales = block_quantize(w, block)  # partial edge blocks: a 2 x 3 grid
    whole = dequantize_weight(w8, scales, torch.float32, block)
    lazy = DequantizedSlices(w8, scales, torch.float32, block)
    assert torch.equal(lazy.read(), whole)
    assert torch.equal(read_rows(lazy, 70, 190), whole[70:190])  # inside and across blocks
    assert torch.equal(read_cols(lazy, 100, 290), whole[:, 100:290])
