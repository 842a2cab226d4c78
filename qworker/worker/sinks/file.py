"""The ``file://`` sink: one JSON file per result key under a directory.

Each put writes a temporary file and hard-links it into place: the link fails if
the name exists, so the first result wins atomically (the local ``IfNoneMatch``),
and a reader never sees a half-written record.
"""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import Iterator
from pathlib import Path

from qworker.worker.sinks.base import Sink
from qworker.worker.sources.file import file_path


class FileSink(Sink):
    """Writes ``<dir>/<key>``; ``put`` returns False when that file already exists."""

    def __init__(self, root: Path) -> None:
        self.root = root

    @classmethod
    def from_uri(cls, uri: str) -> FileSink:
        """Build from ``file:///path/dir`` (created on first write)."""
        return cls(file_path(uri))

    async def put(self, key: str, body: bytes) -> bool:
        """Store ``body`` at ``key`` unless present; runs the file I/O off the loop."""
        return await asyncio.to_thread(self.put_sync, key, body)

    def put_sync(self, key: str, body: bytes) -> bool:
        """Blocking form of ``put``."""
        target = self.root / key
        if ".." in Path(key).parts or Path(key).is_absolute():
            raise ValueError(f"unsafe result key {key!r}")
        if target.exists():
            return False
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.parent / f".tmp-{uuid.uuid4().hex}"
        with tmp.open("wb") as out:
            out.write(body)
        try:
            os.link(tmp, target)
        except FileExistsError:
            return False
        finally:
            tmp.unlink()
        return True

    async def close(self) -> None:
        """Nothing buffered: every put is on disk when it returns."""


def collect_dir(uri: str, batch_id: str) -> Iterator[bytes]:
    """Yield every stored record of ``batch_id`` under a ``file://`` sink, by key order."""
    from qworker.schema import safe_segment

    folder = file_path(uri) / safe_segment(batch_id)
    if not folder.is_dir():
        return
    for path in sorted(folder.iterdir()):
        if path.suffix == ".json" and not path.name.startswith(".tmp-"):
            yield path.read_bytes()
