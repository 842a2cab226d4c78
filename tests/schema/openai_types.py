"""Strict validation of result lines against the openai SDK's own types (test helper).

The SDK has models for the bodies (``ChatCompletion``, ``Completion``,
``CreateEmbeddingResponse``, ``ErrorObject``, ``BatchError``, ``Batch``) but none for the
output-line envelope, so the envelope is a small pydantic model of OpenAI's documented
batch output line. "Strict" means: every field validates against the SDK type, and no
field is unknown to it (a misspelled key or one in the wrong place fails), checked
recursively through ``model_extra``.
"""

from __future__ import annotations

from typing import Any

import pydantic
import pytest

openai = pytest.importorskip("openai")

from openai import BaseModel as SDKModel  # noqa: E402
from openai.types import (  # noqa: E402
    Batch,
    BatchError,
    Completion,
    CreateEmbeddingResponse,
    ErrorObject,
)
from openai.types.chat import ChatCompletion  # noqa: E402
from openai.types.responses import Response  # noqa: E402


class _Response(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    status_code: int
    request_id: str
    body: dict[str, Any]


class _Error(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    code: str
    message: str


class OutputLine(pydantic.BaseModel):
    """One line of an OpenAI batch output file, plus qworker's batch_id / metadata."""

    model_config = pydantic.ConfigDict(extra="forbid")
    id: str = pydantic.Field(pattern=r"^batch_req_[0-9a-f]{32}$")
    custom_id: str | None
    batch_id: str | None = None
    metadata: dict[str, Any] | None = None
    response: _Response | None
    error: _Error | None


def _no_extra(obj: Any, path: str) -> None:
    if isinstance(obj, SDKModel):
        extra = obj.model_extra or {}
        assert not extra, f"{path}: fields unknown to {type(obj).__name__}: {sorted(extra)}"
        for name in type(obj).model_fields:
            _no_extra(getattr(obj, name), f"{path}.{name}")
    elif isinstance(obj, list):
        for i, item in enumerate(obj):
            _no_extra(item, f"{path}[{i}]")
    elif isinstance(obj, dict):
        for key, item in obj.items():
            _no_extra(item, f"{path}.{key}")


def exact(model: type[SDKModel], data: dict[str, Any], path: str = "$") -> SDKModel:
    """``model.model_validate(data)`` that also refuses fields the SDK does not know."""
    obj = model.model_validate(data)
    _no_extra(obj, path)
    return obj


def validate_line(line: dict[str, Any]) -> str:
    """Validate a whole result line; return its kind: chat, completion, response, embedding,
    400, 404, 500, expired, cancelled."""
    env = OutputLine.model_validate(line)
    if env.response is not None:
        assert env.error is None, "a line with a response has error null"
        assert env.response.request_id.startswith("req_")
        body = env.response.body
        if env.response.status_code == 200:
            if body.get("object") == "chat.completion":
                chat = exact(ChatCompletion, body, "body")
                assert chat.id.startswith("chatcmpl-")
                return "chat"
            if body.get("object") == "list":
                exact(CreateEmbeddingResponse, sdk_decoded(body), "body")
                assert set(body) == {"object", "data", "model", "usage"}
                return "embedding"
            if body.get("object") == "response":
                response = exact(Response, body, "body")
                assert response.id.startswith("resp_")
                return "response"
            completion = exact(Completion, body, "body")
            assert completion.id.startswith("cmpl-")
            return "completion"
        assert set(body) == {"error"}, body
        error = exact(ErrorObject, body["error"], "body.error")
        assert set(body["error"]) == {"message", "type", "param", "code"}
        expected = {400: "invalid_request_error", 404: "invalid_request_error",
                    500: "server_error"}
        assert error.type == expected[env.response.status_code]
        return str(env.response.status_code)
    assert env.error is not None
    exact(BatchError, line["error"], "error")
    assert env.error.code in ("batch_expired", "batch_cancelled")
    return env.error.code.removeprefix("batch_")


def sdk_decoded(body: dict[str, Any]) -> dict[str, Any]:
    """An embeddings body with each base64 vector decoded exactly as openai-python does
    (``lib/_parsing/_embeddings.py``: little-endian float32 via ``np.frombuffer``)."""
    import base64

    import numpy as np

    data = [{**item, "embedding": np.frombuffer(base64.b64decode(item["embedding"]),
                                                dtype="float32").tolist()}
            if isinstance(item.get("embedding"), str) else item
            for item in body.get("data", [])]
    return {**body, "data": data}


def validate_batch(status: dict[str, Any]) -> Any:
    """``qworker status`` output as an openai ``Batch`` (extra qworker fields allowed)."""
    return Batch.model_validate(status)
