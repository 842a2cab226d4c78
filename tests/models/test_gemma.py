"""Gemma 2 / Gemma 3 over the paged KV cache vs transformers' own models, fp32 logits.

The tiny configs (``tests/fixtures/models.py``) have windows shorter than the prompts,
soft-caps small enough to change the logits (checked here against transformers itself),
a scale other than ``head_dim ** -0.5`` and, for Gemma 3, a different RoPE on the global
layer than on the local ones.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from qworker.attention.cpu_backend import CpuAttentionBackend
from qworker.attention.torch_ref import TorchAttentionBackend
from qworker.errors import ModelLoadError
from qworker.models.loader import load_model
from tests.fixtures.models import _BASE, make_tiny_model_dir
from tests.models.paged import PagedRunner, hf_reference, paged_vs_hf_max_diff, random_prompts

ATOL = 1e-4
PROMPT_LENGTHS = [5, 17, 33]
BACKENDS = {"torch": TorchAttentionBackend, "cpu": CpuAttentionBackend}


def _max_diff(model_dir: Path, **kwargs: Any) -> float:
    loaded = load_model(model_dir, torch.float32, "cpu")
    prompts = random_prompts(PROMPT_LENGTHS, loaded.spec.vocab_size)
    return paged_vs_hf_max_diff(loaded.model, hf_reference(model_dir), prompts, **kwargs)


@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize("fixture", ["tiny_gemma2_dir", "tiny_gemma3_dir"])
def test_paged_logits_match_transformers_with_windows_and_chunked_prefill(
    fixture: str, backend: str, request: pytest.FixtureRequest
) -> None:
    # chunks of 6 over blocks of 8: windows of 7 / 8 end mid-block and mid-chunk
    model_dir = request.getfixturevalue(fixture)
    assert _max_diff(model_dir, prefill_chunk=6, block_size=8, backend=BACKENDS[backend]()) < ATOL


def _hf_logits(model: Any, tokens: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([tokens])).logits[0].float()


@pytest.mark.parametrize(
    ("fixture", "changes"),
    [
        ("tiny_gemma2_dir", {"attn_logit_softcapping": None}),
        ("tiny_gemma2_dir", {"final_logit_softcapping": None}),
        ("tiny_gemma2_dir", {"sliding_window": 4096}),
        ("tiny_gemma3_dir", {"final_logit_softcapping": None}),
        ("tiny_gemma3_dir", {"sliding_window": 4096}),
    ],
)
def test_the_tiny_configs_caps_and_windows_change_transformers_logits(
    fixture: str, changes: dict[str, Any], request: pytest.FixtureRequest
) -> None:
    # Otherwise the parity above would not show that they are honoured.
    model = hf_reference(request.getfixturevalue(fixture))
    prompt = random_prompts([33], 512, seed=3)[0]
    before = _hf_logits(model, prompt)
    saved = {k: getattr(model.config, k) for k in changes}
    try:
        for key, value in changes.items():
            setattr(model.config, key, value)
            for layer in model.model.layers:
                attn = layer.self_attn
                if key == "attn_logit_softcapping":
                    attn.attn_logit_softcapping = value
                if key == "sliding_window" and attn.sliding_window is not None:
                    attn.sliding_window = value
        after = _hf_logits(model, prompt)
    finally:
        for key, value in saved.items():
            setattr(model.config, key, value)
    assert float((before - after).abs().max()) > 0.05


def test_spec_and_layers_follow_the_config(tiny_gemma2_dir: Path, tiny_gemma3_dir: Path) -> None:
    g2 = load_model(tiny_gemma2_dir, torch.float32, "cpu")
    layers = [layer.self_attn.attn for layer in g2.model.model.layers]
    assert [a.sliding_window for a in layers] == [8, None, 8, None]  # transformers' default
    assert {a.logits_soft_cap for a in layers} == {2.0}
    assert {a.scale for a in layers} == {24**-0.5}
    assert g2.spec.sliding_window is None and g2.spec.architecture == "Gemma2ForCausalLM"
    g3 = load_model(tiny_gemma3_dir, torch.float32, "cpu")
    layers = [layer.self_attn.attn for layer in g3.model.model.layers]
    assert [a.sliding_window for a in layers] == [7, 7, None, 7]
    assert {a.logits_soft_cap for a in layers} == {None}
    assert g3.spec.num_kv_heads == 1 and g3.spec.head_dim == 32


def _rewrite_config(model_dir: Path, edit: Any) -> None:
    path = model_dir / "config.json"
    config = json.loads(path.read_text())
    edit(config)
    path.write_text(json.dumps(config))


def test_gemma2_config_without_layer_types_alternates_like_transformers(tmp_path: Path) -> None:
    # transformers before layer_types wrote only sliding_window (every second layer global)
    model_dir = make_tiny_model_dir("gemma2", tmp_path / "m", seed=21)
    _rewrite_config(model_dir, lambda c: c.pop("layer_types"))
    reference = hf_reference(model_dir)
    loaded = load_model(model_dir, torch.float32, "cpu")
    ours = ["sliding_attention" if layer.self_attn.attn.sliding_window else "full_attention"
            for layer in loaded.model.model.layers]
    assert ours == reference.config.layer_types
    prompts = random_prompts(PROMPT_LENGTHS, 512)
    assert paged_vs_hf_max_diff(loaded.model, reference, prompts, prefill_chunk=7) < ATOL


def test_gemma3_config_in_the_older_form_gets_the_same_layers_and_ropes(tmp_path: Path) -> None:
    # Gemma 3 as first released: sliding_window_pattern, rope_theta + rope_scaling for the
    # global layers, rope_local_base_freq for the local ones.
    model_dir = make_tiny_model_dir("gemma3", tmp_path / "m", seed=22)

    def older(config: dict[str, Any]) -> None:
        config.pop("layer_types")
        config.pop("rope_parameters")
        config.update(sliding_window_pattern=2, rope_theta=500000.0, rope_local_base_freq=20000.0,
                      rope_scaling={"rope_type": "linear", "factor": 2.0})

    _rewrite_config(model_dir, older)
    reference = hf_reference(model_dir)
    assert reference.config.rope_parameters["sliding_attention"]["rope_theta"] == 20000.0
    loaded = load_model(model_dir, torch.float32, "cpu")
    windows = [layer.self_attn.attn.sliding_window for layer in loaded.model.model.layers]
    assert windows == [7 if t == "sliding_attention" else None
                       for t in reference.config.layer_types] == [7, None, 7, None]
    prompts = random_prompts(PROMPT_LENGTHS, 512)
    assert paged_vs_hf_max_diff(loaded.model, reference, prompts, prefill_chunk=5) < ATOL


def _tiny_multimodal_gemma3(path: Path) -> Path:
    """A Gemma3ForConditionalGeneration checkpoint: the tiny text model plus a 1-layer
    SigLIP tower (written as transformers writes it)."""
    import transformers

    text = {**_BASE["gemma3"], "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
            "initializer_range": 0.2}
    vision = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
              "num_attention_heads": 2, "image_size": 28, "patch_size": 14}
    config = transformers.Gemma3Config(text_config=text, vision_config=vision,
                                       mm_tokens_per_image=4, image_token_index=600,
                                       boi_token_index=510, eoi_token_index=511)
    torch.manual_seed(23)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(path)
    return path


@pytest.mark.parametrize("names", ["as-saved", "model.language_model"])
def test_multimodal_gemma3_checkpoint_serves_its_text_tower(tmp_path: Path, names: str) -> None:
    model_dir = _tiny_multimodal_gemma3(tmp_path / "mm")
    reference = hf_reference(model_dir)
    assert type(reference).__name__ == "Gemma3ForConditionalGeneration"
    if names == "model.language_model":  # the other naming transformers checkpoints use
        from safetensors.torch import load_file, save_file

        file = model_dir / "model.safetensors"
        tensors = load_file(file)
        renamed = {k.replace("language_model.model.", "model.language_model.")
                   .replace("vision_tower.", "model.vision_tower."): v
                   for k, v in tensors.items()}
        assert renamed.keys() != tensors.keys()
        save_file(renamed, file, metadata={"format": "pt"})
    loaded = load_model(model_dir, torch.float32, "cpu")
    assert loaded.spec.architecture == "Gemma3ForConditionalGeneration"
    assert loaded.spec.vocab_size == 512 and loaded.spec.num_layers == 4
    prompts = random_prompts(PROMPT_LENGTHS, 512)
    assert paged_vs_hf_max_diff(loaded.model, reference, prompts, prefill_chunk=6) < ATOL


def test_gemma3_attention_soft_cap_is_ignored_as_transformers_ignores_it(tmp_path: Path) -> None:
    model_dir = make_tiny_model_dir("gemma3", tmp_path / "m", seed=24, attn_logit_softcapping=0.5)
    loaded = load_model(model_dir, torch.float32, "cpu")
    assert {layer.self_attn.attn.logits_soft_cap for layer in loaded.model.model.layers} == {None}
    prompts = random_prompts(PROMPT_LENGTHS, 512)
    assert paged_vs_hf_max_diff(loaded.model, hf_reference(model_dir), prompts) < ATOL


@pytest.mark.parametrize(
    ("arch", "changes", "message"),
    [
        ("gemma3", {"use_bidirectional_attention": True}, "use_bidirectional_attention"),
        ("gemma2", {"final_logit_softcapping": -1.0}, "final_logit_softcapping"),
        ("gemma2", {"attn_logit_softcapping": 0}, "attn_logit_softcapping"),
    ],
)
def test_configs_it_cannot_serve_are_refused_naming_the_field(
    tmp_path: Path, arch: str, changes: dict[str, Any], message: str
) -> None:
    model_dir = make_tiny_model_dir(arch, tmp_path / "m")
    _rewrite_config(model_dir, lambda c: c.update(changes))
    with pytest.raises(ModelLoadError, match=message):
        load_model(model_dir, torch.float32, "cpu")


def test_unknown_layer_type_is_refused(tmp_path: Path) -> None:
    model_dir = make_tiny_model_dir("gemma2", tmp_path / "m")
    _rewrite_config(model_dir, lambda c: c.update(layer_types=["sliding_attention",
                                                               "chunked_attention",
                                                               "full_attention",
                                                               "full_attention"]))
    with pytest.raises(ModelLoadError, match="chunked_attention"):
        load_model(model_dir, torch.float32, "cpu")


def test_bfloat16_gemma_stays_close_to_transformers_in_bfloat16(tiny_gemma2_dir: Path) -> None:
    # The non-fp32 forms: (1 + w) norms in fp32 rounded once, the embedding scale rounded
    # to bf16 first; both as transformers computes them in bf16.
    import transformers

    ours = load_model(tiny_gemma2_dir, torch.bfloat16, "cpu").model
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        str(tiny_gemma2_dir), dtype=torch.bfloat16, attn_implementation="eager").eval()
    prompt = random_prompts([20], 512, seed=5)[0]
    got = PagedRunner(ours, block_size=8).step({0: prompt})[0]
    with torch.inference_mode():
        want = theirs(torch.tensor([prompt])).logits[0].float()
    assert float((got - want).abs().max()) < 0.05 * float(want.abs().max())
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() > 0.9


@pytest.mark.parametrize(("arch", "name"), [("gemma2", "Gemma2ForCausalLM"),
                                            ("phi3", "Phi3ForCausalLM")])
def test_gguf_of_these_architectures_is_refused(tmp_path: Path, arch: str, name: str) -> None:
    # their GGUF conversions (Gemma's norm offsets, Phi-3's fused tensors) are untested here
    import gguf
    import numpy as np

    path = tmp_path / f"{arch}.gguf"
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(2)
    writer.add_context_length(64)
    writer.add_embedding_length(16)
    writer.add_feed_forward_length(32)
    writer.add_head_count(2)
    writer.add_head_count_kv(1)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_tensor("token_embd.weight", np.zeros((32, 16), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match=f"{name} is not supported from GGUF"):
        load_model(path, torch.float32, "cpu")
