"""The echo engine honours the Engine surface the worker relies on (echo_engine.py)."""

from __future__ import annotations

import pytest

from qworker.engine.sampling_params import SamplingParams
from qworker.errors import ContextLengthExceededError, InvalidRequestError
from qworker.worker.echo_engine import EchoEngine


def test_request_finishes_next_step_echoing_the_prompt() -> None:
    engine = EchoEngine()
    engine.add_request("r1", "héllo", SamplingParams(max_tokens=100, n=2))
    assert engine.has_unfinished()
    (out,) = engine.step()
    assert out.request_id == "r1" and out.finished
    assert [c.text for c in out.outputs] == ["héllo", "héllo"]
    assert out.outputs[0].finish_reason == "stop"
    assert not engine.has_unfinished()
    assert engine.stats()["generation_tokens"] == 12


def test_max_tokens_truncates_with_length_reason() -> None:
    engine = EchoEngine()
    engine.add_request("r", [104, 105, 106], SamplingParams(max_tokens=2))
    (out,) = engine.step()
    assert out.outputs[0].token_ids == [104, 105] and out.outputs[0].finish_reason == "length"


def test_validation_matches_the_engine_errors() -> None:
    engine = EchoEngine(max_model_len=8)
    with pytest.raises(ContextLengthExceededError):
        engine.add_request("a", "x" * 8, SamplingParams())
    with pytest.raises(InvalidRequestError, match="empty"):
        engine.add_request("b", [], SamplingParams())
    engine.add_request("c", "x", SamplingParams())
    with pytest.raises(InvalidRequestError, match="duplicate"):
        engine.add_request("c", "y", SamplingParams())


def test_abort_and_multi_step_requests() -> None:
    engine = EchoEngine.from_uri("echo://?steps=3&num_kv_blocks=10")
    engine.add_request("a", "x" * 40, SamplingParams())
    engine.add_request("b", "y", SamplingParams())
    assert engine.stats()["waiting_prompt_blocks"] == 4
    assert engine.step() == []
    stats = engine.stats()
    assert (stats["kv_blocks_used"], stats["num_free_blocks"]) == (4, 6)
    engine.abort("a")
    (out,) = engine.step()
    assert out.request_id == "a" and out.outputs[0].finish_reason == "abort"
    (out,) = engine.step()
    assert out.request_id == "b" and out.outputs[0].finish_reason == "stop"


def test_fault_options_for_the_campaign() -> None:
    engine = EchoEngine.from_uri("echo://?poison=BOOM&fail_rate=0&hang_after=0&seed=3")
    engine.add_request("ok", "fine", SamplingParams(max_tokens=4))
    assert [o.request_id for o in engine.step()] == ["ok"]
    engine.add_request("bad", "a BOOM here", SamplingParams(max_tokens=4))
    with pytest.raises(RuntimeError, match="poisoned"):
        engine.step()
    engine.abort("bad")
    assert [o.outputs[0].finish_reason for o in engine.step()] == ["abort"]
    flaky = EchoEngine(fail_rate=1.0, seed=1)
    flaky.add_request("x", "x", SamplingParams(max_tokens=1))
    with pytest.raises(RuntimeError, match="injected"):
        flaky.step()
