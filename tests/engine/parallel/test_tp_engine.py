"""tensor_parallel_size=2 on the CPU (gloo, 2 processes) against tensor_parallel_size=1
and transformers, token for token: every architecture (Gemma, Phi-3, MoE and an FP8
checkpoint included), chunked prefill, prefix caching,
preemption (recompute and swap), seeded sampling with n > 1, structured outputs and
overlapped (async) steps; each rank holding about half the weights.

The module spawns one group of ranks and serves every engine on it in turn (each
engine is built on the running followers and released after), so the suite pays for
one spawn.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from qworker import LLM, SamplingParams, StructuredOutputsParams
from qworker.engine.config import EngineConfig
from qworker.engine.engine import Engine
from qworker.engine.parallel.launcher import TensorParallelGroup
from qworker.models.tp_plan import TensorParallelConfigError
from tests.engine.reference import hf_greedy, random_prompts
from tests.fixtures.models import make_tiny_model_dir

BASE: dict[str, Any] = {"dtype": "float32", "device": "cpu", "num_kv_blocks": 64,
                        "max_model_len": 256}


@pytest.fixture(scope="module")
def group() -> Iterator[TensorParallelGroup]:
    """Ranks 1 of a 2-rank gloo group, shared by the module's engines."""
    tp = TensorParallelGroup.start(2, torch.device("cpu"), timeout_s=120)
    yield tp
    tp.shutdown()
    assert not any(p.is_alive() for p in (f.process for f in tp.followers))


@pytest.fixture(scope="module")
def tiny_mqa_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Llama with one KV head: each of the two ranks holds a copy of it."""
    return make_tiny_model_dir("llama", tmp_path_factory.mktemp("tiny_mqa"), seed=6,
                               num_key_value_heads=1)


class _Pair:
    """The same engine settings with one rank and with two."""

    def __init__(self, group: TensorParallelGroup, path: Path, **kwargs: Any) -> None:
        config = {**BASE, **kwargs}
        self.tp1 = LLM(str(path), **config)
        self.tp2 = LLM.from_engine(Engine(
            EngineConfig(model=str(path), tensor_parallel_size=2, **config), tp_group=group))

    def __enter__(self) -> _Pair:
        return self

    def __exit__(self, *exc: object) -> None:
        self.tp2.close()  # releases the group for the next engine

    def both(self, prompts: list[Any], params: Any) -> tuple[list[Any], list[Any]]:
        one = self.tp1.generate(prompts, params, use_tqdm=False)
        two = self.tp2.generate(prompts, params, use_tqdm=False)
        return one, two


def _in_another_process(code: str, *args: str) -> str:
    """Run ``code`` (argv: ``args``) in a fresh interpreter; its stdout. compressed-tensors
    broadcasts over an initialised torch.distributed (writing, and transformers loading
    a checkpoint), and this process is rank 0 of the module's group."""
    done = subprocess.run([sys.executable, "-c", code, *args], check=True, text=True,
                          cwd=Path(__file__).parents[3], capture_output=True, timeout=300)
    return done.stdout


