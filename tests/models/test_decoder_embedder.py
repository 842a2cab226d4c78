"""Decoders as embedding models: the Llama-family stack without its LM head, causal
attention within each packed input, pooled as transformers' hidden states say."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from qworker.models.embedding_loader import resolve_task
from tests.fixtures.models import make_tiny_model_dir
from tests.models.embedding_dirs import (
    ATOL,
    add_sentence_transformers_modules,
    embed_requests,
    embedding_engine,
    make_embedding_dir,
    random_inputs,
    reference_vectors,
)


@pytest.mark.parametrize("kind", ["qwen3", "llama", "mistral"])
def test_decoder_backbone_pools_the_last_token_normalized_by_default(
        kind: str, tmp_path: Path) -> None:
    # mistral: a 7-token sliding window, shorter than most inputs here
    path = make_embedding_dir(kind, tmp_path / kind)
    assert resolve_task("auto", path) == "embed"  # a *Model class has no LM head
    engine = embedding_engine(path, max_num_batched_tokens=48)
    assert engine.embedding_dim == 64
    inputs = random_inputs([5, 31, 12, 1, 40, 9], seed=7)
    got, steps = embed_requests(engine, [inputs[:3], inputs[3:5], inputs[5:]])
    assert steps >= 3
    want = reference_vectors(path, inputs, ["lasttoken"], normalize=True)
    torch.testing.assert_close(torch.cat(got), want, atol=ATOL, rtol=0)


def test_causal_lm_in_a_sentence_transformers_folder_embeds_with_its_pooling(
        tmp_path: Path) -> None:
    import transformers

    path = make_tiny_model_dir("qwen3", tmp_path / "q3", seed=8)
    assert resolve_task("auto", path) == "generate"
    add_sentence_transformers_modules(path, ["mean"], normalize=False, max_seq_length=100)
    assert resolve_task("auto", path) == "embed"  # the Pooling module decides
    engine = embedding_engine(path, task="auto")
    assert engine.max_model_len == 100
    inputs = random_inputs([7, 22, 3], seed=8)
    got, _ = embed_requests(engine, [inputs])
    lm = transformers.AutoModelForCausalLM.from_pretrained(str(path)).eval()
    with torch.no_grad():
        want = torch.stack([lm.model(input_ids=torch.tensor([ids])).last_hidden_state[0].mean(0)
                            for ids in inputs])
    torch.testing.assert_close(got[0], want, atol=ATOL, rtol=0)
