"""The ``file://`` source: a local JSONL spool that remembers which lines are done.

Progress lives next to the spool in ``<file>.progress``: one acked line number per
line, appended and flushed on every ack (a SIGKILL loses nothing the kernel already
has). At start the log is compacted to ``done_through N`` plus the acked numbers
above N, and those lines are never served again. Lines are 1-based; blank lines are
skipped. Messages that are not JSON objects go to ``<file>.dlq`` (one JSON line each,
with the reason) and then count as acked. An exclusive lock on the progress file
keeps two workers off one spool. New lines appended while running are picked up.

The progress also records which file it is about (``file <inode> <size> <head sha256>
<sha256 of the last 64 KiB it knew>``): a spool replaced at the same path (shorter,
or different in what was already read) is detected at start and logged, and its
progress starts over, so every line of the new file is served (docs/operations.md,
"The file spool"); results already stored are absorbed as duplicates. Appending, or
rewriting the file with the same content plus more, keeps the progress.

Lines are read in bounded chunks: a line longer than ``max_job_bytes`` is never held
whole; its message carries its first ``max_job_bytes + 1`` bytes and its full
``size``, so the worker answers it as too large without parsing it.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import fcntl
import hashlib
import json
import logging
import os
import time
from collections import deque
from collections.abc import Iterable
from pathlib import Path
from typing import IO, TYPE_CHECKING

from qworker.schema.peek import IdScanner
from qworker.worker.failures import StartupError
from qworker.worker.sources.base import Message, Source

if TYPE_CHECKING:
    from qworker.config import WorkerSettings

log = logging.getLogger(__name__)

# A tail without its newline may still be being written; serve it once it sat still this long.
_PARTIAL_LINE_GRACE_S = 0.5
_READ_CHUNK = 1 << 20  # bytes per read of a long line
_IDENTITY_SPAN = 64 << 10  # bytes hashed at the head (and end of the known part) of a spool
_DEFAULT_MAX_JOB_BYTES = 1 << 20


def file_identity(path: Path, known_size: int | None = None) -> tuple[int, int, str, str]:
    """``(inode, size, head sha256, sha256 of the 64 KiB before known_size)`` of ``path``.

    ``known_size`` (default: the current size) is where the hashed end lies, so a grown
    file can be checked against what was known of it.
    """
    stat = path.stat()
    end = stat.st_size if known_size is None else min(known_size, stat.st_size)
    with path.open("rb") as f:
        head = f.read(min(_IDENTITY_SPAN, end))
        f.seek(max(0, end - _IDENTITY_SPAN))
        tail = f.read(end - max(0, end - _IDENTITY_SPAN))
    return (stat.st_ino, stat.st_size, hashlib.sha256(head).hexdigest(),
            hashlib.sha256(tail).hexdigest())


def file_path(uri: str) -> Path:
    """The local path of a ``file://`` URI (``file:///abs`` or ``file://./relative``)."""
    scheme, sep, rest = uri.partition("://")
    if scheme != "file" or not sep or not rest:
        raise ValueError(f"not a file:// URI: {uri!r}")
    return Path(rest)