@pytest.fixture(scope="module")
def tiny_fp8_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Llama as compressed-tensors FP8 with static per-tensor input scales (the CPU
    emulates its activations; the split computes what one rank does)."""
    root = tmp_path_factory.mktemp("tiny_fp8")
    dense = make_tiny_model_dir("llama", root / "dense", seed=41)
    _in_another_process(
        "import sys; from pathlib import Path; "
        "from tests.engine.reference import random_prompts; "
        "from tests.models.quant.checkpoints import write_compressed_tensors; "
        "write_compressed_tensors(Path(sys.argv[1]), Path(sys.argv[2]), 'FP8', "
        "calibration=random_prompts(3, 5, 30, seed=9))", str(dense), str(root / "fp8"))
    return root / "fp8"


@pytest.fixture(scope="module")
def tiny_phi3_fp8_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Phi-3 (fused qkv_proj / gate_up_proj in the checkpoint) as compressed-tensors FP8
    with static input scales: each rank quantizes its rows of the fused layers."""
    root = tmp_path_factory.mktemp("tiny_phi3_fp8")
    dense = make_tiny_model_dir("phi3", root / "dense", seed=42, rope_parameters={
        "rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.75})
    _in_another_process(
        "import sys; from pathlib import Path; "
        "from tests.engine.reference import random_prompts; "
        "from tests.models.quant.checkpoints import write_compressed_tensors; "
        "write_compressed_tensors(Path(sys.argv[1]), Path(sys.argv[2]), 'FP8', "
        "calibration=random_prompts(3, 5, 30, seed=9))", str(dense), str(root / "fp8"))
    return root / "fp8"


def _hf_greedy_all(path: Path, prompts: list[list[int]], n: int) -> list[list[int]]:
    """transformers' greedy continuations (``hf_greedy``), from another process for an
    FP8 checkpoint (see ``_in_another_process``)."""
    if not (path / "config.json").read_text().count("quantization_config"):
        return [hf_greedy(path, prompt, n) for prompt in prompts]
    out = _in_another_process(
        "import json, sys; from tests.engine.reference import hf_greedy; "
        "print(json.dumps([hf_greedy(sys.argv[1], p, int(sys.argv[3])) "
        "for p in json.loads(sys.argv[2])]))", str(path), json.dumps(prompts), str(n))
    return json.loads(out.strip().splitlines()[-1])


def _checkpoint_bytes(path: Path) -> int:
    from safetensors import safe_open

    total = 0
    for file in path.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open is not a dict
                t = handle.get_slice(name)
                total += 4 * int(torch.Size(t.get_shape()).numel())  # fp32 checkpoints
    return total


def _tokens(outs: list[Any]) -> list[list[list[int]]]:
    return [[c.token_ids for c in o.outputs] for o in outs]


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_mqa_dir", "tiny_mistral_dir",
                                     "tiny_qwen2_dir", "tiny_qwen3_dir", "tiny_opt_dir"])
def test_two_ranks_match_one_rank_and_transformers_for_every_architecture(
        group: TensorParallelGroup, fixture: str, request: pytest.FixtureRequest) -> None:
    path = request.getfixturevalue(fixture)
    prompts = random_prompts(8, 1, 40, seed=1)
    with _Pair(group, path) as pair:
        one, two = pair.both(prompts, _greedy(8))
        assert _tokens(two) == _tokens(one)
        for prompt, out in zip(prompts, two, strict=True):
            assert out.outputs[0].token_ids == hf_greedy(path, prompt, 8)
        sizes = pair.tp2.engine.runner.weight_bytes_per_rank
        whole = _checkpoint_bytes(path)
        assert len(sizes) == 2
        for size in sizes:  # replicated norms (and the MQA's one KV head) on top of half
            assert 0.5 * whole <= size < 0.62 * whole, (sizes, whole)


@pytest.mark.parametrize(("fixture", "kwargs"), [
    pytest.param("tiny_gemma2_dir", {}, id="gemma2"),
    pytest.param("tiny_qwen2_moe_dir", {}, id="qwen2-moe-shared-expert"),
    # longrope: a 64-token context keeps the short factors, as transformers picks them
    pytest.param("tiny_phi3_dir", {"max_model_len": 64}, id="phi3"),
    pytest.param("tiny_fp8_dir", {}, id="fp8-compressed-tensors"),
    pytest.param("tiny_phi3_fp8_dir", {}, id="phi3-fp8-compressed-tensors"),
])
def test_gemma_moe_phi3_and_fp8_on_two_ranks_match_one_rank_and_transformers(
        group: TensorParallelGroup, fixture: str, kwargs: dict[str, Any],
        request: pytest.FixtureRequest) -> None:
    path = request.getfixturevalue(fixture)
    prompts = random_prompts(4, 1, 40, seed=2)
    with _Pair(group, path, **kwargs) as pair:
        one, two = pair.both(prompts, _greedy(6))
        assert _tokens(two) == _tokens(one)
        assert [o.outputs[0].token_ids for o in two] == _hf_greedy_all(path, prompts, 6)
        sizes = pair.tp2.engine.runner.weight_bytes_per_rank
        whole = _checkpoint_bytes(path)
        for size in sizes:  # replicated norms and routers on top of half
            assert 0.5 * whole <= size < 0.62 * whole, (sizes, whole)


