"""A batch's lifecycle objects beside its manifest (docs/formats.md, "Batch lifecycle").

- ``<prefix>/<batch>/_cancel.json``: written once by ``qworker cancel`` (a conditional
  put: the first cancel wins, a second one changes nothing)::

      {"object": "qworker.cancel", "batch_id": "batch_...", "cancelling_at": 1764460000}

  Workers look for it (qworker/worker/cancel_watch.py); ``status`` reads it.
- ``<prefix>/<batch>/_failed.json``: written by ``qworker produce`` when sending failed
  part-way (``status``: ``failed``)::

      {"object": "qworker.failed", "batch_id": "batch_...", "failed_at": 1764460001,
       "error": "KafkaConnectionError(...)"}

- ``<prefix>/<batch>/_collected.json``: where ``qworker collect`` last wrote the batch
  (``output_file_id`` / ``error_file_id`` of the status object), replaced by each collect.
- ``parse_window``: ``produce --completion-window`` (``24h``, ``90m``, ``30s``, ``2d``,
  or ``none``: jobs are sent without a stamped deadline).

Who writes what follows the deployment's IAM policies (deploy/terraform/iam.tf): the
producer writes ``_manifest.json``, ``_failed.json`` and ``_cancel.json`` (it may not
read the marker back: a second cancel only learns that it exists), the collector reads
everything and writes ``_collected.json``.
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass
from typing import Any

import orjson

from qworker.batch.files import is_s3
from qworker.batch.manifest import read_manifest
from qworker.batch.store import BatchStore
from qworker.schema import batch_folder, cancel_key, collected_key, failed_key, result_key

CANCEL_OBJECT = "qworker.cancel"
FAILED_OBJECT = "qworker.failed"
COLLECTED_OBJECT = "qworker.collected"
_WINDOW = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhd])\s*$")
_UNIT_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
#: ``--completion-window none``: no deadline stamped, the batch never expires.
NO_WINDOW = "none"


def parse_window(text: str) -> int | None:
    """Seconds of a completion window written ``<number><s|m|h|d>`` (``24h``), or None for
    ``none``; ValueError for anything else."""
    if text.strip().lower() == NO_WINDOW:
        return None
    match = _WINDOW.match(text)
    if not match:
        raise ValueError(f"--completion-window {text!r} must be a duration such as 24h, "
                         "90m or 30s, or none")
    seconds = int(float(match.group(1)) * _UNIT_SECONDS[match.group(2)])
    if seconds <= 0:
        raise ValueError(f"--completion-window {text!r} must be longer than 0 seconds")
    return seconds


@dataclass(slots=True, frozen=True)
class CancelMarker:
    """A batch's cancel request: when it was made (unix seconds)."""

    batch_id: str
    cancelling_at: int

    def to_json(self) -> bytes:
        """The stored form."""
        return orjson.dumps({"object": CANCEL_OBJECT, "batch_id": self.batch_id,
                             "cancelling_at": self.cancelling_at})

    @classmethod
    def from_json(cls, data: bytes, batch_id: str) -> CancelMarker:
        """Parse a stored marker; an unreadable one still cancels (time 0)."""
        return cls(batch_id, _unix(_object(data).get("cancelling_at")))


def _object(data: bytes) -> dict[str, Any]:
    """A stored marker's JSON object; ``{}`` when it is not one (unreadable)."""
    try:
        obj = orjson.loads(data)
    except orjson.JSONDecodeError:
        return {}
    return obj if isinstance(obj, dict) else {}


def _unix(value: Any) -> int:
    """A marker's time field as unix seconds; 0 when it is not a number."""
    return int(value) if isinstance(value, int | float) else 0


def read_cancel(store: BatchStore, batch_id: str) -> CancelMarker | None:
    """The batch's cancel marker, or None when it was never cancelled."""
    data = store.get(cancel_key(store.prefix, batch_id))
    return CancelMarker.from_json(data, batch_id) if data is not None else None