class FileSource(Source):
    """Serves the lines of a JSONL file not yet acknowledged in its progress file."""

    kind = "file"

    def __init__(self, path: Path, max_job_bytes: int = _DEFAULT_MAX_JOB_BYTES) -> None:
        self.path = path
        self.progress_path = path.with_name(path.name + ".progress")
        self.dlq_path = path.with_name(path.name + ".dlq")
        self.on_revoke = None
        self.line_limit = max_job_bytes + 1  # bytes of one line ever held in memory
        #: Set at start when the progress was about another file (see the module).
        self.replaced = False
        self._done: set[int] = set()
        self._done_through = 0
        self._reader: IO[bytes] | None = None
        self._progress: IO[str] | None = None
        self._line_no = 0
        self._partial = bytearray()  # the line being read (at most line_limit bytes)
        self._partial_size = 0  # its bytes so far, also those not kept
        self._scanner: IdScanner | None = None  # reads the ids of a line too long to keep
        self._partial_since = 0.0
        self._open: set[int] = set()  # served, not yet acked
        self._again: deque[Message] = deque()  # abandoned: served again first
        self._warned_swap = False

    @classmethod
    def from_uri(cls, uri: str, settings: WorkerSettings | None = None) -> FileSource:
        """Build from ``file:///path/requests.jsonl`` (``max_job_bytes`` from ``settings``)."""
        limit = settings.max_job_bytes if settings is not None else _DEFAULT_MAX_JOB_BYTES
        return cls(file_path(uri), limit)

    def position(self, msg: Message) -> dict[str, object]:
        """The spool's path and the message's line number."""
        return {"path": str(self.path), "line": int(msg.handle)}

    async def check(self) -> None:
        """The spool exists and no other worker holds its progress lock."""
        if not self.path.is_file():
            raise StartupError(f"source file {self.path} does not exist")
        with contextlib.suppress(FileNotFoundError), self.progress_path.open("rb") as progress:
            try:
                fcntl.flock(progress.fileno(), fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                raise StartupError(
                    f"{self.progress_path} is locked: another worker uses this spool"
                ) from None

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
        identity: list[str] | None = None
        for raw in progress.read().splitlines():
            raw = raw.strip()
            if raw.startswith("done_through "):
                through = max(through, int(raw.split()[1]))
            elif raw.isdigit():
                done.add(int(raw))
            elif raw.startswith("file "):
                identity = raw.split()[1:]
        if identity is not None and (done or through) and self._is_replaced(identity):
            log.warning(
                "spool %s was replaced since its progress was written (%d lines were done "
                "in the old file): serving the new file from line 1; results already "
                "stored are absorbed as duplicates", self.path, through + len(done))
            self.replaced = True
            done, through = set(), 0
        while through + 1 in done:
            through += 1
            done.discard(through)
        done = {n for n in done if n > through}
        # Compact by rewriting in place: we hold the lock, and an ack can only append after.
        progress.seek(0)
        progress.truncate()
        inode, size, head, tail = file_identity(self.path)
        progress.write(f"file {inode} {size} {head} {tail}\n")
        progress.write(f"done_through {through}\n")
        progress.writelines(f"{n}\n" for n in sorted(done))
        progress.flush()
        os.fsync(progress.fileno())
        self._progress = progress
        self._done, self._done_through = done, through

    def _is_replaced(self, identity: list[str]) -> bool:
        """Whether the spool is no longer the file ``identity`` describes."""
        try:
            inode, size, head, tail = int(identity[0]), int(identity[1]), identity[2], identity[3]
        except (IndexError, ValueError):
            return False  # not ours to judge (a hand-edited line): keep the progress
        now = file_identity(self.path, known_size=size)
        if now[1] < size or now[2] != head or now[3] != tail:
            return True
        if now[0] != inode:
            log.info("spool %s has a new inode but the same content: progress kept", self.path)
        return False

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
            chunk = self._reader.readline(_READ_CHUNK)
            if chunk:
                if self._partial_size == 0:
                    self._partial_since = 0.0
                self._partial_size += len(chunk)
                room = self.line_limit - len(self._partial)
                if room > 0:
                    self._partial += chunk[:room]
                if self._scanner is not None:
                    self._scanner.feed(chunk)
                elif self._partial_size > self.line_limit:  # too long: read its ids on the way
                    self._scanner = IdScanner()
                    self._scanner.feed(self._partial)
                    self._scanner.feed(chunk[room:] if room > 0 else chunk)
                if not chunk.endswith(b"\n"):
                    continue  # the line goes on (or the file ends here for now)
            elif self._partial_size == 0:
                self._check_swap()
                break
            else:  # a tail without its newline: it may still be being written
                if self._partial_since == 0.0:
                    self._partial_since = time.monotonic()
                if time.monotonic() - self._partial_since < _PARTIAL_LINE_GRACE_S:
                    break
            message = self._take_line()
            if message is not None:
                out.append(message)
        return out

    def _take_line(self) -> Message | None:
        line, size = bytes(self._partial), self._partial_size
        ids = self._scanner.ids if self._scanner is not None else None
        self._partial, self._partial_size, self._partial_since = bytearray(), 0, 0.0
        self._scanner = None
        self._line_no += 1
        body = line.strip()
        if (not body and size <= len(line)) or self._is_done(self._line_no):
            return None
        self._open.add(self._line_no)
        # A line cut short carries its raw length, so the worker sees it is too large.
        return Message(body=body, message_id=f"file:{self._line_no}", key=None,
                       handle=self._line_no, received_at=time.time(),
                       size=size if size > len(line) else None, ids=ids)

    def _check_swap(self) -> None:
        # A spool replaced while running: this run finishes the file it opened.
        if self._warned_swap or self._reader is None:
            return
        try:
            swapped = os.fstat(self._reader.fileno()).st_ino != self.path.stat().st_ino
        except OSError:
            swapped = True
        if swapped:
            self._warned_swap = True
            log.warning("spool %s was replaced while running: this run serves the file it "
                        "opened; the new one is served from line 1 by the next run", self.path)

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
        unread = self._partial_size > 0 or self.path.stat().st_size > self._reader.tell()
        return len(self._open) + (1 if unread else 0)

    def uncommitted_count(self) -> int:
        """Lines served and not yet recorded as done."""
        return len(self._open)

    async def dead_letter(self, msg: Message, reason: str) -> None:
        """Append ``{"message_id", "reason", "body"}`` to ``<file>.dlq``, then ack.

        ``body_base64`` keeps bytes that are not UTF-8; a line longer than the worker
        accepts keeps its head only (``size`` is its full size).
        """
        record: dict[str, object] = {
            "message_id": msg.message_id,
            "reason": reason,
            "body": msg.body.decode("utf-8", errors="replace"),
        }
        try:
            msg.body.decode("utf-8")
        except UnicodeDecodeError:
            record["body_base64"] = base64.b64encode(msg.body).decode("ascii")
        if msg.size is not None:
            record["size"], record["truncated"] = msg.size, True
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
