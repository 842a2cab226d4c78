"""The SmolLM2 GGUF through the paged path vs transformers' own GGUF loading."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from qworker.models.loader import load_model, load_tokenizer
from tests.models.paged import hf_reference, paged_vs_hf_max_diff

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2_gguf(smollm2_dir: Path) -> Path:
    return next(smollm2_dir.glob("*.gguf"))


def test_smollm2_gguf_logits_match_transformers(smollm2_gguf: Path, smollm2_hf_dir: Path) -> None:
    # The reference holds transformers' own dequantization of the same GGUF
    # (``smollm2_hf_dir`` is that, converted once and cached).
    loaded = load_model(smollm2_gguf.parent, torch.float32, "cpu")  # the folder form
    assert loaded.spec.architecture == "LlamaForCausalLM"
    assert loaded.spec.vocab_size == 49152
    assert loaded.gguf_file == smollm2_gguf.name
    assert loaded.spec.eos_token_ids == [2]
    assert loaded.source == smollm2_gguf
    tokenizer = load_tokenizer(loaded.source)
    assert tokenizer is not None
    prompts = [
        tokenizer.encode("The capital of France is"),
        tokenizer.encode("def fibonacci(n):\n    "),
    ]
    reference = hf_reference(smollm2_hf_dir)
    diff = paged_vs_hf_max_diff(loaded.model, reference, prompts, block_size=16, decode_steps=3)
    assert diff < 1e-3


def test_fast_and_legacy_gguf_readers_agree(smollm2_gguf: Path) -> None:
    import itertools

    from qworker.models.gguf import _fast_reader, load_gguf_config, load_gguf_tensors

    if _fast_reader() is None:
        pytest.skip("this transformers has no fast GGUF header reader")
    fast_config, fast_raw = load_gguf_config(smollm2_gguf)
    legacy_config, legacy_raw = load_gguf_config(smollm2_gguf, fast=False)
    assert fast_raw == legacy_raw
    assert fast_config.to_dict() == legacy_config.to_dict()
    # Embedding, a norm (f32) and layer 0's quantized, Q/K-permuted projections.
    fast = load_gguf_tensors(smollm2_gguf, fast_config, fast_raw, torch.float32)
    legacy = load_gguf_tensors(smollm2_gguf, legacy_config, legacy_raw, torch.float32, fast=False)
    for (fast_name, fast_t), (legacy_name, legacy_t) in itertools.islice(
        zip(fast, legacy, strict=True), 12
    ):
        assert fast_name == legacy_name
        assert torch.equal(fast_t, legacy_t)
