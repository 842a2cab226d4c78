"""BERT-family encoders as embedding models: pooled vectors equal transformers' hidden
states under the pooling rule, however the inputs are packed into steps."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.models.embedding_dirs import (
    ATOL,
    add_sentence_transformers_modules,
    embed_requests,
    embedding_engine,
    make_embedding_dir,
    random_inputs,
    reference_vectors,
)


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_embedding_dir("bert", tmp_path_factory.mktemp("bert"))


def test_bert_without_modules_json_pools_cls_normalized_across_packed_steps(
        bert_dir: Path) -> None:
    engine = embedding_engine(bert_dir, max_num_batched_tokens=40)
    assert (engine.embedding_dim, engine.max_model_len) == (64, 96)
    inputs = random_inputs([3, 17, 9, 30, 50, 5, 1, 12])
    requests = [inputs[0:2], inputs[2:3], inputs[3:6], inputs[6:8]]
    got, steps = embed_requests(engine, requests)
    assert steps >= 4  # 40-token budget: 126 tokens, and the 50-token input runs alone
    want = reference_vectors(bert_dir, inputs, ["cls"], normalize=True)
    torch.testing.assert_close(torch.cat(got), want, atol=ATOL, rtol=0)
    assert engine.stats().prompt_tokens == sum(map(len, inputs))


def test_sentence_transformers_folder_concatenates_modes_and_caps_the_length(
        tmp_path: Path) -> None:
    path = make_embedding_dir("bert", tmp_path / "st", seed=1)
    add_sentence_transformers_modules(path, ["cls", "max", "mean"], normalize=True,
                                      max_seq_length=24)
    engine = embedding_engine(path)
    assert (engine.embedding_dim, engine.max_model_len) == (3 * 64, 24)
    inputs = random_inputs([24, 2, 11, 7], seed=2)
    got, steps = embed_requests(engine, [inputs])
    assert steps == 1
    want = reference_vectors(path, inputs, ["cls", "max", "mean"], normalize=True)
    torch.testing.assert_close(got[0], want, atol=ATOL, rtol=0)


def test_dimensions_truncate_then_renormalize(tmp_path: Path) -> None:
    path = add_sentence_transformers_modules(
        make_embedding_dir("bert", tmp_path / "m", seed=3), ["mean"], normalize=True)
    inputs = random_inputs([6, 13], seed=3)
    got, _ = embed_requests(embedding_engine(path), [inputs], dimensions=16)
    full = reference_vectors(path, inputs, ["mean"], normalize=True)
    want = torch.nn.functional.normalize(full[:, :16], dim=-1)
    assert got[0].shape == (2, 16)
    torch.testing.assert_close(got[0], want, atol=ATOL, rtol=0)


def test_unnormalized_mean_pooling_keeps_the_raw_vector_until_cut_to_dimensions(
        tmp_path: Path) -> None:
    path = add_sentence_transformers_modules(
        make_embedding_dir("bert", tmp_path / "m", seed=4), ["mean"], normalize=False)
    inputs = random_inputs([9, 4, 20], seed=4)
    engine = embedding_engine(path, max_num_batched_tokens=16)
    got, _ = embed_requests(engine, [inputs[:2], inputs[2:]])
    want = reference_vectors(path, inputs, ["mean"], normalize=False)
    torch.testing.assert_close(torch.cat(got), want, atol=ATOL, rtol=0)
    assert (want.norm(dim=-1) - 1).abs().min() > 0.01
    cut, _ = embed_requests(engine, [inputs], dimensions=8)  # cut vectors: unit length
    torch.testing.assert_close(cut[0], torch.nn.functional.normalize(want[:, :8], dim=-1),
                               atol=ATOL, rtol=0)


def test_masked_lm_checkpoint_loads_its_encoder(tmp_path: Path) -> None:
    import transformers

    path = make_embedding_dir("bert", tmp_path / "mlm", model_class="BertForMaskedLM", seed=5)
    inputs = random_inputs([8, 15], seed=5)
    got, _ = embed_requests(embedding_engine(path), [inputs])
    mlm = transformers.BertForMaskedLM.from_pretrained(str(path)).eval()
    with torch.no_grad():
        cls = torch.stack([mlm.bert(input_ids=torch.tensor([ids])).last_hidden_state[0, 0]
                           for ids in inputs])
    torch.testing.assert_close(got[0], torch.nn.functional.normalize(cls, dim=-1),
                               atol=ATOL, rtol=0)


def test_xlm_roberta_positions_start_after_the_padding_index(tmp_path: Path) -> None:
    path = add_sentence_transformers_modules(
        make_embedding_dir("xlm-roberta", tmp_path / "xlmr", seed=6), ["mean"], normalize=True)
    engine = embedding_engine(path, max_num_batched_tokens=64)
    assert engine.max_model_len == 66 - 2  # positions 0..1 belong to padding
    inputs = random_inputs([64, 5, 33, 12], seed=6)
    got, steps = embed_requests(engine, [inputs[:1], inputs[1:]])
    assert steps == 2
    want = reference_vectors(path, inputs, ["mean"], normalize=True)
    torch.testing.assert_close(torch.cat(got), want, atol=ATOL, rtol=0)
