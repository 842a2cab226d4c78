"""CUDA graphs for decode: buckets, padding into the captured buffers, replay == eager.

On the CPU a stand-in graph re-runs its captured function on replay; it reads the same
static buffers a real graph would, so wrong padding, a buffer that moved, or a step
built outside its bucket's buffers shows up as different logits.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from qworker.attention.select import select_backend
from qworker.engine.cuda_graphs import bucket_for, graph_batch_sizes
from qworker.engine.model_runner import ModelRunner
from qworker.engine.step_inputs import StepInput, StepInputBuilder
from qworker.models.loader import load_model


class RerunGraph:
    """A 'graph' whose replay runs the captured function again into the same output."""

    def __init__(self, fn: Callable[[], torch.Tensor]) -> None:
        self.fn = fn
        self.output = fn()
        self.replays = 0

    def replay(self) -> None:
        self.replays += 1
        self.output.copy_(self.fn())


GRAPHS: list[RerunGraph] = []


def rerun_factory(fn: Callable[[], torch.Tensor], pool: Any) -> tuple[RerunGraph, torch.Tensor]:
    graph = RerunGraph(fn)
    GRAPHS.append(graph)
    return graph, graph.output


def test_buckets_cover_every_batch_up_to_the_largest() -> None:
    assert graph_batch_sizes(256)[:6] == [1, 2, 4, 8, 16, 32]
    assert graph_batch_sizes(256)[-1] == 256 and graph_batch_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert graph_batch_sizes(1) == [1]
    sizes = graph_batch_sizes(40)
    assert [bucket_for(n, sizes) for n in (1, 3, 8, 9, 17, 33, 40, 41)] == [
        1, 4, 8, 16, 32, 40, 40, None]


def test_padding_rows_write_nothing_and_reuse_the_buckets_buffers() -> None:
    builder = StepInputBuilder(torch.device("cpu"), 4, 64, 8, 4)
    a = builder.build(StepInput([[5], [6], [7]], [4, 1, 9], [[3, 4], [5], [6, 7, 8]],
                                [1, 1, 1], table_keys=[1, 2, 3]), pad_to=4)
    assert a.graph_size == 4 and a.meta.num_seqs == 4 and a.meta.num_decodes == 4
    assert a.meta.slot_mapping.tolist() == [4 * 4 + 0, 5 * 4 + 1, 8 * 4 + 1, -1]
    assert a.meta.seq_lens.tolist() == [5, 2, 10, 1]
    assert a.num_logit_rows == 3 and a.logits_index is not None
    assert a.logits_index.tolist() == [0, 1, 2]
    pointers = [t.data_ptr() for t in (a.input_ids, a.positions, a.meta.slot_mapping,
                                       a.meta.seq_lens, a.meta.block_tables)]
    b = builder.build(StepInput([[9]], [2], [[1]], [1], table_keys=[7]), pad_to=4)
    assert [t.data_ptr() for t in (b.input_ids, b.positions, b.meta.slot_mapping,
                                   b.meta.seq_lens, b.meta.block_tables)] == pointers
    assert b.meta.slot_mapping.tolist() == [1 * 4 + 2, -1, -1, -1]
    assert b.meta.seq_lens.tolist() == [3, 1, 1, 1]


def _runner(model_dir: Path) -> ModelRunner:
    dev = torch.device("cpu")
    loaded = load_model(model_dir, torch.float32, dev)
    return ModelRunner(loaded.model, loaded.spec, dev, 8, 32, select_backend("cpu", dev),
                       max_num_seqs=6, max_num_batched_tokens=64, max_model_len=96)


@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_opt_dir"])
def test_replayed_decode_steps_give_the_eager_logits(fixture: str,
                                                      request: pytest.FixtureRequest) -> None:
    model_dir = request.getfixturevalue(fixture)
    eager, graphed = _runner(model_dir), _runner(model_dir)
    GRAPHS.clear()
    graphed.enable_cuda_graphs(graph_batch_sizes(6), 96, graph_factory=rerun_factory)
    prompts = [[5, 6, 7, 8, 9], list(range(10, 27)), [30, 31], [40] * 9, [50, 51, 52]]
    tables = [[0, 1, 2], [3, 4, 5, 6], [7, 8], [9, 10, 11], [12, 13]]
    prefill = StepInput(prompts, [0] * 5, tables, [1] * 5, table_keys=list(range(5)))
    for runner in (eager, graphed):
        runner.execute(prefill)
    lens = [len(p) for p in prompts]
    for step_no, live in enumerate(([0, 1, 2, 3, 4], [0, 2, 3], [1], [4, 0, 1, 3])):
        step = StepInput([[60 + step_no + s] for s in live], [lens[s] for s in live],
                         [tables[s] for s in live], [1] * len(live),
                         table_keys=[s for s in live])
        want = eager.execute(step)
        got = graphed.execute(step)
        assert got is not None and want is not None
        # padding rows change the matmuls' batch shape, hence the last bits only
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        for s in live:
            lens[s] += 1
    assert sum(g.replays for g in GRAPHS) == 4
    # a mixed step runs eagerly and agrees too
    mixed = StepInput([[70], [71, 72, 73]], [lens[0], lens[2]], [tables[0], tables[2]],
                      [1, 1], table_keys=[0, 2])
    want, got = eager.execute(mixed), graphed.execute(mixed)
    assert got is not None and want is not None
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert sum(g.replays for g in GRAPHS) == 4


def test_reallocating_the_pool_drops_the_graphs(tiny_llama_dir: Path) -> None:
    runner = _runner(tiny_llama_dir)
    runner.enable_cuda_graphs([1, 2], 96, graph_factory=rerun_factory)
    assert runner.graphs is not None and runner.graphs.captured
    runner.reallocate_pool(40)
    assert runner.graphs is None


@pytest.mark.gpu
def test_graphs_and_eager_give_identical_tokens_on_gpu(tmp_path: Path) -> None:
    from qworker.engine.llm import LLM
    from qworker.engine.sampling_params import SamplingParams
    from tests.engine.reference import random_prompts
    from tests.fixtures.models import make_tiny_model_dir

    # bf16, head size 64: the captured decode needs the tensor-core kernels' fixed plans
    model_dir = make_tiny_model_dir("llama", tmp_path / "m", head_dim=64)
    prompts = random_prompts(12, 3, 40, seed=11)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs = {}
    for eager in (True, False):
        llm = LLM(str(model_dir), device="cuda", dtype="bfloat16", max_model_len=128,
                  num_kv_blocks=256, max_num_seqs=8, enforce_eager=eager)
        assert llm.stats().cuda_graphs is (not eager)
        outs[eager] = [o.outputs[0].token_ids for o in llm.generate(prompts, params,
                                                                    use_tqdm=False)]
    assert outs[True] == outs[False]


def test_capture_with_the_kernels_fixed_decode_plans_replays_like_eager(tmp_path: Path) -> None:
    # The CUDA backend's real launch code and kernel sources, run by the CPU emulator: the
    # captured steps carry CudaAttentionBackend.plan_decode plans (one per window and bucket).
    from qworker.attention.cuda_backend import CudaAttentionBackend
    from tests.attention.conftest import EMU_LEGACY, EMU_TC_DECODE, EMU_TC_PREFILL
    from tests.attention.emulator import EmulatedKernels, build, compiler
    from tests.fixtures.models import make_tiny_model_dir

    if compiler() is None:
        pytest.skip("no C++ compiler for the kernel emulator")
    lib = build(EMU_LEGACY, EMU_TC_DECODE, EMU_TC_PREFILL)
    model_dir = make_tiny_model_dir("llama", tmp_path / "m", head_dim=64)
    dev = torch.device("cpu")

    def runner() -> ModelRunner:
        loaded = load_model(model_dir, torch.bfloat16, dev)
        backend = CudaAttentionBackend(kernels=EmulatedKernels(lib), num_sms=4)
        return ModelRunner(loaded.model, loaded.spec, dev, 16, 16, backend, max_num_seqs=4,
                           max_num_batched_tokens=64, max_model_len=64)

    eager, graphed = runner(), runner()
    GRAPHS.clear()
    graphed.enable_cuda_graphs([1, 2, 4], 64, graph_factory=rerun_factory)
    assert graphed.graphs is not None
    plans = graphed.graphs._graphs[4].plans
    assert plans is not None and set(plans) == {None}
    prompts = [[5, 6, 7, 8, 9, 10, 11], list(range(20, 37)), [40, 41, 42]]
    tables = [[0], [1, 2], [3]]
    prefill = StepInput(prompts, [0, 0, 0], tables, [1, 1, 1], table_keys=[0, 1, 2])
    for r in (eager, graphed):
        r.execute(prefill)
    lens = [len(p) for p in prompts]
    for step_no, live in enumerate(([0, 1, 2], [2, 0], [1, 2, 0])):
        step = StepInput([[50 + step_no] for _ in live], [lens[s] for s in live],
                         [tables[s] for s in live], [1] * len(live), table_keys=list(live))
        want, got = eager.execute(step), graphed.execute(step)
        assert want is not None and got is not None
        bucket = 4 if len(live) > 2 else 2
        assert graphed.backend.last_decode is graphed.graphs._graphs[bucket].plans[None].plan
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
        assert torch.equal(got.argmax(-1), want.argmax(-1))
        for s in live:
            lens[s] += 1
    assert sum(g.replays for g in GRAPHS) == 3
