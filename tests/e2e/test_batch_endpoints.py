"""Issue 20, end to end: embeddings, responses and cancel through the real CLI.

Every step is a ``python -m qworker`` subprocess against real servers (the session's tansu
Kafka broker and moto S3/SQS): ``produce`` -> Kafka or SQS -> ``qworker run`` (the echo
engines stand in for the models) -> ``status`` -> ``collect``, and the same files through
``qworker generate``. Every result line validates with the openai SDK's types
(``tests/schema/openai_types.py``), every ``status`` as the SDK's ``Batch``.

The echo engine ignores structured-output constraints (it echoes the prompt), so the
``text.format: json_object`` job below proves the format is accepted and echoed in the
``Response``, not that the text is JSON (the real engine's constraint is tested in
``tests/worker/test_generate_structured.py``).
"""

from __future__ import annotations

import base64
import json
import math
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("aiokafka")
pytest.importorskip("boto3")

from tests.fixtures.servers import QueueInfo, free_port, running
from tests.schema.openai_types import validate_batch, validate_line

ROOT = Path(__file__).resolve().parents[2]
EMBED_MODEL = "text-embedding-3-small"
CHAT_MODEL = "gpt-4.1-mini"


def _embedding_jobs() -> list[dict[str, Any]]:
    """Embedding lines as OpenAI's docs write them: one good line per input form, one bad
    input, one line naming a model this worker does not serve."""

    def job(cid: str, **body: Any) -> dict[str, Any]:
        return {"custom_id": cid, "method": "POST", "url": "/v1/embeddings",
                "body": {"model": EMBED_MODEL, **body}}

    return [
        job("emb-str", input="The food was delicious and the waiter...",
            encoding_format="float"),
        job("emb-list", input=["The food was delicious", "The service was slow"]),
        job("emb-ids", input=[[72, 101, 108, 108, 111], [119, 111, 114, 108, 100]]),
        job("emb-b64", input="base64 please", encoding_format="base64", dimensions=4),
        job("emb-empty", input=["fine", ""]),
        {**job("emb-other", input="wrong model"),
         "body": {"model": "text-embedding-3-large", "input": "wrong model"}},
    ]


EMBED_ERRORS = {"emb-empty": ("400", "invalid_request", "input[1]"),
                "emb-other": ("404", "model_not_found", "model")}


def _response_jobs() -> list[dict[str, Any]]:
    """Responses lines as OpenAI's docs write them, and one with a Chat Completions field."""

    def job(cid: str, **body: Any) -> dict[str, Any]:
        return {"custom_id": cid, "method": "POST", "url": "/v1/responses",
                "body": {"model": CHAT_MODEL, **body}}

    return [
        job("resp-str", input="Tell me a three sentence bedtime story about a unicorn."),
        job("resp-parts", instructions="Answer in one word.", max_output_tokens=16,
            temperature=0, metadata={"k": "v"},
            input=[{"role": "user", "content": [
                {"type": "input_text", "text": "What is the capital of France?"}]}]),
        job("resp-json", text={"format": {"type": "json_object"}},
            input=[{"type": "message", "role": "developer", "content": "Reply in JSON."},
                   {"role": "user", "content": '{"a": 1}'}]),
        job("resp-bad", input="hi", max_tokens=5),
    ]


RESPONSE_ERRORS = {"resp-bad": ("400", "invalid_request", "max_tokens")}


def _chat_job(cid: str, text: str, model: str = CHAT_MODEL) -> dict[str, Any]:
    return {"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": model, "messages": [{"role": "user", "content": text}],
                     "max_tokens": 8, "temperature": 0}}


def _write(path: Path, jobs: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(j) + "\n" for j in jobs))
    return path


