"""The ``file://`` sink: one JSON file per result key under a directory.

Each put writes a temporary file and hard-links it into place: the link fails if
the name exists, so the first result wins atomically (the local ``IfNoneMatch``),
and a reader never sees a half-written record. The request's fingerprint is stored
beside the record, in ``<batch>/_fingerprints/<name>`` (names starting with ``_`` are
qworker's own, never a result), linked first the same way: whoever wins that link is
the request the record answers (docs/formats.md, fingerprints and conflicts).

A temporary file never outlives the put that made it, whatever fails (a full disk, a
file-size limit, a failed link). A key that cannot be a path here, or a record too
large for the filesystem, is refused for good (``SinkRefused``); other I/O errors are
transient (``SinkError``: retried by the worker).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import uuid
from collections.abc import Iterator
from pathlib import Path

from qworker.worker.failures import Refused, StartupError
from qworker.worker.sinks.base import PutResult, Sink, SinkError
from qworker.worker.sources.file import file_path

FINGERPRINTS_DIR = "_fingerprints"
#: I/O errors about this one object, not the directory: retrying cannot help.
_REFUSED_ERRNOS = frozenset({errno.EFBIG, errno.ENAMETOOLONG, errno.EINVAL})


class SinkRefused(SinkError, Refused):
    """The directory refuses this object for good (its key or size)."""


class FileSink(Sink):
    """Writes ``<dir>/<key>``; ``put`` returns False when that file already exists."""

    def __init__(self, root: Path) -> None:
        self.root = root

    @classmethod
    def from_uri(cls, uri: str) -> FileSink:
        """Build from ``file:///path/dir`` (created on first write)."""
        return cls(file_path(uri))

    async def check(self) -> None:
        """The directory exists or can be created, and is writable."""
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StartupError(f"sink directory {self.root} cannot be created: {exc}") from None
        if not os.access(self.root, os.W_OK | os.X_OK):
            raise StartupError(f"sink directory {self.root} is not writable")

    async def put(self, key: str, body: bytes, fingerprint: str | None = None) -> PutResult:
        """Store ``body`` at ``key`` unless present; runs the file I/O off the loop."""
        try:
            return await asyncio.to_thread(self.put_sync, key, body, fingerprint)
        except SinkError:
            raise
        except ValueError as exc:
            raise SinkRefused(str(exc)) from exc
        except OSError as exc:
            if exc.errno in _REFUSED_ERRNOS:
                raise SinkRefused(f"cannot write {self.root / key}: {exc}") from exc
            raise SinkError(f"cannot write {self.root / key}: {exc}") from exc

    def put_sync(self, key: str, body: bytes, fingerprint: str | None = None) -> PutResult:
        """Blocking form of ``put``."""
        target = self.root / key
        if ".." in Path(key).parts or Path(key).is_absolute():
            raise ValueError(f"unsafe result key {key!r}")
        sidecar = target.parent / FINGERPRINTS_DIR / target.name
        if target.exists():
            return PutResult(False, _read_fingerprint(sidecar))
        target.parent.mkdir(parents=True, exist_ok=True)
        if fingerprint is not None:
            sidecar.parent.mkdir(exist_ok=True)
        if fingerprint is not None and not _link_new(sidecar, fingerprint.encode()):
            stored = _read_fingerprint(sidecar)
            if stored != fingerprint:  # another request owns this key (its record may follow)
                return PutResult(False, stored)
        if not _link_new(target, body):
            return PutResult(False, _read_fingerprint(sidecar))
        return PutResult(True)

    async def get(self, key: str) -> bytes | None:
        """The file at ``key`` (None when absent), read off the loop."""
        def read() -> bytes | None:
            try:
                return (self.root / key).read_bytes()
            except FileNotFoundError:
                return None
        return await asyncio.to_thread(read)

    async def close(self) -> None:
        """Nothing buffered: every put is on disk when it returns."""


def _link_new(target: Path, body: bytes) -> bool:
    """Write ``body`` to ``target`` atomically unless it exists; False if it did.

    The temporary file is removed on every path out, a failed write included.
    """
    tmp = target.parent / f".tmp-{uuid.uuid4().hex}"
    try:
        with tmp.open("wb") as out:
            out.write(body)
        os.link(tmp, target)
    except FileExistsError:
        return False
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink()
    return True


def _read_fingerprint(sidecar: Path) -> str | None:
    try:
        return sidecar.read_text().strip() or None
    except FileNotFoundError:
        return None


def collect_dir(uri: str, batch_id: str) -> Iterator[bytes]:
    """Yield every stored record of ``batch_id`` under a ``file://`` sink, by key order."""
    from qworker.schema import safe_segment

    folder = file_path(uri) / safe_segment(batch_id)
    if not folder.is_dir():
        return
    for path in sorted(folder.iterdir()):
        if path.suffix == ".json" and not path.name.startswith(".tmp-"):
            yield path.read_bytes()
