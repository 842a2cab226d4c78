"""FP8 through the engine: greedy tokens of an FP8 checkpoint equal transformers' on the
decompressed model; the quantization knob's and unsupported methods' errors as users see them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from qworker.engine.llm import LLM
from qworker.engine.sampling_params import SamplingParams
from tests.engine.reference import hf_greedy, random_prompts
from tests.fixtures.models import make_tiny_model_dir
from tests.models.quant.checkpoints import write_compressed_tensors


def test_compressed_tensors_fp8_greedy_matches_transformers_through_the_engine(
    tmp_path: Path,
) -> None:
    dense = make_tiny_model_dir("qwen3", tmp_path / "dense", seed=51)
    fp8 = write_compressed_tensors(dense, tmp_path / "fp8", "FP8_DYNAMIC")
    llm = LLM(str(fp8), dtype="float32", device="cpu", num_kv_blocks=64, max_model_len=256,
              max_num_batched_tokens=16)
    prompts = random_prompts(5, 1, 30, seed=52)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    for prompt, out in zip(prompts, llm.generate(prompts, params, use_tqdm=False), strict=True):
        assert out.outputs[0].token_ids == hf_greedy(fp8, prompt, 6)


def test_an_unknown_quantization_value_names_the_knob(tiny_llama_dir: Path) -> None:
    with pytest.raises(ValueError, match="quantization must be 'auto', 'fp8' or 'none', "
                                         "got 'int4'"):
        LLM(str(tiny_llama_dir), device="cpu", quantization="int4")


def test_an_awq_checkpoint_stops_the_cli_with_one_line_naming_it(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]
                                                                 ) -> None:
    from qworker.cli import main

    model_dir = make_tiny_model_dir("llama", tmp_path / "awq", num_hidden_layers=1)
    config = json.loads((model_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": 128}
    (model_dir / "config.json").write_text(json.dumps(config))
    requests = tmp_path / "requests.jsonl"
    requests.write_text(json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/completions",
                                    "body": {"model": "awq", "prompt": "hi"}}) + "\n")
    code = main(["generate", "-i", str(requests), "-o", str(tmp_path / "out.jsonl"),
                 "--model", str(model_dir), "--device", "cpu"])
    err = capsys.readouterr().err
    assert code == 1
    assert "quant_method 'awq' is not supported" in err and "Traceback" not in err
