"""Embedding jobs on the worker's side: which task a job needs, and its inputs encoded.

A worker serves one task, its engine's ``task``: ``generate`` (chat, completions, responses) or
``embed`` (``/v1/embeddings``). ``task_error`` is the 400 ``invalid_request`` of a job
for the other task, decided in ``requests.prepare`` so such a job never reaches the
engine (docs/formats.md, "Embedding jobs"). ``encode_inputs`` tokenizes and checks an
embedding job's inputs against the engine, naming the input at fault.
"""

from __future__ import annotations

from qworker.errors import InvalidRequestError
from qworker.schema import CHAT_URL, COMPLETIONS_URL, Job, JobKind
from qworker.schema.jobs import EMBEDDINGS_URL, RESPONSES_URL
from qworker.worker.engine_thread import EmbeddingEngineLike

GENERATE = "generate"
EMBED = "embed"
#: OpenAI's limit on the tokens of all inputs of one embeddings request together.
MAX_EMBEDDING_REQUEST_TOKENS = 300_000
_URLS = {JobKind.CHAT: CHAT_URL, JobKind.COMPLETION: COMPLETIONS_URL,
         JobKind.RESPONSES: RESPONSES_URL, JobKind.EMBEDDING: EMBEDDINGS_URL}
_WHAT = {GENERATE: "text generation", EMBED: "embeddings"}
_MODEL = {GENERATE: "a generation model", EMBED: "an embedding model"}


def task_of(job: Job) -> str:
    """The engine task ``job`` needs: ``embed`` for embedding jobs, else ``generate``."""
    return EMBED if job.kind is JobKind.EMBEDDING else GENERATE


def task_error(served: str, job: Job) -> InvalidRequestError | None:
    """The error of a job this worker's task (``served``) cannot answer, or None.

    The message starts with ``url`` (the record's ``param``) and says what this worker
    serves.
    """
    needed = task_of(job)
    if needed == served:
        return None
    url = _URLS.get(job.kind, job.kind.value)
    return InvalidRequestError(
        f"url {url} asks for {_WHAT[needed]}, but this worker serves "
        f'{_WHAT.get(served, served)} (task "{served}"); send it to a worker running '
        f"{_MODEL[needed]}"
    )


def encode_inputs(engine: EmbeddingEngineLike, job: Job) -> list[list[int]]:
    """Each input's token ids, validated by the engine, and ``dimensions`` checked.

    Raises the engine's ``InvalidRequestError`` / ``ContextLengthExceededError`` naming
    the input (``body.input[2]: ...``; ``body.input`` for a single input), and
    ``InvalidRequestError`` when all inputs hold more than
    ``MAX_EMBEDDING_REQUEST_TOKENS`` tokens together.
    """
    inputs = job.inputs or []
    out: list[list[int]] = []
    total = 0
    for i, item in enumerate(inputs):
        try:
            ids = engine.validate_embedding_input(item)
        except InvalidRequestError as exc:
            where = "body.input" if len(inputs) == 1 else f"body.input[{i}]"
            raise type(exc)(f"{where}: {exc}") from None
        total += len(ids)
        if total > MAX_EMBEDDING_REQUEST_TOKENS:
            raise InvalidRequestError(
                f"body.input: the inputs hold more than {MAX_EMBEDDING_REQUEST_TOKENS} tokens "
                "together, the limit of one request; split it into several jobs")
        out.append(ids)
    try:
        engine.check_dimensions(job.dimensions)
    except InvalidRequestError as exc:
        message = str(exc)
        if not message.startswith("body."):
            message = (f"body.{message}" if message.startswith("dimensions")
                       else f"body.dimensions: {message}")
        raise type(exc)(message) from None
    return out
