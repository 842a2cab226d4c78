"""The ``/v1/embeddings`` endpoint: its request body in, its response body out.

``embedding_fields`` validates the body of an embedding job as OpenAI does
(docs/formats.md, "Embedding jobs"): ``input`` is a non-empty string, a list of
non-empty strings, a non-empty list of token ids, or a list of such lists, at most
``MAX_EMBEDDING_INPUTS`` inputs; ``encoding_format`` ``float`` (default) or ``base64``;
``dimensions`` a positive integer; ``user`` a string (ignored). Fields that would change
the meaning and are not supported are refused (``EMBEDDING_UNSUPPORTED``), any other
field is ignored. ``embedding_body`` builds OpenAI's ``CreateEmbeddingResponse``.
Imported by ``qworker.schema.jobs`` when a job addresses this endpoint.
"""

from __future__ import annotations

import base64
import math
import struct
from collections.abc import Callable
from typing import Any

from qworker.engine.outputs import RequestOutput
from qworker.errors import EngineError, InvalidRequestError
from qworker.schema.jobs import EMBEDDINGS_URL, _describe, _short

__all__ = ["EMBEDDINGS_URL", "EMBEDDING_UNSUPPORTED", "MAX_EMBEDDING_INPUTS", "embedding_body",
           "embedding_fields"]

#: OpenAI's limit on the inputs of one embeddings request.
MAX_EMBEDDING_INPUTS = 2048
ENCODING_FORMATS = ("float", "base64")

#: Body fields of an embedding job that change its meaning and that qworker cannot
#: honour (vLLM's extras), each with the predicate telling a harmless value (a default).
EMBEDDING_UNSUPPORTED: dict[str, Callable[[Any], bool]] = {
    # qworker never truncates: an input past the model's length is context_length_exceeded.
    "truncate_prompt_tokens": lambda v: v is None,
    "messages": lambda v: v is None or v == [],
    "normalize": lambda v: v is None,
    "embed_dtype": lambda v: v is None or v == "float32",
    "add_special_tokens": lambda v: v is None or v is True,
}

Input = str | list[int]


def embedding_fields(body: dict[str, Any]) -> tuple[list[Input], str, int | None]:
    """``(inputs, encoding_format, dimensions)`` of an embedding job's ``body``.

    ``inputs`` is always a list (a single string or token-id list becomes one item).
    Raises ``InvalidRequestError`` naming the field (``body.input[3]``, ...).
    """
    for name, harmless in EMBEDDING_UNSUPPORTED.items():
        if name in body and not harmless(body[name]):
            raise InvalidRequestError(
                f"body.{name}={_short(body[name])} is not supported by qworker for embeddings"
            )
    inputs = _inputs(body.get("input"))
    encoding = body.get("encoding_format")
    if encoding is None:
        encoding = "float"
    elif encoding not in ENCODING_FORMATS:
        raise InvalidRequestError(
            f'body.encoding_format must be "float" or "base64", got {_describe(encoding)}'
        )
    dimensions = body.get("dimensions")
    if dimensions is not None and (type(dimensions) is not int or dimensions < 1):
        raise InvalidRequestError(
            f"body.dimensions must be a positive integer, got {_describe(dimensions)}"
        )
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise InvalidRequestError(f"body.user must be a string, got {_describe(user)}")
    return inputs, encoding, dimensions


def _inputs(value: Any) -> list[Input]:
    if isinstance(value, str):
        if not value:
            raise InvalidRequestError("body.input must not be an empty string")
        return [value]
    if not isinstance(value, list):
        raise InvalidRequestError(
            "body.input must be a string, a list of strings, a list of token ids or a list "
            f"of token-id lists, got {_describe(value)}"
        )
    if not value:
        raise InvalidRequestError("body.input must not be an empty list")
    first = value[0]
    if type(first) is int:  # one input given as token ids
        return [_token_ids(value, "body.input")]
    if len(value) > MAX_EMBEDDING_INPUTS:
        raise InvalidRequestError(
            f"body.input has {len(value)} inputs; at most {MAX_EMBEDDING_INPUTS} are allowed"
        )
    if isinstance(first, str):
        for i, item in enumerate(value):
            if not isinstance(item, str):
                raise InvalidRequestError(
                    f"body.input[{i}] must be a string like the other inputs, "
                    f"got {_describe(item)}"
                )
            if not item:
                raise InvalidRequestError(f"body.input[{i}] must not be an empty string")
        return list(value)
    if isinstance(first, list):
        out: list[Input] = []
        for i, item in enumerate(value):
            if not isinstance(item, list):
                raise InvalidRequestError(
                    f"body.input[{i}] must be a list of token ids like the other inputs, "
                    f"got {_describe(item)}"
                )
            out.append(_token_ids(item, f"body.input[{i}]"))
        return out
    raise InvalidRequestError(
        "body.input[0] must be a string, a token id or a list of token ids, "
        f"got {_describe(first)}"
    )


def _token_ids(ids: list[Any], where: str) -> list[int]:
    if not ids:
        raise InvalidRequestError(f"{where} must not be an empty list")
    # ``type(t) is int`` leaves out booleans; the common all-valid case stays at C speed.
    if all(type(t) is int for t in ids) and min(ids) >= 0:
        return ids
    for j, t in enumerate(ids):
        if type(t) is not int or t < 0:
            raise InvalidRequestError(
                f"{where}[{j}] must be a token id (an integer >= 0), got {_describe(t)}"
            )
    raise AssertionError("unreachable")  # pragma: no cover


def embedding_body(output: RequestOutput, model: str, encoding_format: str,
                   n_inputs: int) -> dict[str, Any]:
    """OpenAI's ``CreateEmbeddingResponse`` of a served embedding request.

    ``base64`` is each vector's little-endian float32 bytes, base64-encoded (what the
    openai SDK decodes). Raises ``EngineError`` when the engine returned no vector, the
    wrong number of them, or a value that is not finite.
    """
    vectors = output.embeddings
    if vectors is None:
        raise EngineError("the engine returned no embeddings for this request")
    if len(vectors) != n_inputs:
        raise EngineError(f"the engine returned {len(vectors)} embeddings for {n_inputs} inputs")
    data = []
    for i, vector in enumerate(vectors):
        if not all(map(math.isfinite, vector)):
            raise EngineError(f"the engine returned a non-finite value in embedding {i}")
        value: list[float] | str
        if encoding_format == "base64":
            value = base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
        else:
            value = [float(x) for x in vector]
        data.append({"object": "embedding", "index": i, "embedding": value})
    tokens = len(output.prompt_token_ids)
    return {"object": "list", "data": data, "model": model,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
