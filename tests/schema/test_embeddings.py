"""``/v1/embeddings`` jobs: parsing with OpenAI's rules, and CreateEmbeddingResponse lines.

Every refused body gets the exact message a user sees in the error line, with its
``param``; served lines validate as the openai SDK's ``CreateEmbeddingResponse``, and a
``base64`` vector decodes, as the SDK decodes it, to the float vector.
"""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("orjson")

from qworker.engine.outputs import RequestMetrics, RequestOutput
from qworker.errors import EngineError
from qworker.schema import JobKind, error_of, error_record_for, parse_job, success_record
from qworker.schema.embeddings import (
    EMBEDDING_UNSUPPORTED,
    MAX_EMBEDDING_INPUTS,
    embedding_body,
)
from qworker.worker.requests import record_for
from tests.schema.openai_types import validate_line

ROOT = Path(__file__).resolve().parents[2]


def _line(body: Any, **top: Any) -> bytes:
    return json.dumps({"custom_id": "e1", "method": "POST", "url": "/v1/embeddings",
                       "body": body, **top}).encode()


def _emb(**body: Any) -> bytes:
    return _line({"model": "m", **body})


@pytest.mark.parametrize(
    ("body", "inputs"),
    [
        ({"input": "The food was delicious"}, ["The food was delicious"]),
        ({"input": ["a", "bb", "ccc"]}, ["a", "bb", "ccc"]),
        ({"input": [1, 2, 3]}, [[1, 2, 3]]),
        ({"input": [[1, 2], [3], [0]]}, [[1, 2], [3], [0]]),
        ({"input": ["x"] * MAX_EMBEDDING_INPUTS}, ["x"] * MAX_EMBEDDING_INPUTS),
        ({"input": list(range(5000))}, [list(range(5000))]),  # one input: not an input count
    ],
)
def test_every_input_shape_openai_accepts_becomes_a_list_of_inputs(body: dict[str, Any],
                                                                   inputs: list[Any]) -> None:
    job = parse_job(_emb(**body)).job
    assert job is not None and job.kind is JobKind.EMBEDDING
    assert job.inputs == inputs
    assert (job.encoding_format, job.dimensions) == ("float", None)


def test_format_dimensions_user_and_unknown_fields() -> None:
    parsed = parse_job(_emb(input="hi", encoding_format="base64", dimensions=4, user="u-1",
                            frobnicate=3, encoding_format_extra=None))
    assert parsed.error is None and parsed.job is not None
    assert (parsed.job.encoding_format, parsed.job.dimensions) == ("base64", 4)
    explicit = parse_job(_emb(input="hi", encoding_format=None, dimensions=None, user=None,
                              truncate_prompt_tokens=None, normalize=None, messages=[],
                              embed_dtype="float32", add_special_tokens=True)).job
    assert explicit is not None and explicit.encoding_format == "float"


