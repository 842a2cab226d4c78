"""One job's way into the engine (qworker/worker/requests.py), and what the worker does with it.

Regressions: the event loop tokenized each prompt twice (once to count, once inside
``add_request``); an over-long prompt waited at the admission gate for an idle engine
before the engine rejected it.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("orjson")
pytest.importorskip("pydantic_settings")

from qworker.config import WorkerSettings
from qworker.engine.sampling_params import SamplingParams
from qworker.schema import error_of
from qworker.worker.echo_engine import EchoEngine
from qworker.worker.requests import Prepared, Unserved, prepare
from qworker.worker.sinks.base import PutResult
from qworker.worker.sinks.file import FileSink
from qworker.worker.sources.file import FileSource
from qworker.worker.worker import Worker
from tests.worker.jobs import chat_job, completion_job, read_results, write_spool


class _Counting(EchoEngine):
    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.calls = {"encode_chat": 0, "validate_prompt": 0, "add_request": 0,
                      "add_validated": 0}

    def encode_chat(self, messages: list[dict]) -> list[int]:
        self.calls["encode_chat"] += 1
        return super().encode_chat(messages)

    def validate_prompt(self, prompt: str | list[int], params: SamplingParams) -> Any:
        self.calls["validate_prompt"] += 1
        return super().validate_prompt(prompt, params)

    def add_request(self, *args: Any, **kw: Any) -> None:
        self.calls["add_request"] += 1
        super().add_request(*args, **kw)

    def add_validated(self, *args: Any, **kw: Any) -> None:
        self.calls["add_validated"] += 1
        super().add_validated(*args, **kw)


def _body(job: dict[str, Any]) -> bytes:
    return json.dumps(job).encode()


def test_prepare_tokenizes_once_and_validates_against_the_engine() -> None:
    engine = _Counting(max_model_len=64)
    ok = prepare(engine, _body(chat_job("c1", "hello")), 1 << 20)
    assert isinstance(ok, Prepared) and ok.token_ids == list(b"user: hello\n")
    assert engine.calls["encode_chat"] == 1 and engine.calls["validate_prompt"] == 1
    long = prepare(engine, _body(completion_job("c2", "x" * 100)), 1 << 20)
    assert isinstance(long, Unserved) and long.code == "context_length_exceeded"
    assert error_of(long.record or {})["code"] == "context_length_exceeded"


def test_unbounded_logprobs_are_capped_by_the_context_left() -> None:
    job = chat_job("lp", "hi", logprobs=True, top_logprobs=20)
    del job["body"]["max_tokens"]
    small = prepare(EchoEngine(max_model_len=1024), _body(job), 1 << 20)
    assert isinstance(small, Prepared)  # at most ~1,000 tokens x 21
    huge = prepare(EchoEngine(max_model_len=131072), _body(job), 1 << 20)
    assert isinstance(huge, Unserved) and huge.code == "invalid_request"
    assert "log-probabilities" in (error_of(huge.record or {}) or {})["message"]


class _Order(FileSink):
    order: list[str]

    async def put(self, key: str, body: bytes, fingerprint: str | None = None) -> PutResult:
        self.order.append(key)
        return await super().put(key, body, fingerprint)


def test_the_worker_submits_validated_tokens_and_rejects_an_overlong_prompt_at_once(
    tmp_path: Path,
) -> None:
    # 8 blocks of 16 tokens: two 20-token jobs fill the pool for ~1 s, so a prompt that
    # needs 13 blocks could only be admitted into an idle engine.
    engine = _Counting(delay_ms=20, steps=50, num_kv_blocks=8, max_model_len=64)
    lines = [completion_job("slow1", "a" * 20), completion_job("slow2", "b" * 20),
             completion_job("too-long", "z" * 200)]
    spool = write_spool(tmp_path / "jobs.jsonl", lines)
    sink = _Order(tmp_path / "out")
    sink.order = []
    settings = WorkerSettings(source=f"file://{spool}", sink=f"file://{tmp_path}/out",
                              model="echo://", until_idle=0.3, metrics_port=0,
                              spot_metadata_url="", admission_buffer_blocks=0)

    async def main() -> float:
        started = time.monotonic()
        await asyncio.wait_for(Worker(settings, engine, FileSource(spool), sink).run(), 30)
        return time.monotonic() - started

    asyncio.run(main())
    results = read_results(tmp_path / "out")
    assert error_of(results["too-long"])["code"] == "context_length_exceeded"
    assert sink.order[0] == "default/too-long.json"  # before either slow job finished
    assert engine.calls["add_request"] == 0 and engine.calls["add_validated"] == 2
    assert engine.calls["validate_prompt"] == 3  # once per job, on the prep pool


# ------------------------------------------------ hostile JSON through the whole per-job path

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from qworker.engine.outputs import CompletionOutput, RequestOutput  # noqa: E402
from qworker.schema import dumps, result_key  # noqa: E402
from qworker.worker.dead_letters import dead_letter_record  # noqa: E402
from qworker.worker.requests import record_for  # noqa: E402
from qworker.worker.sources.base import Message  # noqa: E402

#: Where a job's JSON reaches, as a message template with one hole for a hostile value.
_PLACES = [
    '{{"custom_id":"h","url":"/v1/chat/completions","body":{{"messages":[{{"role":"user",'
    '"content":{v}}}]}}}}',
    '{{"custom_id":"h","url":"/v1/chat/completions","body":{{"messages":[{{"role":"user",'
    '"content":"hi"}}],"guided_json":{v}}}}}',
    '{{"custom_id":"h","url":"/v1/chat/completions","body":{{"messages":[{{"role":"user",'
    '"content":"hi"}}],"structured_outputs":{{"json":{v}}}}}}}',
    '{{"custom_id":"h","url":"/v1/chat/completions","body":{{"messages":[{{"role":"user",'
    '"content":"hi"}}],"response_format":{{"type":"json_schema","json_schema":{{"schema":{v}}}'
    '}}}}}}',
    '{{"custom_id":"h","url":"/v1/chat/completions","body":{{"messages":[{{"role":"user",'
    '"content":"hi"}}],"guided_choice":{v}}}}}',
    '{{"custom_id":"h","url":"/v1/chat/completions","body":{{"messages":[{{"role":"user",'
    '"content":"hi"}}],"logit_bias":{{"7":{v}}}}}}}',
    '{{"custom_id":"h","url":"/v1/completions","body":{{"prompt":{v},"stop":{v}}}}}',
    '{{"custom_id":"h","url":"/v1/completions","body":{{"prompt":"x","seed":{v},'
    '"temperature":{v}}}}}',
    '{{"custom_id":"h","url":"/v1/completions","body":{{"prompt":"x"}},"metadata":{{"m":{v}}}}}',
    '{{"custom_id":{v},"url":"/v1/completions","body":{{"prompt":"x"}}}}',
    '{{"custom_id":"h","batch_id":{v},"url":"/v1/completions","body":{{"prompt":"x"}}}}',
]


def _deep(depth: int, kind: str) -> str:
    if kind == "array":
        return "[" * depth + "]" * depth
    if kind == "object":
        return '{"a":' * depth + "1" + "}" * depth
    return json.dumps('{"a":' * depth + "1" + "}" * depth)  # deep JSON as text


_hostile_values = st.one_of(
    st.builds(_deep, st.integers(1, 1100), st.sampled_from(["array", "object", "text"])),
    st.sampled_from(["1e400", "-1e400", "123456789012345678901234567890", "1e-400",
                     "18446744073709551616", "-0", "0.0000000000000000000001"]),
    st.sampled_from(['"\\ud800"', '"\\udfff x"', '"\\u0000"', '"\\u202e txt"', '"😀' * 50 + '"',
                     '"' + "\\n" * 200 + '"', '"\\\\\\""', '""']),
    st.builds(lambda n, item: "[" + ",".join([item] * n) + "]", st.integers(0, 60_000),
              st.sampled_from(["0", '"a"', "[]", "{}", "null"])),
    st.text(max_size=40).map(json.dumps),
)


def _output(token_ids: list[int]) -> RequestOutput:
    text = bytes(token_ids[:8]).decode("utf-8", "replace")
    return RequestOutput(request_id="r", prompt=None, prompt_token_ids=token_ids,
                         outputs=[CompletionOutput(0, text, token_ids[:8], 0.0, None, "length")],
                         finished=True)


@settings(max_examples=80, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(place=st.sampled_from(_PLACES), value=_hostile_values)
def test_hostile_json_ends_in_one_outcome_through_the_whole_per_job_path_in_bounded_memory(
    place: str, value: str,
) -> None:
    import tracemalloc

    body = place.format(v=value).encode("utf-8", "surrogatepass")
    engine = EchoEngine(max_model_len=1 << 20)
    tracemalloc.start()
    try:
        outcome = prepare(engine, body, 1 << 20)  # never raises
        if isinstance(outcome, Prepared):
            job = outcome.job
            record = record_for(job, _output(outcome.token_ids), "echo", None)
            key = result_key("p", job.batch_id, job.custom_id)
            assert error_of(record) is None
        elif outcome.record is not None:
            record = outcome.record
            key = result_key("p", outcome.batch_id, outcome.custom_id or "")
            assert error_of(record) is not None and outcome.custom_id
        else:
            assert outcome.dead_letter
            msg = Message(body, "file:1", None, 1, 0.0)
            record = dead_letter_record(msg, outcome.dead_letter, FileSource(Path("x.jsonl")))
            key = "p/_dead_letters/x.json"
        line = dumps(record)  # every outcome's record serializes
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert key.startswith("p/") and len(line) < 8 * len(body) + (64 << 10)
    assert peak < 40 * len(body) + (8 << 20), f"{peak} bytes for a {len(body)}-byte message"