def cancel_batch(store: BatchStore, batch_id: str) -> tuple[CancelMarker, bool]:
    """Write the batch's cancel marker once: ``(marker, True)``, or ``(marker, False)``
    when one was already there (that one is kept; the returned marker is not it).

    Refuses (ValueError) a batch without a manifest: a mistyped id would otherwise
    leave a marker that cancels nothing, and ``status`` could never show it ending.
    Refuses a batch that already ended (every job has a result, or its completion window
    passed), as OpenAI does: a completed or expired batch stays so, never ``cancelled``.
    """
    from qworker.batch.listing import split_points

    manifest = read_manifest(store, batch_id)
    if manifest is None:
        raise ValueError(f"no batch {batch_id!r} here (no manifest): only a batch sent by "
                         "`qworker produce` can be cancelled")
    marker = CancelMarker(batch_id, int(time.time()))
    key = cancel_key(store.prefix, batch_id)
    expected = [result_key(store.prefix, batch_id, cid) for cid in manifest.custom_ids]
    names = set(store.list_names(batch_folder(store.prefix, batch_id),
                                 split_points(expected, 16)))
    if key not in names:
        if manifest.expires_at is not None and marker.cancelling_at >= manifest.expires_at:
            raise ValueError(f"batch {batch_id!r} has already ended: its completion window "
                             f"passed at {manifest.expires_at} (status expired); an ended "
                             "batch cannot be cancelled")
        if all(k in names for k in expected):
            raise ValueError(f"batch {batch_id!r} has already ended: every job has a result "
                             "(status completed); an ended batch cannot be cancelled")
    return marker, store.put_new(key, marker.to_json())


@dataclass(slots=True, frozen=True)
class FailedMarker:
    """``produce`` did not finish sending the batch."""

    batch_id: str
    failed_at: int
    error: str


def write_failed(store: BatchStore, batch_id: str, error: str) -> None:
    """Record that sending ``batch_id`` failed (replacing an earlier record)."""
    store.put(failed_key(store.prefix, batch_id), orjson.dumps({
        "object": FAILED_OBJECT, "batch_id": batch_id, "failed_at": int(time.time()),
        "error": error}))


def read_failed(store: BatchStore, batch_id: str) -> FailedMarker | None:
    """The batch's failure record, or None when produce did not fail."""
    data = store.get(failed_key(store.prefix, batch_id))
    if data is None:
        return None
    obj = _object(data)
    return FailedMarker(batch_id, _unix(obj.get("failed_at")),
                        str(obj.get("error") or "produce did not finish"))


@dataclass(slots=True, frozen=True)
class Collected:
    """Where the last ``collect`` wrote the batch's lines."""

    output_file_id: str
    error_file_id: str | None
    collected_at: int


def file_id(uri: str) -> str:
    """An output location as recorded: ``s3://...`` as given, a local path made absolute."""
    return uri if is_s3(uri) else os.path.abspath(uri)


def write_collected(store: BatchStore, batch_id: str, collected: Collected) -> None:
    """Record (replacing any earlier) where ``collect`` wrote ``batch_id``."""
    store.put(collected_key(store.prefix, batch_id), orjson.dumps({
        "object": COLLECTED_OBJECT, "batch_id": batch_id,
        "output_file_id": collected.output_file_id, "error_file_id": collected.error_file_id,
        "collected_at": collected.collected_at}))


def read_collected(store: BatchStore, batch_id: str) -> Collected | None:
    """What the last ``collect`` recorded, or None (never collected, or unreadable)."""
    data = store.get(collected_key(store.prefix, batch_id))
    if data is None:
        return None
    obj = _object(data)
    if not isinstance(obj.get("output_file_id"), str):
        return None
    error = obj.get("error_file_id")
    return Collected(obj["output_file_id"], error if isinstance(error, str) else None,
                     int(obj.get("collected_at") or 0))
