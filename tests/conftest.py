"""Shared test setup. Fixtures live in ``tests/fixtures/`` by concern:

- ``models``: tiny random model directories (HF safetensors) and the SmolLM2 GGUF;
- ``servers``: the tansu Kafka broker and moto's S3/SQS server on free loopback ports.

Fixtures that need worker-only packages (boto3, aiokafka, ...) import them lazily,
so ``python3 -m pytest -m gpu tests/`` runs on the GPU machine without them.
"""

from __future__ import annotations

import os

import pytest

# Two cores are shared by torch and the servers; keep torch from oversubscribing them.
os.environ.setdefault("OMP_NUM_THREADS", "2")

pytest_plugins = ["tests.fixtures.models", "tests.fixtures.servers"]


def pytest_configure(config: pytest.Config) -> None:
    """Record the AWS calls qworker's code makes this session (tests/fixtures/aws_recording.py)."""
    config.addinivalue_line(
        "markers", "runs_last: run after every other test (the session-wide AWS call check)")
    from tests.fixtures import aws_recording

    aws_recording.start()


def pytest_unconfigure(config: pytest.Config) -> None:
    """Remove the session's AWS call recording."""
    from tests.fixtures import aws_recording

    aws_recording.stop()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip ``gpu``-marked tests cleanly without CUDA; ``runs_last`` tests go last."""
    last = [item for item in items if "runs_last" in item.keywords]
    if last:
        items[:] = [item for item in items if "runs_last" not in item.keywords] + last
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        # the marker itself: "gpu" in item.keywords also matches a checkout folder named gpu
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)
