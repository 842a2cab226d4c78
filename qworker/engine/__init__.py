"""The engines: ``Engine`` generates, ``EmbeddingEngine`` embeds; ``open_engine`` picks.

Submodules import torch; this package's ``__init__`` imports nothing heavy itself.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from qworker.engine.config import EngineConfig
    from qworker.engine.embedding_engine import EmbeddingEngine
    from qworker.engine.engine import Engine


def open_engine(config: EngineConfig) -> Engine | EmbeddingEngine:
    """The engine ``config.task`` asks for: ``task="auto"`` is decided from the model
    folder (``qworker.models.embedding_loader.resolve_task``, docs/embeddings.md).

    ``ModelLoadError`` (a ValueError, one line naming the task) when the model cannot
    serve the task asked for.
    """
    from pathlib import Path

    from qworker.engine.config import check_knob
    from qworker.models.embedding_loader import resolve_task
    from qworker.models.sources import resolve_source

    task = check_knob("task", config.task)
    cache = Path(config.model_cache) if config.model_cache else None
    local = resolve_source(config.model, cache)
    task = resolve_task(task, local)
    if task == "embed":
        from qworker.engine.embedding_engine import EmbeddingEngine

        return EmbeddingEngine(config)
    from qworker.engine.engine import Engine

    return Engine(config)
