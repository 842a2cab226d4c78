"""Tiny random embedding models saved as HF folders, and transformers' reference vectors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from qworker.engine.config import EngineConfig
from qworker.engine.embedding_engine import EmbeddingEngine

VOCAB = 512
#: fp32 parity with transformers' hidden states under the pooling rule.
ATOL = 1e-5

_CONFIGS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "bert": ("BertConfig", "BertModel", {
        "vocab_size": VOCAB, "hidden_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "intermediate_size": 128, "max_position_embeddings": 96,
        "type_vocab_size": 2, "hidden_act": "gelu"}),
    "xlm-roberta": ("XLMRobertaConfig", "XLMRobertaModel", {
        "vocab_size": VOCAB, "hidden_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "intermediate_size": 128, "max_position_embeddings": 66,
        "type_vocab_size": 1, "pad_token_id": 1, "bos_token_id": 0, "eos_token_id": 2}),
    "qwen3": ("Qwen3Config", "Qwen3Model", {
        "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "max_position_embeddings": 256, "rms_norm_eps": 1e-6}),
    "llama": ("LlamaConfig", "LlamaModel", {
        "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 256, "rms_norm_eps": 1e-5}),
    "mistral": ("MistralConfig", "MistralModel", {
        "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "sliding_window": 7}),
}


def embedding_engine(path: Path, **kwargs: object) -> EmbeddingEngine:
    """An fp32 CPU ``EmbeddingEngine`` on ``path`` (task ``embed`` unless given)."""
    kwargs.setdefault("task", "embed")
    return EmbeddingEngine(EngineConfig(model=str(path), dtype="float32", device="cpu",
                                        **kwargs))  # type: ignore[arg-type]


def make_embedding_dir(kind: str, path: Path, model_class: str | None = None, seed: int = 0,
                       **overrides: Any) -> Path:
    """Save a seeded random ``kind`` model (``model_class``: another transformers class of
    it, e.g. ``BertForMaskedLM``) as fp32 safetensors in ``path``; returns ``path``."""
    import transformers

    config_class, default_class, base = _CONFIGS[kind]
    config = getattr(transformers, config_class)(**{**base, "initializer_range": 0.2,
                                                    **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, model_class or default_class)(config).float()
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    return path


def add_sentence_transformers_modules(path: Path, modes: list[str], normalize: bool,
                                      max_seq_length: int | None = None,
                                      hidden: int = 64) -> Path:
    """Make ``path`` a sentence-transformers folder: Transformer, Pooling of ``modes``
    (cls, mean, max, lasttoken), optionally Normalize and ``max_seq_length``."""
    modules = [{"idx": 0, "name": "0", "path": "",
                "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling",
                "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize",
                        "type": "sentence_transformers.models.Normalize"})
    (path / "modules.json").write_text(json.dumps(modules))
    flags = {"cls": "pooling_mode_cls_token", "mean": "pooling_mode_mean_tokens",
             "max": "pooling_mode_max_tokens", "lasttoken": "pooling_mode_lasttoken"}
    pooling = {"word_embedding_dimension": hidden, **{f: m in modes for m, f in flags.items()}}
    (path / "1_Pooling").mkdir(exist_ok=True)
    (path / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    if max_seq_length is not None:
        (path / "sentence_bert_config.json").write_text(
            json.dumps({"max_seq_length": max_seq_length, "do_lower_case": False}))
    return path


def reference_hidden(path: Path, inputs: list[list[int]]) -> list[torch.Tensor]:
    """transformers' final hidden states ``[len, hidden]`` of each input, one at a time."""
    import transformers

    model = transformers.AutoModel.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        return [model(input_ids=torch.tensor([ids])).last_hidden_state[0] for ids in inputs]


def reference_vectors(path: Path, inputs: list[list[int]], modes: list[str],
                      normalize: bool) -> torch.Tensor:
    """Pooled reference vectors ``[n, dim]`` by sentence-transformers' rules."""
    rows = []
    for states in reference_hidden(path, inputs):
        parts = {"cls": states[0], "lasttoken": states[-1], "mean": states.mean(0),
                 "max": states.max(0).values}
        rows.append(torch.cat([parts[m] for m in ("cls", "max", "mean", "lasttoken")
                               if m in modes]))
    out = torch.stack(rows)
    return F.normalize(out, dim=-1) if normalize else out


def random_inputs(lengths: list[int], seed: int = 0, low: int = 3) -> list[list[int]]:
    """Token-id inputs of the given lengths (ids in ``[low, VOCAB)``)."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(low, VOCAB, (n,), generator=gen).tolist() for n in lengths]


def embed_requests(engine: EmbeddingEngine, requests: list[list[list[int]]],
                   dimensions: int | None = None) -> tuple[list[torch.Tensor], int]:
    """Every request's vectors (in request order) and the steps it took."""
    for i, inputs in enumerate(requests):
        engine.add_embedding(f"r{i}", inputs, dimensions)
    outs, steps = {}, 0
    while engine.has_unfinished():
        for out in engine.step():
            assert out.finished and out.outputs == [] and out.request_id not in outs
            outs[out.request_id] = out
        steps += 1
    for i, inputs in enumerate(requests):
        assert outs[f"r{i}"].prompt_token_ids == [t for ids in inputs for t in ids]
    return [torch.tensor(outs[f"r{i}"].embeddings) for i in range(len(requests))], steps
