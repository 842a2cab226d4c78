"""The kernel self-test at engine start (qworker/engine/kernel_selftest.py), proven on the CPU:
the engine runs the CUDA backend through the kernel emulator with a planted broken kernel.

- "on": the broken kernel's check fails, an error names it, the engine runs that component
  on the path that passed, its stats/paths say so, and its output still matches
  ``transformers`` token for token (fp32) or the torch backend (bf16);
- "strict": the engine refuses to start with a one-line error naming the kernel;
- "off": nothing is checked;
- a CUDA-graph replay that disagrees with the eager step drops the graphs.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch

from qworker.engine.config import EngineConfig
from qworker.engine.engine import Engine
from qworker.engine.kernel_selftest import (
    KernelSelfTestError,
    SelftestReport,
    SelftestState,
    check_graph_replay,
    check_graphs,
)
from qworker.engine.sampling_params import SamplingParams
from qworker.testing.kernel_faults import FaultyKernels, RoutedKernels
from tests.engine.reference import hf_greedy, random_prompts
from tests.engine.test_engine_tensor_cores import SHAPES, compare, generate

KW = {"device": "cpu", "max_model_len": 96, "num_kv_blocks": 48, "max_num_seqs": 4}


@pytest.fixture(scope="module")
def emu_lib():  # type: ignore[no-untyped-def]
    from tests.attention.conftest import EMU_LEGACY, EMU_TC_DECODE, EMU_TC_PREFILL
    from tests.attention.emulator import build, compiler

    if compiler() is None:
        pytest.skip("no C++ compiler for the kernel emulator")
    return build(EMU_LEGACY, EMU_TC_DECODE, EMU_TC_PREFILL)


@pytest.fixture(scope="module")
def fp32_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """fp32 Llama whose head size 32 and GQA 8 the emulated CUDA-core decode kernel serves."""
    from tests.fixtures.models import make_tiny_model_dir

    return make_tiny_model_dir("llama", tmp_path_factory.mktemp("fp32"), head_dim=32,
                               num_attention_heads=8, num_key_value_heads=1)


def _broken_legacy(emu_lib: Any) -> FaultyKernels:
    from tests.attention.emulator import EmulatedKernels

    # the legacy decode kernel and its split reduce with a softmax scale 25% off
    return FaultyKernels(EmulatedKernels(emu_lib), "paged_attention_", factor=1.25)


def test_broken_decode_kernel_falls_back_and_matches_transformers(
    emu_lib: Any, fp32_model: Path, caplog: pytest.LogCaptureFixture
) -> None:
    runner = _broken_legacy(emu_lib)
    with caplog.at_level(logging.ERROR, logger="qworker.engine.kernel_selftest"):
        engine = Engine(EngineConfig(model=str(fp32_model), dtype="float32", **KW),
                        kernels=runner)
    stats = engine.stats()
    assert stats.kernel_selftest == "fell_back" and stats.attention_backend == "mixed"
    assert stats.kernel_paths == {"decode": "torch", "prefill": "sdpa", "cache_write": "cuda"}
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert any("paged_attention_decode<0, 32, 8>" in m and "FAILED" in m for m in errors)
    assert engine.selftest.failed() and all(c.component == "decode"
                                            for c in engine.selftest.failed())
    hits = runner.hits
    prompts = random_prompts(3, 4, 30, seed=2)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    outs: list[Any] = []
    while len(outs) < len(prompts):
        outs += engine.step()
    assert runner.hits == hits  # the broken kernel never ran after the self-test
    for out in outs:
        prompt = prompts[int(out.request_id)]
        assert out.outputs[0].token_ids == hf_greedy(fp32_model, prompt, 8)


def test_broken_tensor_core_decode_runs_the_legacy_kernel_in_bf16(
    emu_lib: Any, tmp_path_factory: pytest.TempPathFactory
) -> None:
    from tests.attention.emulator import EmulatedKernels, build
    from tests.fixtures.models import make_tiny_model_dir

    # the decode kernel built with its cp.async wait one group too weak (it reads stages in
    # flight): a broken variant of cuda/paged_decode_tc.cu itself
    broken = EmulatedKernels(build([], [(2, 0, 64, 1)], [], defines=["QW_EMU_MUTATE_WAIT=1"]))
    sound = EmulatedKernels(emu_lib)
    model = make_tiny_model_dir("llama", tmp_path_factory.mktemp("bf16"), **SHAPES["bfloat16"])
    kwargs = {"model": str(model), "dtype": "bfloat16", **KW}
    engine = Engine(EngineConfig(**kwargs),
                    kernels=RoutedKernels(sound, {"paged_decode_tc": broken}))
    stats = engine.stats()
    assert (stats.kernel_selftest, stats.attention_backend) == ("fell_back", "mixed")
    assert stats.kernel_paths == {"decode": "legacy", "prefill": "tensor_core",
                                  "cache_write": "cuda"}
    prompts = random_prompts(2, 4, 30, seed=4)
    before, broken_before = len(sound.launches), len(broken.launches)
    got = generate(engine, prompts, 6)
    assert len(broken.launches) == broken_before
    assert {"paged_attention_decode", "paged_prefill_tc"} <= {
        n.split("<")[0] for n in sound.launches[before:]}
    want = generate(Engine(EngineConfig(**kwargs, attention_backend="torch")), prompts, 6)
    assert compare(got, want, "bfloat16") >= 6


def test_strict_refuses_to_start_with_one_line_naming_the_kernel(
    emu_lib: Any, fp32_model: Path
) -> None:
    config = EngineConfig(model=str(fp32_model), dtype="float32", kernel_selftest="strict", **KW)
    with pytest.raises(KernelSelfTestError) as info:
        Engine(config, kernels=_broken_legacy(emu_lib))
    message = str(info.value)
    assert "\n" not in message and "strict" in message
    assert "paged_attention_decode<0, 32, 8>" in message and "relative error" in message


def test_off_checks_nothing(emu_lib: Any, fp32_model: Path) -> None:
    runner = _broken_legacy(emu_lib)
    config = EngineConfig(model=str(fp32_model), dtype="float32", kernel_selftest="off", **KW)
    engine = Engine(config, kernels=runner)
    stats = engine.stats()
    assert stats.kernel_selftest == "off" and engine.selftest.checks == []
    assert stats.kernel_paths["decode"] == "legacy" and runner.hits == 0


def test_invalid_mode_is_refused_naming_the_field(fp32_model: Path) -> None:
    with pytest.raises(ValueError, match="kernel_selftest must be 'on', 'strict' or 'off'"):
        Engine(EngineConfig(model=str(fp32_model), kernel_selftest="sometimes", **KW))


def test_the_torch_and_cpu_backends_report_what_runs(fp32_model: Path) -> None:
    for backend in ("torch", "cpu"):
        engine = Engine(EngineConfig(model=str(fp32_model), attention_backend=backend, **KW))
        stats = engine.stats()
        assert stats.attention_backend == backend and stats.kernel_selftest == "not_applicable"
        assert set(stats.kernel_paths.values()) == {backend}


class _StaleGraph:
    """A 'graph' whose replay leaves the output of its capture: what a graph holding a
    stale pointer or a lost launch would give."""

    def __init__(self, fn: Any) -> None:
        self.output = fn()

    def replay(self) -> None:
        pass


def _graphed_runner(emu_lib: Any, model: Path, factory: Any) -> Any:
    from qworker.attention.cuda_backend import CudaAttentionBackend
    from qworker.engine.model_runner import ModelRunner
    from qworker.models.loader import load_model
    from tests.attention.emulator import EmulatedKernels

    loaded = load_model(model, torch.bfloat16, torch.device("cpu"))
    backend = CudaAttentionBackend(kernels=EmulatedKernels(emu_lib), num_sms=4)
    runner = ModelRunner(loaded.model, loaded.spec, torch.device("cpu"), 16, 16, backend,
                         max_num_seqs=2, max_num_batched_tokens=64, max_model_len=64)
    runner.enable_cuda_graphs([1, 2], 64, graph_factory=factory)
    return runner


def test_graph_replay_check_passes_a_sound_graph_and_drops_a_stale_one(
    emu_lib: Any, tmp_path_factory: pytest.TempPathFactory
) -> None:
    from tests.engine.test_cuda_graphs import rerun_factory
    from tests.fixtures.models import make_tiny_model_dir

    model = make_tiny_model_dir("llama", tmp_path_factory.mktemp("g"), **SHAPES["bfloat16"])
    sound = _graphed_runner(emu_lib, model, rerun_factory)
    result = check_graph_replay(sound)
    assert result.passed and result.rel_err < 1e-3, result.describe()
    report = SelftestReport("on", SelftestState.PASSED)
    check_graphs(report, sound)
    assert report.state is SelftestState.PASSED and sound.graphs is not None

    stale = _graphed_runner(emu_lib, model, lambda fn, pool: (g := _StaleGraph(fn), g.output))
    report = SelftestReport("strict", SelftestState.PASSED, "bf16 test shape")
    with pytest.raises(KernelSelfTestError, match="cuda_graph"):
        check_graphs(report, stale)
    report = SelftestReport("on", SelftestState.PASSED)
    check_graphs(report, stale)
    assert report.state is SelftestState.FELL_BACK and stale.graphs is None
    assert not report.checks[-1].passed and report.checks[-1].rel_err > 0.05


def test_a_shape_the_attention_kernels_do_not_serve_is_reported_mixed(
    emu_lib: Any, tiny_llama_dir: Path
) -> None:
    from tests.attention.emulator import EmulatedKernels

    # fp32 head size 16: no decode kernel; only the cache write launches a kernel
    engine = Engine(EngineConfig(model=str(tiny_llama_dir), dtype="float32", **KW),
                    kernels=EmulatedKernels(emu_lib))
    stats = engine.stats()
    assert (stats.attention_backend, stats.kernel_selftest) == ("mixed", "passed")
    assert stats.kernel_paths == {"decode": "torch", "prefill": "torch", "cache_write": "cuda"}