@pytest.mark.parametrize(
    ("raw", "message", "param"),
    [
        (_emb(), "body.input must be a string, a list of strings, a list of token ids or a "
         "list of token-id lists, got null", "input"),
        (_emb(input=7), "body.input must be a string, a list of strings, a list of token ids "
         "or a list of token-id lists, got a number 7", "input"),
        (_emb(input={"text": "hi"}), "body.input must be a string, a list of strings, a list "
         'of token ids or a list of token-id lists, got an object {"text":"hi"}', "input"),
        (_emb(input=""), "body.input must not be an empty string", "input"),
        (_emb(input=[]), "body.input must not be an empty list", "input"),
        (_emb(input=["a", ""]), "body.input[1] must not be an empty string", "input[1]"),
        (_emb(input=["a", 1]), "body.input[1] must be a string like the other inputs, got a "
         "number 1", "input[1]"),
        (_emb(input=["a", None]), "body.input[1] must be a string like the other inputs, got "
         "null", "input[1]"),
        (_emb(input=[1, "a"]), 'body.input[1] must be a token id (an integer >= 0), got "a"',
         "input[1]"),
        (_emb(input=[1, -2]), "body.input[1] must be a token id (an integer >= 0), got a "
         "number -2", "input[1]"),
        (_emb(input=[1, 2.5]), "body.input[1] must be a token id (an integer >= 0), got a "
         "number 2.5", "input[1]"),
        (_emb(input=[1, True]), "body.input[1] must be a token id (an integer >= 0), got a "
         "boolean true", "input[1]"),
        (_emb(input=[[1], []]), "body.input[1] must not be an empty list", "input[1]"),
        (_emb(input=[[1], [2, [3]]]), "body.input[1][1] must be a token id (an integer >= 0), "
         "got an array [3]", "input[1][1]"),
        (_emb(input=[[1], "a"]), 'body.input[1] must be a list of token ids like the other '
         'inputs, got "a"', "input[1]"),
        (_emb(input=[True]), "body.input[0] must be a string, a token id or a list of token "
         "ids, got a boolean true", "input[0]"),
        (_emb(input=[{"a": 1}]), "body.input[0] must be a string, a token id or a list of "
         'token ids, got an object {"a":1}', "input[0]"),
        (_emb(input=[None]), "body.input[0] must be a string, a token id or a list of token "
         "ids, got null", "input[0]"),
        (_emb(input=["x"] * (MAX_EMBEDDING_INPUTS + 1)),
         "body.input has 2049 inputs; at most 2048 are allowed", "input"),
        (_emb(input=[[1]] * (MAX_EMBEDDING_INPUTS + 1)),
         "body.input has 2049 inputs; at most 2048 are allowed", "input"),
        (_emb(input="x", encoding_format="int8"),
         'body.encoding_format must be "float" or "base64", got "int8"', "encoding_format"),
        (_emb(input="x", encoding_format=1),
         'body.encoding_format must be "float" or "base64", got a number 1', "encoding_format"),
        (_emb(input="x", dimensions=0), "body.dimensions must be a positive integer, got a "
         "number 0", "dimensions"),
        (_emb(input="x", dimensions=-3), "body.dimensions must be a positive integer, got a "
         "number -3", "dimensions"),
        (_emb(input="x", dimensions=2.0), "body.dimensions must be a positive integer, got a "
         "number 2.0", "dimensions"),
        (_emb(input="x", dimensions="8"), 'body.dimensions must be a positive integer, got "8"',
         "dimensions"),
        (_emb(input="x", dimensions=True), "body.dimensions must be a positive integer, got a "
         "boolean true", "dimensions"),
        (_emb(input="x", user=5), "body.user must be a string, got a number 5", "user"),
        (_emb(input="x", truncate_prompt_tokens=16),
         "body.truncate_prompt_tokens=16 is not supported by qworker for embeddings",
         "truncate_prompt_tokens"),
        (_emb(input="x", normalize=False),
         "body.normalize=false is not supported by qworker for embeddings", "normalize"),
        (_emb(messages=[{"role": "user", "content": "hi"}]),
         'body.messages=[{"role":"user","content":"hi"}] is not supported by qworker for '
         "embeddings", "messages"),
        (_emb(input="x", embed_dtype="float16"),
         'body.embed_dtype="float16" is not supported by qworker for embeddings', "embed_dtype"),
        (_emb(input="x", add_special_tokens=False),
         "body.add_special_tokens=false is not supported by qworker for embeddings",
         "add_special_tokens"),
        (_line([1]), "body must be an object, got an array [1]", "body"),
        (_emb(input=[[[[["deep"]]]]]), "body.input[0][0] must be a token id (an integer >= 0), "
         'got an array [[["deep"]]]', "input[0][0]"),
    ],
)
def test_a_bad_embedding_body_is_an_invalid_request_naming_the_field(
        raw: bytes, message: str, param: str) -> None:
    parsed = parse_job(raw)
    assert parsed.job is None and parsed.error is not None, parsed
    assert parsed.error.code == "invalid_request"
    assert str(parsed.error) == message
    line = error_record_for("e1", None, parsed.error)
    assert validate_line(line) == "400"
    assert error_of(line) == {"code": "invalid_request", "message": message,
                              "status_code": 400, "param": param}


def test_nesting_past_the_job_bound_is_refused_before_validation() -> None:
    deep: Any = [1]
    for _ in range(80):
        deep = [deep]
    parsed = parse_job(_emb(input=deep))
    assert parsed.error is not None and "nested deeper than 64 levels" in str(parsed.error)


