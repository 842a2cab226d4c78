"""MoE blocks vs transformers' own blocks (fp32, CPU), both expert paths; no host syncs."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from qworker.models.moe_exec import ExpertPath, force_path, grouped_mm_available, run_experts
from tests.engine.sync_guard import no_host_sync

PATHS = [ExpertPath.LOOP, ExpertPath.GROUPED_MM]


def _hf_block(arch: str, **overrides: Any) -> tuple[Any, Any]:
    """A seeded transformers MoE block with wide random weights, and its config."""
    import transformers

    base: dict[str, Any] = {"hidden_size": 32, "intermediate_size": 48, "hidden_act": "silu"}
    if arch == "mixtral":
        cfg = transformers.MixtralConfig(**base, **{"num_local_experts": 8,
                                                    "num_experts_per_tok": 2, **overrides})
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock as B
    elif arch == "qwen2_moe":
        cfg = transformers.Qwen2MoeConfig(**base, **{
            "num_experts": 16, "num_experts_per_tok": 4, "moe_intermediate_size": 24,
            "shared_expert_intermediate_size": 40, **overrides})
        from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock as B
    else:
        cfg = transformers.Qwen3MoeConfig(**base, **{
            "num_experts": 16, "num_experts_per_tok": 4, "moe_intermediate_size": 24,
            **overrides})
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock as B
    cfg._experts_implementation = "eager"
    torch.manual_seed(0)
    block = B(cfg).eval()
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, 0.3)
    return block, cfg


def _ours(arch: str, hf: Any, cfg: Any) -> torch.nn.Module:
    from qworker.models.layers import activation
    from qworker.models.moe import RouterSpec, SparseMoeBlock

    if arch == "mixtral":
        router = RouterSpec(cfg.num_local_experts, cfg.num_experts_per_tok, True, False)
        block = SparseMoeBlock(cfg.hidden_size, cfg.intermediate_size, router,
                               activation(cfg.hidden_act))
    else:
        router = RouterSpec(cfg.num_experts, cfg.num_experts_per_tok, cfg.norm_topk_prob, True)
        shared = getattr(cfg, "shared_expert_intermediate_size", None) if arch == "qwen2_moe" \
            else None
        block = SparseMoeBlock(cfg.hidden_size, cfg.moe_intermediate_size, router,
                               activation(cfg.hidden_act), shared_inter=shared)
    state = hf.state_dict()
    with torch.no_grad():
        block.gate.weight.copy_(state["gate.weight"])
        block.experts.load("gate_up_proj", state["experts.gate_up_proj"])
        block.experts.load("down_proj", state["experts.down_proj"])
        if block.shared_expert is not None and block.shared_expert_gate is not None:
            inter = cfg.shared_expert_intermediate_size
            block.shared_expert.gate_up_proj.load_shard(
                "gate", "weight", state["shared_expert.gate_proj.weight"])
            block.shared_expert.gate_up_proj.load_shard(
                "up", "weight", state["shared_expert.up_proj.weight"])
            block.shared_expert.down_proj.weight.copy_(state["shared_expert.down_proj.weight"])
            block.shared_expert_gate.weight.copy_(state["shared_expert_gate.weight"])
            assert block.shared_expert.gate_up_proj.weight.shape[0] == 2 * inter
    return block.eval()


@pytest.mark.parametrize("path", PATHS, ids=lambda p: p.value)
@pytest.mark.parametrize(
    ("arch", "overrides"),
    [
        pytest.param("mixtral", {}, id="mixtral-8x-top2"),
        pytest.param("mixtral", {"num_local_experts": 16, "num_experts_per_tok": 4},
                     id="mixtral-16x-top4"),
        pytest.param("qwen2_moe", {"norm_topk_prob": False}, id="qwen2-moe-shared"),
        pytest.param("qwen3_moe", {"norm_topk_prob": True}, id="qwen3-moe-norm-topk"),
        pytest.param("qwen3_moe", {"norm_topk_prob": False, "num_experts": 8,
                                   "num_experts_per_tok": 2}, id="qwen3-moe-8x-top2"),
    ],
)
def test_block_matches_transformers_block(arch: str, overrides: dict[str, Any],
                                          path: ExpertPath) -> None:
    if path is ExpertPath.GROUPED_MM and not grouped_mm_available(torch.device("cpu"),
                                                                   torch.float32):
        pytest.skip("this torch has no CPU torch._grouped_mm")
    hf, cfg = _hf_block(arch, **overrides)
    ours = _ours(arch, hf, cfg)
    # 1 token (a decode), 7, and 40: some experts get no tokens, others several.
    for n in (1, 7, 40):
        x = torch.randn(n, cfg.hidden_size, generator=torch.Generator().manual_seed(n))
        with torch.inference_mode(), force_path(path):
            got = ours(x)
            want = hf(x.unsqueeze(0))[0]
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_routing_to_unused_experts_leaves_them_out_and_ties_keep_token_order() -> None:
    # Every token routed to experts 2 and 0 only: the other experts' rows are empty runs.
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(5, 8, generator=gen)
    gate_up = torch.randn(4, 16, 8, generator=gen)
    down = torch.randn(4, 8, 8, generator=gen)
    ids = torch.tensor([[2, 0]] * 5)
    weights = torch.full((5, 2), 0.5)
    want = torch.zeros(5, 8)
    for t in range(5):
        for e in (2, 0):
            g, u = (gate_up[e] @ x[t]).split(8)
            want[t] += 0.5 * (down[e] @ (torch.nn.functional.silu(g) * u))
    for path in PATHS:
        if path is ExpertPath.GROUPED_MM and not grouped_mm_available(x.device, x.dtype):
            continue
        with force_path(path):
            got = run_experts(x, weights, ids, gate_up, down, torch.nn.functional.silu)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_grouped_mm_path_reads_nothing_back_to_the_host() -> None:
    if not grouped_mm_available(torch.device("cpu"), torch.float32):
        pytest.skip("this torch has no CPU torch._grouped_mm")
    hf, cfg = _hf_block("qwen2_moe")
    ours = _ours("qwen2_moe", hf, cfg)
    x = torch.randn(9, cfg.hidden_size)
    with torch.inference_mode(), force_path(ExpertPath.GROUPED_MM), no_host_sync(strict=True):
        ours(x)


def test_loop_path_is_the_one_that_syncs() -> None:
    # The guard can fail: the grouped loop reads its counts on the host.
    from tests.engine.sync_guard import HostSyncError

    hf, cfg = _hf_block("mixtral")
    ours = _ours("mixtral", hf, cfg)
    with torch.inference_mode(), force_path(ExpertPath.LOOP), \
            pytest.raises(HostSyncError), no_host_sync(strict=True):
        ours(torch.randn(3, cfg.hidden_size))