def test_chunked_prefill_and_prefix_caching_keep_parity(
        group: TensorParallelGroup, tiny_llama_dir: Path) -> None:
    shared = random_prompts(1, 40, 40, seed=5)[0]
    prompts = [shared + tail for tail in random_prompts(6, 1, 20, seed=6)]
    with _Pair(group, tiny_llama_dir, max_num_batched_tokens=16) as pair:
        one, two = pair.both(prompts, _greedy(6))
        again = pair.tp2.generate(prompts, _greedy(6), use_tqdm=False)
        assert _tokens(two) == _tokens(one) == _tokens(again)
        for prompt, out in zip(prompts, two, strict=True):
            assert out.outputs[0].token_ids == hf_greedy(tiny_llama_dir, prompt, 6)
        assert pair.tp2.stats()["prefix_cache_hits"] >= 40 * len(prompts)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preempted_sequences_resume_with_identical_tokens(
        group: TensorParallelGroup, tiny_llama_dir: Path, mode: str) -> None:
    prompts = random_prompts(8, 12, 24, seed=3)
    with _Pair(group, tiny_llama_dir, block_size=8, num_kv_blocks=12, max_model_len=96,
               preemption_mode=mode, swap_space=1 << 20) as pair:
        one, two = pair.both(prompts, _greedy(10))
        assert _tokens(two) == _tokens(one)
        for prompt, out in zip(prompts, two, strict=True):
            assert out.outputs[0].token_ids == hf_greedy(tiny_llama_dir, prompt, 10)
        stats = pair.tp2.stats()
        assert stats["num_preemptions"] > 0 and stats["kv_blocks_used"] == 0
        if mode == "swap":
            assert stats["num_swap_outs"] > 0


def test_seeded_sampling_and_overlapped_steps_match_one_rank(
        group: TensorParallelGroup, tiny_qwen2_dir: Path) -> None:
    prompts = random_prompts(6, 3, 30, seed=8)
    params = [SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=s, max_tokens=12,
                             n=2 if s % 2 else 1, ignore_eos=True) for s in range(6)]
    with _Pair(group, tiny_qwen2_dir) as pair:
        one, two = pair.both(prompts, params)
        assert _tokens(two) == _tokens(one)
        # Overlapped steps (the GPU default): the previous step's sampled ids reach the
        # followers on the device, since rank 0 has not read them either.
        pair.tp2.engine.async_scheduling = True
        overlapped = pair.tp2.generate(prompts, params, use_tqdm=False)
        assert _tokens(overlapped) == _tokens(one)
        assert pair.tp2.engine.num_overlapped_steps > 0


def test_beam_search_matches_one_rank(group: TensorParallelGroup, tiny_llama_dir: Path) -> None:
    prompts = random_prompts(2, 4, 12, seed=9)
    with _Pair(group, tiny_llama_dir) as pair:
        one = pair.tp1.beam_search(prompts, beam_width=3, max_tokens=6)
        two = pair.tp2.beam_search(prompts, beam_width=3, max_tokens=6)
        assert _tokens(two) == _tokens(one) and len(two[0].outputs) == 3


def test_structured_outputs_with_seeds_match_one_rank(
        group: TensorParallelGroup, tiny_chat_model_dir: Path) -> None:
    pytest.importorskip("llguidance")
    schema = {"type": "object",
              "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99},
                             "kind": {"enum": ["alpha", "beta"]}},
              "required": ["id", "kind"], "additionalProperties": False}
    params = [SamplingParams(temperature=t, seed=s, max_tokens=40,
                             structured_outputs=StructuredOutputsParams(json=schema))
              for t, s in ((0, None), (1.0, 1), (0.8, 2))]
    params.append(SamplingParams(temperature=1.0, seed=3, max_tokens=10,
                                 structured_outputs=StructuredOutputsParams(
                                     choice=["red", "green", "blue"])))
    with _Pair(group, tiny_chat_model_dir) as pair:
        one, two = pair.both(["Give me JSON:"] * len(params), params)
        assert [[c.text for c in o.outputs] for o in two] == [
            [c.text for c in o.outputs] for o in one]
        for out in two[:3]:
            assert set(json.loads(out.outputs[0].text)) == {"id", "kind"}
        assert two[3].outputs[0].text in ("red", "green", "blue")


def test_heads_that_do_not_split_are_refused_before_any_rank_starts(
        tiny_llama_dir: Path) -> None:
    with pytest.raises(TensorParallelConfigError,
                       match="tensor_parallel_size=3 must divide num_attention_heads=4"):
        LLM(str(tiny_llama_dir), tensor_parallel_size=3, **BASE)