def test_an_unknown_url_names_all_four_endpoints() -> None:
    parsed = parse_job(_line({"input": "x"}, url="/v1/moderations"))
    assert str(parsed.error) == ("url must be /v1/chat/completions, /v1/completions, "
                                 '/v1/responses or /v1/embeddings, got "/v1/moderations"')


# ------------------------------------------------------------------ records


def _output(vectors: list[list[float]] | None, tokens: int = 5) -> RequestOutput:
    return RequestOutput("r", None, list(range(tokens)), [], True,
                         RequestMetrics(arrival_time=0.0), embeddings=vectors)


VECTORS = [[0.1, -0.25, 3.0e-8, 0.5], [1.0, 0.0, -1.0, 0.333333343267]]


def test_float_record_is_a_create_embedding_response() -> None:
    job = parse_job(_emb(input=["a", "b"]), ).job
    assert job is not None
    job.metadata = {"k": "v"}
    line = success_record(job, _output(VECTORS), "all-MiniLM-L6-v2")
    assert validate_line(line) == "embedding"
    body = line["response"]["body"]
    assert body["model"] == "all-MiniLM-L6-v2" and line["metadata"] == {"k": "v"}
    assert body["usage"] == {"prompt_tokens": 5, "total_tokens": 5}
    assert [d["index"] for d in body["data"]] == [0, 1]
    assert [d["embedding"] for d in body["data"]] == VECTORS
    assert re.fullmatch(r"req_[0-9a-f]{32}", line["response"]["request_id"])


def test_base64_record_decodes_as_the_sdk_decodes_it() -> None:
    job = parse_job(_emb(input=["a", "b"], encoding_format="base64")).job
    assert job is not None
    line = json.loads(json.dumps(success_record(job, _output(VECTORS), "m")))
    assert validate_line(line) == "embedding"
    for item, vector in zip(line["response"]["body"]["data"], VECTORS, strict=True):
        assert isinstance(item["embedding"], str)
        # What openai-python does with encoding_format="base64":
        decoded = np.frombuffer(base64.b64decode(item["embedding"]), dtype="float32")
        assert decoded.tolist() == np.asarray(vector, dtype=np.float32).tolist()


@pytest.mark.parametrize(
    ("vectors", "message"),
    [
        (None, "the engine returned no embeddings for this request"),
        ([[0.1]], "the engine returned 1 embeddings for 2 inputs"),
        ([[0.1], [float("nan")]], "the engine returned a non-finite value in embedding 1"),
    ],
)
def test_a_broken_engine_answer_is_an_engine_error_not_a_bad_line(
        vectors: list[list[float]] | None, message: str) -> None:
    with pytest.raises(EngineError, match=re.escape(message)):
        embedding_body(_output(vectors), "m", "float", 2)


def test_an_aborted_embedding_request_is_an_engine_error_line() -> None:
    job = parse_job(_emb(input="x")).job
    assert job is not None
    line = record_for(job, _output(None), "m", None)
    assert validate_line(line) == "500"
    assert error_of(line)["message"] == "request aborted by the engine"


def test_formats_md_names_exactly_the_refused_embedding_fields() -> None:
    text = (ROOT / "docs" / "formats.md").read_text(encoding="utf-8")
    start = text.index("### Embedding jobs")
    paragraph = text[text.index("refused, each an `invalid_request`", start):
                     text.index("(each unless", text.index("refused, each", start))]
    assert set(re.findall(r"`(\w+)`", paragraph)) - {"invalid_request"} == set(
        EMBEDDING_UNSUPPORTED)


def test_the_example_file_holds_valid_embedding_jobs_of_every_shape() -> None:
    lines = (ROOT / "examples" / "embeddings.jsonl").read_bytes().splitlines()
    jobs = [parse_job(line).job for line in lines]
    assert all(job is not None and job.kind is JobKind.EMBEDDING for job in jobs)
    assert {job.encoding_format for job in jobs if job} == {"float", "base64"}
    assert any(job and job.dimensions for job in jobs)
    assert any(job and isinstance(job.inputs[0], list) for job in jobs if job and job.inputs)
