"""The engine end to end in bf16 and fp16 with the tensor-core kernels against the same engine
on the torch attention backend: greedy tokens equal wherever the reference's top two tokens
are not a near tie, and the chosen tokens' log-probabilities within a bound.

On the CPU the CUDA backend's real launch code runs the kernel sources through the emulator
(``tests/attention/emulator``; chunked prefill through the paged prefill kernel, split and
unsplit decodes); on a GPU (``-m gpu``) the cupy-compiled kernels run with everything the
GPU default adds: fused small ops and CUDA-graph decode steps."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from qworker.engine.config import EngineConfig
from qworker.engine.engine import Engine
from qworker.engine.outputs import CompletionOutput
from qworker.engine.sampling_params import SamplingParams
from tests.engine.reference import random_prompts

#: Per dtype: (largest log-probability difference of a chosen token, the top-two margin of
#: the reference under which a different greedy choice is a near tie). The margin is twice
#: the bound: a token can only flip where the two candidates are that close.
BOUNDS = {"bfloat16": (0.15, 0.3), "float16": (0.03, 0.06)}

#: Tiny Llama shapes the emulator library of tests/attention/conftest.py holds kernels for.
SHAPES = {
    "bfloat16": {"head_dim": 64, "num_attention_heads": 4, "num_key_value_heads": 1},
    "float16": {"head_dim": 32, "num_attention_heads": 4, "num_key_value_heads": 2},
}


def generate(engine: Engine, prompts: list[list[int]], max_tokens: int) -> list[CompletionOutput]:
    """Greedy completions with top-2 log-probabilities, in prompt order."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=2)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    outs: list[Any] = []
    while len(outs) < len(prompts):
        outs += engine.step()
    return [o.outputs[0] for o in sorted(outs, key=lambda o: int(o.request_id))]


def compare(got: list[CompletionOutput], want: list[CompletionOutput], dtype: str) -> int:
    """Assert agreement as the module docstring says; returns the tokens compared."""
    bound, tie = BOUNDS[dtype]
    compared = 0
    for g, w in zip(got, want, strict=True):
        for i, (tg, tw) in enumerate(zip(g.token_ids, w.token_ids, strict=True)):
            ref = w.logprobs[i]
            if tg != tw:
                top = sorted(ref.values(), reverse=True)
                assert top[0] - top[1] < tie, (i, tg, tw, top)  # only a near tie may flip
                break  # the continuations differ from here on
            assert abs(g.logprobs[i][tg] - ref[tw]) < bound, (i, g.logprobs[i][tg], ref[tw])
            compared += 1
    return compared


@pytest.fixture(scope="module")
def emu_runner():  # type: ignore[no-untyped-def]
    from tests.attention.conftest import EMU_LEGACY, EMU_TC_DECODE, EMU_TC_PREFILL
    from tests.attention.emulator import EmulatedKernels, build, compiler

    if compiler() is None:
        pytest.skip("no C++ compiler for the kernel emulator")
    lib = build(EMU_LEGACY, EMU_TC_DECODE, EMU_TC_PREFILL)
    return lambda: EmulatedKernels(lib)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_emulated_tensor_core_engine_agrees_with_the_torch_backend(
    dtype: str, emu_runner: Any, tmp_path_factory: pytest.TempPathFactory
) -> None:
    from tests.fixtures.models import make_tiny_model_dir

    model = make_tiny_model_dir("llama", tmp_path_factory.mktemp(dtype), **SHAPES[dtype])
    prompts = random_prompts(3, 3, 40, seed=3)
    kwargs = {"model": str(model), "dtype": dtype, "device": "cpu", "max_model_len": 128,
              "num_kv_blocks": 64, "max_num_seqs": 8, "max_num_batched_tokens": 32}
    runner = emu_runner()
    engine = Engine(EngineConfig(**kwargs), kernels=runner)
    stats = engine.stats()
    assert (stats.attention_backend, stats.kernel_selftest) == ("cuda", "passed")
    assert stats.kernel_paths == {"decode": "tensor_core", "prefill": "tensor_core",
                                  "cache_write": "cuda"}
    before = len(runner.launches)
    got = generate(engine, prompts, 8)
    launched = {name.split("<")[0] for name in runner.launches[before:]}
    assert {"paged_decode_tc", "paged_prefill_tc", "reshape_and_cache"} <= launched
    reference = Engine(EngineConfig(**kwargs, attention_backend="torch"))
    assert reference.stats().attention_backend == "torch"
    want = generate(reference, prompts, 8)
    assert compare(got, want, dtype) >= 12  # of 24 (a near tie may end one early)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_gpu_tensor_core_engine_agrees_with_the_torch_backend(dtype: str, tmp_path: Path) -> None:
    from tests.fixtures.models import make_tiny_model_dir

    model = make_tiny_model_dir("llama", tmp_path / "m", head_dim=128, num_attention_heads=8,
                                num_key_value_heads=2, hidden_size=256, intermediate_size=512,
                                num_hidden_layers=4)
    prompts = random_prompts(16, 3, 300, seed=5)
    kwargs = {"model": str(model), "dtype": dtype, "device": "cuda", "max_model_len": 512,
              "num_kv_blocks": 512, "max_num_seqs": 16, "max_num_batched_tokens": 512}
    engine = Engine(EngineConfig(**kwargs))
    stats = engine.stats()
    assert (stats.attention_backend, stats.kernel_selftest, stats.cuda_graphs) == (
        "cuda", "passed", True)
    assert stats.kernel_paths["decode"] == "tensor_core"
    assert all(stats.kernel_paths[op] == "cuda" for op in ("rms_norm", "rotary"))
    got = generate(engine, prompts, 32)
    del engine
    torch.cuda.empty_cache()
    want = generate(Engine(EngineConfig(**kwargs, attention_backend="torch")), prompts, 32)
    assert compare(got, want, dtype) >= 16 * 32 * 3 // 4
