"""``qworker generate``: an OpenAI batch file through the engine, offline.

Streams the input with bounded memory: at most ``window`` jobs are read ahead of the
oldest unwritten one, and results are written in input order (one output line per
non-blank input line). Invalid lines become error lines in the same output; the
other jobs are unaffected. Progress goes to stderr: a tqdm bar (rate, ETA) and a
closing summary line. ``skip_ids`` / ``skip_lines`` leave out what an earlier run
already wrote (``--resume``). Lines: docs/formats.md, "Result lines". A failure on one
line's path (preparing, the engine refusing it, building its record) is that line's
error line (``requests.job_error``), never the end of the run. ``check_output`` tells,
before any work, whether the output can be written at all.
"""

from __future__ import annotations

import os
import sys
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from qworker.engine.outputs import RequestOutput
from qworker.errors import InvalidRequestError
from qworker.schema import Job, dumps, error_record_for, is_error_record
from qworker.schema.peek import IdScanner, PeekedIds, peek_ids
from qworker.worker.engine_thread import EngineLike
from qworker.worker.requests import (
    Prepared,
    add_to_engine,
    job_error,
    prepare,
    record_for,
    token_decoder,
)
from qworker.worker.served_models import ServedModels

_PROGRESS_EVERY_S = 2.0


@dataclass(slots=True)
class _Slot:
    job: Job | None
    record: dict[str, Any] | None = None
    expired: bool = False  # aborted here because its deadline passed


@dataclass(slots=True)
class GenerateStats:
    """Counts of one ``generate`` run."""

    lines: int = 0
    ok: int = 0
    errors: int = 0
    skipped: int = 0
    generation_tokens: int = 0
    started: float = field(default_factory=time.monotonic)

    @property
    def elapsed(self) -> float:
        """Seconds since the run began."""
        return time.monotonic() - self.started


def count_lines(path: str) -> int:
    """Non-blank lines of a file (for progress), read in bounded chunks."""
    return sum(1 for _ in _read_lines(path, 64))


def _done_before(ids: PeekedIds, line_no: int, skip_ids: set[str],
                 skip_lines: set[int]) -> bool:
    if line_no in skip_lines:
        return True
    return ids.custom_id is not None and ids.custom_id in skip_ids


def generate_file(
    engine: EngineLike,
    input_path: str,
    out: IO[bytes],
    window: int = 256,
    max_job_bytes: int = 1 << 20,
    progress: IO[str] | str | None = "stderr",
    skip_ids: set[str] | None = None,
    skip_lines: set[int] | None = None,
    served: ServedModels | None = None,
) -> GenerateStats:
    """Run every job of ``input_path`` through ``engine``; write records to ``out``.

    ``progress``: where the bar and the summary go (default stderr, None: silent).
    Lines whose custom_id is in ``skip_ids`` (or whose number is in ``skip_lines``) are
    not run again; ``stats.skipped`` counts them. ``served``: the model names jobs may
    ask for (``requests.prepare``; default only ``engine.model_name``).
    """
    if progress == "stderr":  # looked up now: sys.stderr may have been replaced
        progress = sys.stderr
    assert progress is None or not isinstance(progress, str)
    skip_ids, skip_lines = skip_ids or set(), skip_lines or set()
    total = count_lines(input_path)
    stats = GenerateStats()
    bar = _bar(progress, total)
    slots: deque[_Slot] = deque()
    by_request: dict[str, _Slot] = {}
    decode: Callable[[int], str] | None = token_decoder(engine)
    last_report = time.monotonic()

    def flush() -> None:
        while slots and slots[0].record is not None:
            record = slots.popleft().record
            assert record is not None
            out.write(dumps(record) + b"\n")
            if not is_error_record(record):
                stats.ok += 1
            else:
                stats.errors += 1
            if bar is not None:
                bar.update(1)

    def finish(outputs: list[RequestOutput]) -> None:
        for output in outputs:
            slot = by_request.pop(output.request_id, None)
            if slot is None or slot.job is None:
                continue
            job = slot.job
            stats.generation_tokens += sum(len(c.token_ids) for c in output.outputs)
            try:
                slot.record = record_for(job, output, engine.model_name, decode, slot.expired)
            except Exception as exc:  # this line's error, not the run's
                slot.record = error_record_for(job.custom_id, job.batch_id,
                                               job_error(exc, "build its record"), job.metadata)

    lines = _read_lines(input_path, max_job_bytes + 1)
    exhausted = False
    while not exhausted or by_request:
        while not exhausted and len(slots) < window:
            item = next(lines, None)
            if item is None:
                exhausted = True
                break
            line_no, body, size, ids = item
            stats.lines += 1
            if (skip_ids or skip_lines) and _done_before(ids or peek_ids(body), line_no,
                                                         skip_ids, skip_lines):
                stats.skipped += 1
                if bar is not None:
                    bar.update(1)
                continue
            slots.append(_admit(engine, line_no, body, max_job_bytes, by_request, size, ids,
                                served))
        if by_request:
            _expire(engine, by_request)
            finish(engine.step())
        flush()
        if bar is not None and time.monotonic() - last_report >= _PROGRESS_EVERY_S:
            last_report = time.monotonic()
            secs = max(stats.elapsed, 1e-9)
            bar.set_postfix(ok=stats.ok, errors=stats.errors,
                            tok_s=f"{stats.generation_tokens / secs:.1f}", refresh=False)
    flush()
    if bar is not None:
        bar.close()
    if progress is not None:
        _report(progress, stats, total)
    return stats


