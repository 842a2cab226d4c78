"""The ``file://`` source: a local JSONL spool that remembers which lines are done.

Progress lives next to the spool in ``<file>.progress``: one acked line number per
line, appended and flushed on every ack (a SIGKILL loses nothing the kernel already
has). At start the log is compacted to ``done_through N`` plus the acked numbers
above N, and those lines are never served again. Lines are 1-based; blank lines are
skipped. Messages that are not JSON objects go to ``<file>.dlq`` (one JSON line each,
with the reason) and then count as acked. An exclusive lock on the progress file
keeps two workers off one spool. New lines appended while running are picked up.
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import logging
import os
import time
from collections import deque
from collections.abc import Iterable
from pathlib import Path
from typing import IO, TYPE_CHECKING

from qworker.worker.failures import StartupError
from qworker.worker.sources.base import Message, Source

if TYPE_CHECKING:
    from qworker.config import WorkerSettings

log = logging.getLogger(__name__)

# A tail without its newline may still be being written; serve it once it sat still this long.
_PARTIAL_LINE_GRACE_S = 0.5


def file_path(uri: str) -> Path:
    """The local path of a ``file://`` URI (``file:///abs`` or ``file://./relative``)."""
    scheme, sep, rest = uri.partition("://")
    if scheme != "file" or not sep or not rest:
        raise ValueError(f"not a file:// URI: {uri!r}")
    return Path(rest)


class FileSource(Source):
    """Serves the lines of a JSONL file not yet acknowledged in its progress file."""

    kind = "file"

    def __init__(self, path: Path) -> None:
        self.path = path
        self.progress_path = path.with_name(path.name + ".progress")
        self.dlq_path = path.with_name(path.name + ".dlq")
        self.on_revoke = None
        self._done: set[int] = set()
        self._done_through = 0
        self._reader: IO[bytes] | None = None
        self._progress: IO[str] | None = None
        self._line_no = 0
        self._partial = b""
        self._partial_since = 0.0
        self._open: set[int] = set()  # served, not yet acked
        self._again: deque[Message] = deque()  # abandoned: served again first

    @classmethod
    def from_uri(cls, uri: str, settings: WorkerSettings | None = None) -> FileSource:
        """Build from ``file:///path/requests.jsonl``; settings are unused."""
        return cls(file_path(uri))

    async def start(self) -> None:
        """Open the spool, lock and compact the progress log."""
        if not self.path.is_file():
            raise StartupError(f"source file {self.path} does not exist")
        self._load_progress()
        self._reader = self.path.open("rb")
        log.info(
            "file source %s: %d lines already done", self.path, self._done_through + len(self._done)
        )

    def _load_progress(self) -> None:
        done: set[int] = set()
        through = 0
        progress = self.progress_path.open("a+")
        try:
            fcntl.flock(progress.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            progress.close()
            raise StartupError(
                f"{self.progress_path} is locked: another worker uses this spool"
            ) from None
        progress.seek(0)
        for raw in progress.read().splitlines():
            raw = raw.strip()
            if raw.startswith("done_through "):
                through = max(through, int(raw.split()[1]))
            elif raw.isdigit():
                done.add(int(raw))
        while through + 1 in done:
            through += 1
            done.discard(through)
        done = {n for n in done if n > through}
        # Compact by rewriting in place: we hold the lock, and an ack can only append after.
        progress.seek(0)
        progress.truncate()
        progress.write(f"done_through {through}\n")
        progress.writelines(f"{n}\n" for n in sorted(done))
        progress.flush()
        os.fsync(progress.fileno())
        self._progress = progress
        self._done, self._done_through = done, through

    def _is_done(self, line_no: int) -> bool:
        return line_no <= self._done_through or line_no in self._done

    async def receive(self, max_messages: int, timeout: float) -> list[Message]:
        """Next unacked lines; at end of file waits up to ``timeout`` for more."""
        deadline = time.monotonic() + timeout
        while True:
            batch: list[Message] = []
            while self._again and len(batch) < max_messages:
                batch.append(self._again.popleft())
            batch += self._read_lines(max_messages - len(batch))
            if batch or time.monotonic() >= deadline:
                return batch
            await asyncio.sleep(min(0.05, max(0.0, deadline - time.monotonic())))

    def _read_lines(self, max_messages: int) -> list[Message]:
        assert self._reader is not None, "start() first"
        out: list[Message] = []
        while len(out) < max_messages:
            chunk = self._reader.readline()
            if not chunk:
                break
            if not chunk.endswith(b"\n"):
                self._partial += chunk
                if self._partial_since == 0.0:
                    self._partial_since = time.monotonic()
                if time.monotonic() - self._partial_since < _PARTIAL_LINE_GRACE_S:
                    break
                chunk, self._partial = self._partial, b""
            else:
                chunk, self._partial = self._partial + chunk, b""
            self._partial_since = 0.0
            self._line_no += 1
            body = chunk.strip()
            if not body or self._is_done(self._line_no):
                continue
            self._open.add(self._line_no)
            out.append(
                Message(
                    body=body,
                    message_id=f"file:{self._line_no}",
                    key=None,
                    handle=self._line_no,
                    received_at=time.time(),
                )
            )
        return out

    async def ack(self, msg: Message) -> None:
        """Append the line number to the progress log (flushed before returning)."""
        line_no = int(msg.handle)
        self._open.discard(line_no)
        if self._is_done(line_no) or self._progress is None:
            return
        self._done.add(line_no)
        # Keep memory bounded on long spools: fold the contiguous prefix into the watermark.
        while self._done_through + 1 in self._done:
            self._done_through += 1
            self._done.discard(self._done_through)
        self._progress.write(f"{line_no}\n")
        self._progress.flush()

    async def abandon(self, msg: Message) -> None:
        """Serve the line again (first, by this run's next ``receive``; else by the next run)."""
        if int(msg.handle) in self._open:
            self._again.append(msg)

    async def pending_work(self) -> int:
        """Lines served and not yet done, plus one if the file holds bytes not read yet."""
        if self._reader is None:
            raise RuntimeError("file source not started")
        unread = self._partial != b"" or self.path.stat().st_size > self._reader.tell()
        return len(self._open) + (1 if unread else 0)

    def uncommitted_count(self) -> int:
        """Lines served and not yet recorded as done."""
        return len(self._open)

    async def dead_letter(self, msg: Message, reason: str) -> None:
        """Append ``{"message_id", "reason", "body"}`` to ``<file>.dlq``, then ack."""
        record = {
            "message_id": msg.message_id,
            "reason": reason,
            "body": msg.body.decode("utf-8", errors="replace"),
        }
        with self.dlq_path.open("a", encoding="utf-8") as out:
            out.write(json.dumps(record) + "\n")
        await self.ack(msg)

    async def close(self) -> None:
        """fsync the progress log and release the lock; idempotent."""
        if self._progress is not None:
            self._progress.flush()
            os.fsync(self._progress.fileno())
            self._progress.close()  # closing drops the flock
            self._progress = None
        if self._reader is not None:
            self._reader.close()
            self._reader = None


def append_jobs(uri: str, bodies: Iterable[bytes]) -> int:
    """Append job lines to a spool file (created if missing); return how many."""
    path = file_path(uri)
    path.parent.mkdir(parents=True, exist_ok=True)
    count = 0
    with path.open("ab") as out:
        for body in bodies:
            out.write(body.rstrip(b"\n") + b"\n")
            count += 1
    return count
