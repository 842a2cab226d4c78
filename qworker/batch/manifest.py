"""The manifest ``qworker produce`` writes: what a batch holds, in input order.

Stored as ``<results>/<batch>/_manifest.json`` (docs/formats.md, "Manifest")::

    {"object": "qworker.manifest", "batch_id": "batch_...", "total": 3,
     "input": "requests.jsonl", "created": 1764460000, "endpoint": "/v1/chat/completions",
     "to": "kafka://...", "completion_window": "24h", "expires_at": 1764546400,
     "state": "sent", "sent_at": 1764460002, "custom_ids": ["a", "b", "c"]}

``state`` is ``sending`` while produce sends (``status``: ``validating``) and ``sent``
once every job is sent; a manifest without it (an older produce) reads as sent. A
produce that fails part-way writes ``_failed.json`` beside it (qworker/batch/lifecycle.py).

``scan_input`` is produce's first pass over the input: it refuses duplicate
``custom_id``s (as OpenAI does), settles the batch id and collects the ids in order;
``job_items`` is the second pass that yields the messages to send.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import IO, Any

import orjson

from qworker.batch.store import BatchStore
from qworker.schema import manifest_key

MANIFEST_OBJECT = "qworker.manifest"
_SHOWN = 5
#: The ``endpoint`` of a batch produced with ``--allow-mixed`` from several urls.
MIXED_ENDPOINT = "mixed"


class ManifestState:
    """How far ``produce`` got (the manifest's ``state``)."""

    SENDING = "sending"
    SENT = "sent"


class DuplicateCustomIdError(ValueError):
    """The input uses one ``custom_id`` on more than one line."""


def new_batch_id() -> str:
    """``batch_<32 hex>``, OpenAI's shape for batch ids."""
    return f"batch_{uuid.uuid4().hex}"


@dataclass(slots=True)
class Manifest:
    """One produced batch: ``total`` jobs with these ``custom_ids`` (input order)."""

    batch_id: str
    total: int
    input: str
    created: int
    custom_ids: list[str]
    endpoint: str | None = None
    to: str | None = None
    skipped_lines: int = 0
    completion_window: str | None = None
    expires_at: int | None = None
    state: str = ManifestState.SENT
    sent_at: int | None = None

    def to_json(self) -> bytes:
        """The stored form."""
        return orjson.dumps({
            "object": MANIFEST_OBJECT, "batch_id": self.batch_id, "total": self.total,
            "input": self.input, "created": self.created, "endpoint": self.endpoint,
            "to": self.to, "skipped_lines": self.skipped_lines,
            "completion_window": self.completion_window, "expires_at": self.expires_at,
            "state": self.state, "sent_at": self.sent_at,
            "custom_ids": self.custom_ids,
        })

    @classmethod
    def from_json(cls, data: bytes) -> Manifest:
        """Parse a stored manifest; ValueError when it is not one."""
        obj = orjson.loads(data)
        if not isinstance(obj, dict) or obj.get("object") != MANIFEST_OBJECT:
            raise ValueError("not a qworker manifest")
        ids = obj.get("custom_ids") or []
        return cls(batch_id=str(obj["batch_id"]), total=int(obj.get("total", len(ids))),
                   input=str(obj.get("input", "")), created=int(obj.get("created", 0)),
                   custom_ids=[str(i) for i in ids], endpoint=obj.get("endpoint"),
                   to=obj.get("to"), skipped_lines=int(obj.get("skipped_lines", 0)),
                   completion_window=obj.get("completion_window"),
                   expires_at=_int_or_none(obj.get("expires_at")),
                   state=str(obj.get("state") or ManifestState.SENT),
                   sent_at=_int_or_none(obj.get("sent_at")))


def _int_or_none(value: Any) -> int | None:
    return int(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


class BatchExistsError(ValueError):
    """The batch id already has a manifest listing other ``custom_id``s."""


def write_manifest(store: BatchStore, manifest: Manifest) -> str:
    """Store ``manifest`` beside the batch's results; return its key.

    A manifest already stored for the batch id is kept when it lists the same
    ``custom_ids`` in the same order (sending a file again; its ``created`` stays), and
    refused with ``BatchExistsError`` when it lists others: replacing it would make the
    earlier jobs' results "unexpected" and change the batch's total behind its back.
    """
    key = manifest_key(store.prefix, manifest.batch_id)
    stored = read_manifest(store, manifest.batch_id)
    if stored is not None:
        if stored.custom_ids != manifest.custom_ids:
            raise BatchExistsError(
                f"batch {manifest.batch_id!r} already has a manifest ({stored.total} jobs from "
                f"{stored.input or 'another input'}) with other custom_ids; pass another "
                "--batch-id (or --no-manifest to send without a manifest)"
            )
        manifest.created = stored.created
    store.put(key, manifest.to_json())
    return key


def read_manifest(store: BatchStore, batch_id: str) -> Manifest | None:
    """The batch's manifest, or None when ``produce`` wrote none (or another tool sent it)."""
    data = store.get(manifest_key(store.prefix, batch_id))
    return Manifest.from_json(data) if data is not None else None


class JobTooLargeError(ValueError):
    """A line of the input is larger than ``max_job_bytes``."""


class MixedEndpointsError(ValueError):
    """The input's lines name more than one ``url`` (and ``--allow-mixed`` was not given)."""


@dataclass(slots=True)
class _Scan:
    ids: list[str] = field(default_factory=list)
    oversize: list[tuple[int, int]] = field(default_factory=list)
    first_line: dict[str, int] = field(default_factory=dict)
    duplicates: list[tuple[str, int, int]] = field(default_factory=list)
    batch_ids: set[str | None] = field(default_factory=set)
    endpoints: dict[str, int] = field(default_factory=dict)
    skipped: int = 0


def scan_input(
    f: IO[bytes], batch_id: str | None, input_name: str, max_job_bytes: int | None = None,
    allow_mixed: bool = False, deadline: int | None = None,
) -> Manifest:
    """First pass over a requests file: ids in order, duplicates refused, batch id settled.

    ``batch_id`` given: every job gets it. Not given: the jobs' own ``batch_id`` when they
    all carry the same one, a fresh ``batch_<uuid>`` when none does; a file mixing
    batch ids needs ``batch_id``. Lines that are not JSON objects with a string
    ``custom_id`` are counted in ``skipped_lines`` (they are still sent: the worker
    dead-letters them). ``max_job_bytes``: a file with a job longer than that, as sent (its
    batch id set), is refused (``JobTooLargeError``): the worker would answer it only with
    an error, and a queue may not carry it at all.

    A batch has one endpoint, as OpenAI's: lines naming different ``url``s are refused
    (``MixedEndpointsError``, listing them) unless ``allow_mixed``, when the manifest's
    endpoint is ``"mixed"``. ``deadline``: what ``job_items`` stamps (sizes count it).
    """
    if batch_id is not None and not batch_id:
        raise ValueError("--batch-id must not be empty (a job's batch_id is a non-empty string)")
    scan = _Scan()
    fresh = new_batch_id()
    for line_no, raw in enumerate(f, 1):
        body = raw.strip()
        if not body:
            continue
        try:
            data = orjson.loads(body)
        except orjson.JSONDecodeError:
            data = None
        if max_job_bytes is not None:
            size = _sent_size(body, data, batch_id, fresh, deadline)
            if size > max_job_bytes:
                scan.oversize.append((line_no, size))
        cid = data.get("custom_id") if isinstance(data, dict) else None
        if not isinstance(cid, str) or not cid:
            scan.skipped += 1
            continue
        assert isinstance(data, dict)
        if cid in scan.first_line:
            scan.duplicates.append((cid, scan.first_line[cid], line_no))
            continue
        scan.first_line[cid] = line_no
        scan.ids.append(cid)
        own = data.get("batch_id")
        scan.batch_ids.add(own if isinstance(own, str) and own else None)
        if isinstance(data.get("url"), str):
            scan.endpoints[data["url"]] = scan.endpoints.get(data["url"], 0) + 1
    if scan.duplicates:
        shown = "; ".join(f"{c!r} on lines {a} and {b}" for c, a, b in scan.duplicates[:_SHOWN])
        more = len(scan.duplicates) - _SHOWN
        raise DuplicateCustomIdError(
            f"{input_name}: {len(scan.duplicates)} duplicate custom_id(s): {shown}"
            + (f" (and {more} more)" if more > 0 else "")
            + "; every custom_id must be unique within a batch (nothing was sent)"
        )
    if scan.oversize:
        shown = ", ".join(f"line {n} ({size} bytes)" for n, size in scan.oversize[:_SHOWN])
        more = len(scan.oversize) - _SHOWN
        raise JobTooLargeError(
            f"{input_name}: {len(scan.oversize)} line(s) over max_job_bytes "
            f"({max_job_bytes}): {shown}" + (f" (and {more} more)" if more > 0 else "")
            + "; workers answer such jobs only with an error (if theirs allow more, pass "
            "the same --max-job-bytes / QWORKER_MAX_JOB_BYTES here); nothing was sent"
        )
    if batch_id is None:
        own_ids = scan.batch_ids - {None}
        if len(own_ids) > 1 or (own_ids and None in scan.batch_ids):
            raise ValueError(f"{input_name}: lines carry different batch_ids "
                             f"({sorted(map(str, scan.batch_ids))[:4]}); pass --batch-id")
        batch_id = next(iter(own_ids)) if own_ids else fresh
    if len(scan.endpoints) > 1 and not allow_mixed:
        listed = ", ".join(f"{url} ({n} lines)" for url, n in sorted(scan.endpoints.items()))
        raise MixedEndpointsError(
            f"{input_name}: lines name {len(scan.endpoints)} endpoints: {listed}; a batch has "
            "one endpoint (pass --allow-mixed to send them as one batch); nothing was sent")
    endpoint = (next(iter(scan.endpoints)) if len(scan.endpoints) == 1
                else MIXED_ENDPOINT if scan.endpoints else None)
    return Manifest(batch_id=batch_id, total=len(scan.ids), input=input_name,
                    created=int(time.time()), custom_ids=scan.ids, endpoint=endpoint,
                    skipped_lines=scan.skipped)


def _sent_size(body: bytes, data: Any, batch_id: str | None, fresh: str,
               deadline: int | None) -> int:
    """How long ``job_items`` makes this line: the batch id and deadline may lengthen it."""
    if not isinstance(data, dict):
        return len(body)
    own = data.get("batch_id")
    target = batch_id if batch_id is not None else (own if isinstance(own, str) and own else fresh)
    stamped = _stamped(data, target, deadline)
    return len(body) if stamped is None else len(orjson.dumps(stamped))


def _stamped(data: dict[str, Any], batch_id: str,
             deadline: int | None) -> dict[str, Any] | None:
    """``data`` with the batch id and the deadline set, or None when it needs neither.

    A line's own ``deadline`` stays when it is earlier than the batch's (or not a number:
    the worker answers that line ``invalid_request``).
    """
    changes: dict[str, Any] = {}
    if data.get("batch_id") != batch_id:
        changes["batch_id"] = batch_id
    if deadline is not None:
        own = data.get("deadline")
        if own is None or (isinstance(own, int | float) and not isinstance(own, bool)
                           and own > deadline):
            changes["deadline"] = deadline
    return {**data, **changes} if changes else None


def job_items(f: IO[bytes], batch_id: str,
              deadline: int | None = None) -> Iterator[tuple[str | None, bytes]]:
    """Second pass: ``(key, message)`` per non-blank line, ``batch_id`` set on each job and
    ``deadline`` (unix seconds) on each that has none or a later one."""
    for raw in f:
        body = raw.strip()
        if not body:
            continue
        key = None
        try:
            data: Any = orjson.loads(body)
        except orjson.JSONDecodeError:
            data = None  # sent as is: the worker dead-letters it
        if isinstance(data, dict):
            if isinstance(data.get("custom_id"), str):
                key = data["custom_id"]
            stamped = _stamped(data, batch_id, deadline)
            if stamped is not None:
                body = orjson.dumps(stamped)
        yield key, body