def check_output(uri: str, settings: Any) -> None:
    """Raise ``ValueError`` (one line) when ``uri`` cannot take generate's output.

    S3: the bucket exists and these credentials reach it (HEAD bucket); a local path:
    not a directory, and its folder exists (or can be made) and is writable.
    """
    from qworker.batch.files import is_s3, split_s3

    if is_s3(uri):
        from qworker.worker.aws import make_client, s3_options

        bucket, _ = split_s3(uri)
        try:
            make_client("s3", s3_options(settings, max_attempts=3)).head_bucket(Bucket=bucket)
        except Exception as exc:
            response = getattr(exc, "response", None) or {}
            code = str(response.get("Error", {}).get("Code", "")) if isinstance(
                response, dict) else ""
            if code in ("404", "NoSuchBucket", "NotFound"):
                raise ValueError(f"output bucket {bucket!r} ({uri}) does not exist") from None
            raise ValueError(f"output {uri} cannot be written: {type(exc).__name__}: "
                             f"{exc}") from None
        return
    path = Path(uri)
    if path.is_dir():
        raise ValueError(f"output {uri} is a directory")
    folder = path.parent if str(path.parent) else Path(".")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"output folder {folder} cannot be created: {exc}") from None
    if not os.access(folder, os.W_OK | os.X_OK) or (path.exists()
                                                     and not os.access(path, os.W_OK)):
        raise ValueError(f"output {uri} is not writable")


def _bar(progress: IO[str] | None, total: int) -> Any:
    """A tqdm bar on ``progress`` (jobs done of ``total``, rate and ETA), or None."""
    if progress is None:
        return None
    from tqdm import tqdm

    return tqdm(total=total, unit="job", file=progress, desc="generate", dynamic_ncols=True,
                mininterval=1.0)


def _read_lines(path: str, limit: int
                ) -> Iterator[tuple[int, bytes, int | None, PeekedIds | None]]:
    """``(line number, body, full size if cut, its ids if cut)`` of each non-blank line.

    At most ``limit`` bytes of a line are ever held: a longer one is answered as too large,
    unparsed, its ids read on the way (``IdScanner``).
    """
    with open(path, "rb") as f:
        line_no = 0
        while True:
            head, size, scanner = bytearray(), 0, None
            while True:
                chunk = f.readline(1 << 20)
                if not chunk:
                    break
                size += len(chunk)
                room = limit - len(head)
                if room > 0:
                    head += chunk[:room]
                if scanner is not None:
                    scanner.feed(chunk)
                elif size > limit:
                    scanner = IdScanner()
                    scanner.feed(head)
                    scanner.feed(chunk[room:] if room > 0 else chunk)
                if chunk.endswith(b"\n"):
                    break
            if size == 0:
                return
            line_no += 1
            body = bytes(head).strip()
            if body or size > len(head):
                cut = size > len(head)
                yield (line_no, body, size if cut else None,
                       scanner.ids if scanner is not None else None)


def _admit(
    engine: EngineLike, line_no: int, body: bytes, max_job_bytes: int,
    by_request: dict[str, _Slot], size: int | None = None, ids: PeekedIds | None = None,
    served: ServedModels | None = None,
) -> _Slot:
    """The same path as ``qworker run`` (``requests.prepare``); a dead letter is an error line."""
    outcome = prepare(engine, body, max_job_bytes, size=size, ids=ids, served=served)
    if not isinstance(outcome, Prepared):
        if outcome.dead_letter is not None:
            exc = InvalidRequestError(f"line {line_no}: {outcome.dead_letter}")
            return _Slot(None, error_record_for(outcome.custom_id, outcome.batch_id, exc))  # type: ignore[arg-type]
        return _Slot(None, outcome.record)
    job = outcome.job
    request_id = uuid.uuid4().hex
    try:
        add_to_engine(engine, request_id, outcome)
    except Exception as exc:  # any rejection becomes the job's error line
        return _Slot(job, error_record_for(job.custom_id, job.batch_id,
                                           job_error(exc, "submit it"), job.metadata))
    slot = _Slot(job)
    by_request[request_id] = slot
    return slot


def _expire(engine: EngineLike, by_request: dict[str, _Slot]) -> None:
    now = time.time()
    for request_id, slot in by_request.items():
        job = slot.job
        if job is not None and not slot.expired and job.deadline is not None \
                and job.deadline <= now:
            slot.expired = True  # abort once; the record says batch_expired
            engine.abort(request_id)


def _report(progress: IO[str], stats: GenerateStats, total: int) -> None:
    secs = max(stats.elapsed, 1e-9)
    done = stats.ok + stats.errors + stats.skipped
    skipped = f", {stats.skipped} already done" if stats.skipped else ""
    progress.write(
        f"generate: {done}/{total} done ({stats.ok} ok, {stats.errors} errors{skipped}), "
        f"{done / secs:.2f} jobs/s, {stats.generation_tokens / secs:.1f} tok/s\n"
    )
    progress.flush()
