"""Input and output files of the CLI: a local path or ``s3://bucket/key``.

``open_input`` yields a readable binary file; an S3 object is downloaded to a
temporary file first (``produce`` reads its input twice). ``open_output`` yields a
writable binary file; for S3 it is a temporary file uploaded (multipart for large
files) only when the block finishes without an error, so a failed run never leaves a
half-written object. ``append=True`` continues an existing file (``--resume``).
With ``keep_failed_upload=True`` a failed final upload keeps the local file and raises
``UploadFailed`` naming it, so the results are not lost (``qworker generate``).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from qworker.worker.aws import make_client, s3_options


def is_s3(uri: str) -> bool:
    """True for ``s3://bucket/key``."""
    return uri.startswith("s3://")


def split_s3(uri: str) -> tuple[str, str]:
    """``s3://bucket/key`` -> ``(bucket, key)``; ValueError without a bucket or key."""
    rest = uri.removeprefix("s3://")
    bucket, _, key = rest.partition("/")
    if not bucket or not key or key.endswith("/"):
        raise ValueError(f"{uri!r} must be s3://bucket/key (a file, not a prefix)")
    return bucket, key


def _client(settings: Any) -> Any:
    return make_client("s3", s3_options(settings, max_attempts=5))


def _missing(exc: Exception) -> bool:
    code = str(getattr(exc, "response", {}).get("Error", {}).get("Code", ""))
    return code in ("404", "NoSuchKey", "NotFound")


def exists(uri: str, settings: Any) -> bool:
    """Whether the file or object exists."""
    if not is_s3(uri):
        return Path(uri).exists()
    bucket, key = split_s3(uri)
    try:
        _client(settings).head_object(Bucket=bucket, Key=key)
    except Exception as exc:
        if _missing(exc):
            return False
        raise
    return True


@contextlib.contextmanager
def open_input(uri: str, settings: Any) -> Iterator[IO[bytes]]:
    """A readable binary file for a local path or an S3 object (FileNotFoundError if absent)."""
    if not is_s3(uri):
        with open(uri, "rb") as f:
            yield f
        return
    bucket, key = split_s3(uri)
    with tempfile.TemporaryFile() as tmp:
        try:
            _client(settings).download_fileobj(bucket, key, tmp)
        except Exception as exc:
            if _missing(exc):
                raise FileNotFoundError(f"{uri} does not exist") from exc
            raise
        tmp.seek(0)
        yield tmp


class UploadFailed(RuntimeError):
    """The final upload of an S3 output failed; ``path`` still holds the whole file."""

    def __init__(self, uri: str, path: Path, cause: BaseException) -> None:
        super().__init__(f"uploading the results to {uri} failed ({type(cause).__name__}: "
                         f"{cause}); they are kept in {path}")
        self.uri, self.path = uri, path


@contextlib.contextmanager
def open_output(uri: str, settings: Any, append: bool = False,
                keep_failed_upload: bool = False) -> Iterator[IO[bytes]]:
    """A writable binary file; S3 objects are uploaded when the block succeeds.

    ``append``: keep what the file already holds (a trailing line without its newline,
    left by a killed run, is dropped first). ``keep_failed_upload``: see the module.
    """
    if not is_s3(uri):
        path = Path(uri)
        if path.parent != Path(""):
            path.parent.mkdir(parents=True, exist_ok=True)
        if append and path.exists():
            _drop_partial_line(path)
        with open(path, "ab" if append else "wb") as f:
            yield f
        return
    bucket, key = split_s3(uri)
    client = _client(settings)
    fd, name = tempfile.mkstemp(prefix="qworker-", suffix=".jsonl")
    os.close(fd)
    tmp = Path(name)
    kept = False
    try:
        if append and exists(uri, settings):
            with open(tmp, "wb") as f:
                client.download_fileobj(bucket, key, f)
            _drop_partial_line(tmp)
        with open(tmp, "ab") as f:
            yield f
        try:
            client.upload_file(str(tmp), bucket, key)
        except Exception as exc:
            if not keep_failed_upload:
                raise
            kept = True
            raise UploadFailed(uri, tmp, exc) from exc
    finally:
        if not kept:
            tmp.unlink(missing_ok=True)


def read_bytes(uri: str, settings: Any) -> bytes:
    """The whole content of a small file or object."""
    with open_input(uri, settings) as f:
        return f.read()


def _drop_partial_line(path: Path) -> None:
    size = path.stat().st_size
    if size == 0:
        return
    with open(path, "rb+") as f:
        f.seek(-1, os.SEEK_END)
        if f.read(1) == b"\n":
            return
        # Walk back to the last newline (or the start) and cut there.
        pos = size
        chunk = 65536
        while pos > 0:
            start = max(0, pos - chunk)
            f.seek(start)
            data = f.read(pos - start)
            idx = data.rfind(b"\n")
            if idx >= 0:
                f.truncate(start + idx + 1)
                return
            pos = start
        f.truncate(0)


@contextlib.contextmanager
def local_path(uri: str, settings: Any) -> Iterator[str]:
    """A local path holding the file: the path itself, or a temporary copy of an S3 object."""
    if not is_s3(uri):
        if not Path(uri).exists():
            raise FileNotFoundError(f"{uri} does not exist")
        yield uri
        return
    with open_input(uri, settings) as src, tempfile.NamedTemporaryFile(suffix=".jsonl") as tmp:
        shutil.copyfileobj(src, tmp)
        tmp.flush()
        yield tmp.name


def done_ids(uri: str, settings: Any) -> tuple[set[str], set[int]]:
    """What an earlier run already wrote to ``uri``: its custom_ids, and the line numbers of
    input lines that had none (their error lines say ``line N: ...``)."""
    import orjson

    ids: set[str] = set()
    lines: set[int] = set()
    if not exists(uri, settings):
        return ids, lines
    with open_input(uri, settings) as f:
        for raw in f:
            if not raw.endswith(b"\n"):
                break  # a partial last line: open_output(append=True) drops it
            try:
                record = orjson.loads(raw)
            except orjson.JSONDecodeError:
                continue
            cid = record.get("custom_id") if isinstance(record, dict) else None
            if isinstance(cid, str):
                ids.add(cid)
                continue
            text = orjson.dumps(record).decode()
            marker = text.find('"message":"line ')
            if marker >= 0:
                number = text[marker + len('"message":"line '):].split(":", 1)[0]
                if number.isdigit():
                    lines.add(int(number))
    return ids, lines
