"""Rank 0's part of a tensor-parallel engine's setup (``engine_setup.build_engine_parts``).

Before anything is spawned the model is checked to split evenly (a one-line
``TensorParallelConfigError`` naming the field) and fetched once to a local path every
rank loads. Then the group is started (or a caller's reused) and told to build; rank 0
builds its own shard beside the others (``engine_setup.build_runner``) and, once every
follower reported ready, its runner ``lead``s.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

import torch

from qworker.engine.config import EngineConfig
from qworker.engine.parallel.launcher import TensorParallelGroup
from qworker.engine.parallel.runner import ParallelModelRunner

logger = logging.getLogger(__name__)


def tp_device(config: EngineConfig) -> torch.device:
    """Rank 0's device: the CPU, or ``cuda:0`` (rank ``r`` on ``cuda:r``; choose the GPUs
    with ``CUDA_VISIBLE_DEVICES``). Raises ``ValueError`` naming the field when the
    machine has too few GPUs."""
    n = config.tensor_parallel_size
    name = config.device
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cpu":
        return torch.device("cpu")
    if name not in ("cuda", "cuda:0"):
        raise ValueError(f"device={config.device!r}: with tensor_parallel_size > 1 rank r runs "
                         "on cuda:r; pick the GPUs with CUDA_VISIBLE_DEVICES")
    found = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if found < n:
        raise ValueError(f"tensor_parallel_size={n} needs {n} CUDA devices, this machine "
                         f"has {found}")
    return torch.device("cuda", 0)


def start_ranks(config: EngineConfig, group: TensorParallelGroup | None
                ) -> tuple[TensorParallelGroup, EngineConfig]:
    """Check the split, start (or take) the group and tell it to set up; returns the group
    and the config every rank builds from (the model at its local path)."""
    from qworker.models.loader import check_tensor_parallel

    n = config.tensor_parallel_size
    device = tp_device(config)
    cache = Path(config.model_cache) if config.model_cache else None
    local = check_tensor_parallel(config.model, n, cache_dir=cache,
                                  quantization=config.quantization)
    rank_config = dataclasses.replace(config, model=str(local))
    if group is None:
        group = TensorParallelGroup.start(n, device, config.tensor_parallel_timeout)
    elif group.world_size != n or group.rank0.device.type != device.type:
        raise ValueError(f"the tensor-parallel group given has {group.world_size} ranks on "
                         f"{group.rank0.device.type}; the engine asks for {n} on {device.type}")
    group.begin_setup(rank_config)
    return group, rank_config


def lead(built: Any, group: TensorParallelGroup, follower_bytes: list[int]) -> None:
    """Every rank is ready: rank 0's runner ships steps from now on."""
    runner = built.runner
    assert isinstance(runner, ParallelModelRunner)
    runner.lead(group)
    sizes = [built.weight_bytes, *follower_bytes]
    runner.weight_bytes_per_rank = sizes
    logger.info("tensor parallel: %d ranks ready; weights per rank %s MiB",
                group.world_size, ", ".join(f"{b / 2**20:.1f}" for b in sizes))