def _read(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _env(aws_env: dict[str, str], tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {**aws_env, "PYTHONPATH": str(ROOT), "QWORKER_METRICS_PORT": "0",
           "QWORKER_SPOT_METADATA_URL": "", "QWORKER_KAFKA_SESSION_TIMEOUT_MS": "3000",
           "QWORKER_KAFKA_COMMIT_INTERVAL_SECONDS": "0.2",
           "XDG_CACHE_HOME": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    env.update(extra)
    return env


def _qworker(*args: str, env: dict[str, str], timeout: float = 60) -> str:
    """Run one CLI command; assert it exits 0; return its stdout."""
    done = subprocess.run([sys.executable, "-m", "qworker", *args], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"qworker {args[0]}: {done.stderr[-3000:]}"
    return done.stdout


def _run(source: str, sink: str, model: str, name: str, until_idle: float = 1) -> list[str]:
    return [sys.executable, "-m", "qworker", "run", "--source", source, "--sink", sink,
            "--model", model, "--served-model-name", name, "--until-idle", str(until_idle)]


def _serve(cmd: list[str], env: dict[str, str], log: Path) -> None:
    """Run a worker until it is idle; assert it exited 0."""
    with running(cmd, env, log) as proc:
        assert proc.wait(timeout=90) == 0, log.read_text()[-3000:]


def _status(sink: str, batch: str, env: dict[str, str]) -> dict[str, Any]:
    status = json.loads(_qworker("status", "--from", sink, "--batch-id", batch, "--no-cache",
                                 env=env))
    validate_batch(status)
    # one timeline (every worker here starts after produce has sent the whole batch)
    assert status["in_progress_at"] >= status["created_at"]
    for end in ("completed_at", "cancelled_at"):
        assert status[end] is None or status[end] >= status["in_progress_at"], status
    assert (status["conflicts"], status["unexpected"]) == (0, 0)
    if status["status"] in ("completed", "cancelled"):
        assert status["missing_count"] == 0 and status["missing"] == []
    return status


def _collect(sink: str, batch: str, tmp_path: Path, env: dict[str, str]
             ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """``collect`` into ``<batch>.results.jsonl`` / ``<batch>.errors.jsonl``; every line of
    both validated; the files' lines returned."""
    out, errs = tmp_path / f"{batch}.results.jsonl", tmp_path / f"{batch}.errors.jsonl"
    _qworker("collect", "--from", sink, "--batch-id", batch, "-o", str(out), "--errors",
             str(errs), env=env)
    results, errors = _read(out), _read(errs)
    for line in results + errors:
        validate_line(line)
        assert line["batch_id"] == batch
    return results, errors


def _error(line: dict[str, Any]) -> tuple[str, str, str | None]:
    """A 4xx line's (status, code, param)."""
    body = line["response"]["body"]["error"]
    return str(line["response"]["status_code"]), body["code"], body["param"]


def _usage_of(lines: list[dict[str, Any]]) -> tuple[int, int, int]:
    """(input, output, total) tokens summed from served lines, whatever their kind."""
    inp = out = total = 0
    for line in lines:
        usage = line["response"]["body"]["usage"]
        inp += usage.get("input_tokens", usage.get("prompt_tokens", 0))
        out += usage.get("output_tokens", usage.get("completion_tokens", 0))
        total += usage["total_tokens"]
    return inp, out, total


def _assert_usage(status: dict[str, Any], served: list[dict[str, Any]]) -> None:
    inp, out, total = _usage_of(served)
    assert inp > 0 and total == inp + out
    assert status["usage"] == {
        "input_tokens": inp, "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": out, "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": total}


def _check_embeddings(lines: list[dict[str, Any]]) -> None:
    """The served embedding lines (in input order) hold what their requests asked for."""
    by_id = {line["custom_id"]: line for line in lines}
    assert list(by_id) == ["emb-str", "emb-list", "emb-ids", "emb-b64"]
    for line in lines:
        assert validate_line(line) == "embedding"
        body = line["response"]["body"]
        assert body["model"] == EMBED_MODEL
        assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] > 0
    counts = {cid: len(line["response"]["body"]["data"]) for cid, line in by_id.items()}
    assert counts == {"emb-str": 1, "emb-list": 2, "emb-ids": 2, "emb-b64": 1}
    assert by_id["emb-ids"]["response"]["body"]["usage"]["prompt_tokens"] == 10
    for cid in ("emb-str", "emb-list", "emb-ids"):
        data = by_id[cid]["response"]["body"]["data"]
        assert [d["index"] for d in data] == list(range(len(data)))
        for d in data:
            assert len(d["embedding"]) == 8
            assert math.isclose(math.hypot(*d["embedding"]), 1.0, rel_tol=1e-5)
    encoded = by_id["emb-b64"]["response"]["body"]["data"][0]["embedding"]
    assert isinstance(encoded, str)
    import numpy as np

    vector = np.frombuffer(base64.b64decode(encoded), dtype="<f4")
    assert vector.shape == (4,) and math.isclose(float(np.linalg.norm(vector)), 1.0,
                                                 rel_tol=1e-5)


def _check_responses(lines: list[dict[str, Any]]) -> None:
    """The served responses lines (in input order) are the ``Response`` their requests ask."""
    by_id = {line["custom_id"]: line["response"]["body"] for line in lines}
    assert list(by_id) == ["resp-str", "resp-parts", "resp-json"]
    for line in lines:
        assert validate_line(line) == "response"
        body = line["response"]["body"]
        assert body["model"] == CHAT_MODEL
        assert body["id"] == "resp_" + line["response"]["request_id"].removeprefix("req_")
        usage = body["usage"]
        assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    text = {cid: body["output"][0]["content"][0]["text"] for cid, body in by_id.items()}
    # the echo engine answers with its prompt: a string input is one user message
    assert text["resp-str"] == (
        "user: Tell me a three sentence bedtime story about a unicorn.\n")
    parts = by_id["resp-parts"]
    assert parts["instructions"] == "Answer in one word." and parts["max_output_tokens"] == 16
    assert parts["metadata"] == {"k": "v"}
    # instructions come first as a system message; 16 output tokens cut it short
    assert text["resp-parts"] == "system: Answer i"
    assert parts["usage"]["output_tokens"] == 16
    assert parts["status"] == "incomplete"
    assert parts["incomplete_details"] == {"reason": "max_output_tokens"}
    assert by_id["resp-json"]["text"]["format"] == {"type": "json_object"}
    assert by_id["resp-json"]["status"] == "completed"


# ------------------------------------------------------------------------- 1: embeddings


def test_an_embeddings_batch_over_kafka_to_status_and_collect(
    tmp_path: Path, kafka_broker: str, kafka_topic: Callable[..., str], s3_bucket: str,
    aws_env: dict[str, str],
) -> None:
    env = _env(aws_env, tmp_path)
    source = f"kafka://{kafka_broker}/{kafka_topic(2)}?group=embed"
    sink = f"s3://{s3_bucket}/out"
    jobs = _write(tmp_path / "embeddings.jsonl", _embedding_jobs())
    batch = _qworker("produce", "-i", str(jobs), "--to", source, "--results", sink,
                     env=env).strip()
    assert batch.startswith("batch_")
    assert _status(sink, batch, env)["status"] == "in_progress"

    served_from = int(time.time())
    _serve(_run(source, sink, "echo://?task=embed&dim=8", EMBED_MODEL), env,
           tmp_path / "worker.log")

    status = _status(sink, batch, env)
    assert status["status"] == "completed" and status["endpoint"] == "/v1/embeddings"
    assert status["request_counts"] == {"total": 6, "completed": 4, "failed": 2}
    assert status["output_file_id"] is None and status["error_file_id"] is None
    # the batch completed when its last line was written, not when it was created
    assert status["completed_at"] >= served_from > status["created_at"]
    results, errors = _collect(sink, batch, tmp_path, env)
    _check_embeddings(results)
    assert {e["custom_id"]: _error(e) for e in errors} == EMBED_ERRORS
    for line in results:
        assert line["response"]["body"]["usage"]["prompt_tokens"] > 0
    status = _status(sink, batch, env)
    _assert_usage(status, results)
    assert status["usage"]["output_tokens"] == 0
    assert status["output_file_id"] == str(tmp_path / f"{batch}.results.jsonl")
    assert status["error_file_id"] == str(tmp_path / f"{batch}.errors.jsonl")


# -------------------------------------------------------------------------- 2: responses


def test_a_responses_batch_over_sqs_to_status_and_collect(
    tmp_path: Path, sqs_queue: Callable[..., QueueInfo], s3_bucket: str,
    aws_env: dict[str, str],
) -> None:
    env = _env(aws_env, tmp_path)
    source = f"sqs://{sqs_queue().url}"
    sink = f"s3://{s3_bucket}/out"
    jobs = _write(tmp_path / "responses.jsonl", _response_jobs())
    _qworker("produce", "-i", str(jobs), "--to", source, "--batch-id", "resp", "--results",
             sink, env=env)

    _serve(_run(source, sink, "echo://", CHAT_MODEL), env, tmp_path / "worker.log")

    status = _status(sink, "resp", env)
    assert status["status"] == "completed" and status["endpoint"] == "/v1/responses"
    assert status["request_counts"] == {"total": 4, "completed": 3, "failed": 1}
    results, errors = _collect(sink, "resp", tmp_path, env)
    _check_responses(results)
    assert {e["custom_id"]: _error(e) for e in errors} == RESPONSE_ERRORS
    status = _status(sink, "resp", env)
    _assert_usage(status, results)
    assert status["output_file_id"] == str(tmp_path / "resp.results.jsonl")


# ----------------------------------------------------------------------------- 3: cancel


def _gauge(port: int, name: str) -> float:
    """The value of an unlabelled-or-single-series gauge on the worker's /metrics (0 when
    the server is not up yet)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=1) as page:
            text = page.read().decode()
    except OSError:
        return 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_a_kafka_batch_cancelled_mid_run_through_the_cli(
    tmp_path: Path, kafka_broker: str, kafka_topic: Callable[..., str], s3_bucket: str,
    aws_env: dict[str, str],
) -> None:
    port = free_port()
    # ~4 s per job in the engine, and the small KV pool admits ~3 at a time: a cancel just
    # after A's first jobs reach the engine finds them generating and the rest waiting
    env = _env(aws_env, tmp_path, QWORKER_METRICS_PORT=str(port),
               QWORKER_CANCEL_CHECK_SECONDS="0.2", QWORKER_MAX_INFLIGHT_JOBS="6")
    model = "echo://?delay_ms=100&steps=40&num_kv_blocks=8"
    source = f"kafka://{kafka_broker}/{kafka_topic(1)}?group=cancel"
    sink = f"s3://{s3_bucket}/out"
    ids = {"A": [f"A-{i}" for i in range(8)], "B": [f"B-{i}" for i in range(3)]}
    for batch, cids in ids.items():  # A's jobs first in the partition, then B's
        jobs = _write(tmp_path / f"{batch}.jsonl",
                      [_chat_job(cid, f"prompt {cid}", model="echo") for cid in cids])
        _qworker("produce", "-i", str(jobs), "--to", source, "--batch-id", batch,
                 "--results", sink, env=env)

    log = tmp_path / "worker.log"
    with running(_run(source, sink, model, "echo", until_idle=1), env, log) as proc:
        deadline = time.monotonic() + 60
        while _gauge(port, "qworker_num_requests_running") == 0:
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.05)
        generating = _gauge(port, "qworker_num_requests_running")
        cancel = json.loads(_qworker("cancel", "--from", sink, "--batch-id", "A", env=env))
        assert cancel["id"] == "A" and cancel["already_cancelled"] is False
        status = _status(sink, "A", env)
        assert status["status"] == "cancelling"
        assert status["cancelling_at"] == cancel["cancelling_at"]
        assert proc.wait(timeout=90) == 0, log.read_text()[-3000:]

    outcomes: dict[str, dict[str, str]] = {}
    for batch in ids:
        results, errors = _collect(sink, batch, tmp_path, env)
        assert sorted(r["custom_id"] for r in results + errors) == sorted(ids[batch])
        outcomes[batch] = {r["custom_id"]: validate_line(r) for r in results + errors}
    assert set(outcomes["B"].values()) == {"chat"}
    a = list(outcomes["A"].values())
    assert set(a) == {"chat", "cancelled"}
    # the jobs generating when the cancel came finished (more may have entered meanwhile)
    assert a.count("chat") >= generating >= 1
    status = _status(sink, "A", env)
    assert status["status"] == "cancelled"
    assert status["cancelled_at"] >= status["cancelling_at"] == cancel["cancelling_at"]
    assert status["request_counts"] == {"total": 8, "completed": a.count("chat"),
                                        "failed": a.count("cancelled")}
    assert _status(sink, "B", env)["status"] == "completed"
    again = json.loads(_qworker("cancel", "--from", sink, "--batch-id", "A", env=env))
    assert again["already_cancelled"] is True


# ------------------------------------------------------------------- 4: generate offline


def test_the_same_files_through_generate(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    embeddings = _write(tmp_path / "embeddings.jsonl", _embedding_jobs())
    _qworker("generate", "-i", str(embeddings), "-o", str(tmp_path / "emb.out.jsonl"),
             "--model", "echo://?task=embed&dim=8", "--served-model-name", EMBED_MODEL,
             env=env)
    lines = _read(tmp_path / "emb.out.jsonl")
    assert [x["custom_id"] for x in lines] == [j["custom_id"] for j in _embedding_jobs()]
    kinds = {x["custom_id"]: validate_line(x) for x in lines}
    _check_embeddings([x for x in lines if kinds[x["custom_id"]] == "embedding"])
    assert {x["custom_id"]: _error(x) for x in lines
            if kinds[x["custom_id"]] != "embedding"} == EMBED_ERRORS

    responses = _write(tmp_path / "responses.jsonl", _response_jobs())
    _qworker("generate", "-i", str(responses), "-o", str(tmp_path / "resp.out.jsonl"),
             "--model", "echo://", "--served-model-name", CHAT_MODEL, env=env)
    lines = _read(tmp_path / "resp.out.jsonl")
    assert [x["custom_id"] for x in lines] == [j["custom_id"] for j in _response_jobs()]
    kinds = {x["custom_id"]: validate_line(x) for x in lines}
    _check_responses([x for x in lines if kinds[x["custom_id"]] == "response"])
    assert {x["custom_id"]: _error(x) for x in lines
            if kinds[x["custom_id"]] != "response"} == RESPONSE_ERRORS


# -------------------------------------------------------------------- 5: mismatched task


def _mixed_jobs() -> list[dict[str, Any]]:
    """Jobs of both tasks in one file: chat, embeddings, responses, embeddings, chat."""
    return [
        _chat_job("chat-0", "hello there", model="echo"),
        {"custom_id": "emb-0", "method": "POST", "url": "/v1/embeddings",
         "body": {"model": "echo", "input": "embed me"}},
        {"custom_id": "resp-0", "method": "POST", "url": "/v1/responses",
         "body": {"model": "echo", "input": "respond"}},
        {"custom_id": "emb-1", "method": "POST", "url": "/v1/embeddings",
         "body": {"model": "echo", "input": ["one", "two"]}},
        _chat_job("chat-1", "general kenobi", model="echo"),
    ]


MIXED_MODELS = {"gen": "echo://", "emb": "echo://?task=embed&dim=8"}
#: what each worker cannot serve, and the start of the 400 saying so
MIXED_REFUSED = {
    "gen": {"emb-0", "emb-1"},
    "emb": {"chat-0", "resp-0", "chat-1"},
}


def _refusal(url: str) -> str:
    if url == "/v1/embeddings":
        return ('url /v1/embeddings asks for embeddings, but this worker serves text '
                'generation (task "generate")')
    return f'url {url} asks for text generation, but this worker serves embeddings (task "embed")'


def _check_mixed(worker: str, lines: list[dict[str, Any]]) -> None:
    """Each line of the mixed file from ``worker``: served, or the 400 naming its task."""
    urls = {j["custom_id"]: j["url"] for j in _mixed_jobs()}
    served = {"chat": "/v1/chat/completions", "response": "/v1/responses",
              "embedding": "/v1/embeddings"}
    assert sorted(x["custom_id"] for x in lines) == sorted(urls)
    for line in lines:
        cid, kind = line["custom_id"], validate_line(line)
        if cid in MIXED_REFUSED[worker]:
            assert _error(line) == ("400", "invalid_request", "url")
            assert line["response"]["body"]["error"]["message"].startswith(_refusal(urls[cid]))
        else:
            assert served[kind] == urls[cid], line


def test_a_job_for_the_other_task_is_a_400_naming_what_the_worker_serves(
    tmp_path: Path, sqs_queue: Callable[..., QueueInfo], s3_bucket: str,
    aws_env: dict[str, str],
) -> None:
    env = _env(aws_env, tmp_path)
    sink = f"s3://{s3_bucket}/out"
    jobs = _write(tmp_path / "mixed.jsonl", _mixed_jobs())
    sources = {batch: f"sqs://{sqs_queue().url}" for batch in MIXED_MODELS}
    for batch, source in sources.items():
        _qworker("produce", "-i", str(jobs), "--to", source, "--batch-id", batch,
                 "--results", sink, "--allow-mixed", env=env)
    # the generate worker and the embed worker serve their own queues side by side
    with (running(_run(sources["gen"], sink, MIXED_MODELS["gen"], "echo"), env,
                  tmp_path / "gen.log") as gen,
          running(_run(sources["emb"], sink, MIXED_MODELS["emb"], "echo"), env,
                  tmp_path / "emb.log") as emb):
        assert gen.wait(timeout=90) == 0, (tmp_path / "gen.log").read_text()[-3000:]
        assert emb.wait(timeout=90) == 0, (tmp_path / "emb.log").read_text()[-3000:]

    for batch in MIXED_MODELS:
        status = _status(sink, batch, env)
        refused = len(MIXED_REFUSED[batch])
        assert status["status"] == "completed" and status["endpoint"] == "mixed"
        assert status["request_counts"] == {"total": 5, "completed": 5 - refused,
                                            "failed": refused}
        results, errors = _collect(sink, batch, tmp_path, env)
        assert {e["custom_id"] for e in errors} == MIXED_REFUSED[batch]
        _check_mixed(batch, results + errors)
        _assert_usage(status, results)

    # and offline: the same file through generate with either engine
    for worker, model in MIXED_MODELS.items():
        out = tmp_path / f"{worker}.generate.jsonl"
        _qworker("generate", "-i", str(jobs), "-o", str(out), "--model", model, env=env)
        lines = _read(out)
        assert [x["custom_id"] for x in lines] == [j["custom_id"] for j in _mixed_jobs()]
        _check_mixed(worker, lines)
