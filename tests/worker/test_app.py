"""Engine construction at the worker's edge (qworker/worker/app.py)."""

from __future__ import annotations

import pytest

pytest.importorskip("pydantic_settings")

from qworker.config import WorkerSettings
from qworker.worker.app import build_engine


def test_echo_engine_reports_the_served_model_name() -> None:
    assert build_engine(WorkerSettings(model="echo://")).model_name == "echo"
    named = build_engine(WorkerSettings(model="echo://", served_model_name="my-model"))
    assert named.model_name == "my-model"
