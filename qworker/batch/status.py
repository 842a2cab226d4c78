"""``qworker status``: an OpenAI ``Batch`` object of a stored batch (docs/formats.md).

The object validates as the openai SDK's ``Batch`` and keeps OpenAI's meanings, plus
qworker's ``missing_count`` / ``missing`` (custom_ids without a result, first 100, input
order), ``conflicts`` and ``unexpected`` (results for ids the manifest does not name).

``status`` (``lifecycle_status``), first match wins: ``failed`` when produce could not
send it all (``_failed.json``); ``validating`` while produce sends; ``cancelling`` /
``cancelled`` once ``qworker cancel`` wrote the marker (results missing / all there);
``expired`` once the completion window (``expires_at``) passed with results missing or
some answered ``batch_expired``; ``completed`` when every id has a result; else
``in_progress``. Without a manifest the total is what is stored and the status stays
``in_progress``. ``request_counts`` count only the manifest's ids; ``batch_expired`` /
``batch_cancelled`` lines count as failed (as OpenAI counts them). ``usage`` sums the
records' token counts.

Counting means reading each result once. Results never change after they are written
(the first write wins), so what was read is remembered in a local cache
(``$XDG_CACHE_HOME/qworker/status/``): polling a large batch reads only new objects.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from qworker.batch.lifecycle import (
    CancelMarker,
    Collected,
    FailedMarker,
    read_cancel,
    read_collected,
    read_failed,
)
from qworker.batch.listing import BatchListing, scan_batch
from qworker.batch.manifest import Manifest, ManifestState
from qworker.batch.store import DEFAULT_WORKERS, BatchStore, ordered_map
from qworker.schema import error_of

MISSING_SHOWN = 100


def _cache_path(uri: str, batch_id: str, manifest: Manifest | None = None) -> Path:
    # The manifest's creation time is part of the name: a results folder emptied and the
    # batch id produced again there is a new batch, whose results the old cache would hide.
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    created = manifest.created if manifest is not None else None
    digest = hashlib.sha256(f"{uri}\n{batch_id}\n{created}".encode()).hexdigest()[:24]
    return base / "qworker" / "status" / f"{digest}.v3.tsv"


@dataclass(slots=True, frozen=True)
class Outcome:
    """What one result says: its error code ("" when served), tokens, creation time."""

    code: str
    input_tokens: int = 0
    output_tokens: int = 0
    total_tokens: int = 0
    cached_tokens: int = 0
    reasoning_tokens: int = 0
    created: int = 0

    def to_fields(self) -> str:
        """The cache line's fields after the key."""
        return "\t".join([self.code, *(str(v) for v in (
            self.input_tokens, self.output_tokens, self.total_tokens, self.cached_tokens,
            self.reasoning_tokens, self.created))])

    @classmethod
    def from_fields(cls, fields: list[str]) -> Outcome | None:
        """Parse ``to_fields``' output; None for a damaged line (it is read again)."""
        if len(fields) != 7:
            return None
        try:
            return cls(fields[0], *(int(v) for v in fields[1:]))
        except ValueError:
            return None


class OutcomeCache:
    """key -> ``Outcome`` of results already read; append-only file."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.known: dict[str, Outcome] = {}
        if path is not None and path.exists():
            for line in path.read_text(encoding="utf-8").splitlines():
                key, sep, rest = line.partition("\t")
                outcome = Outcome.from_fields(rest.split("\t")) if sep else None
                if outcome is not None:
                    self.known[key] = outcome

    def add(self, items: Iterable[tuple[str, Outcome]]) -> None:
        """Remember new outcomes (and append them to the file)."""
        new = [(k, o) for k, o in items if k not in self.known]
        self.known.update(new)
        if self.path is not None and new:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self.path.open("a", encoding="utf-8") as f:
                f.writelines(f"{k}\t{o.to_fields()}\n" for k, o in new)


def _int(value: Any) -> int:
    return int(value) if isinstance(value, int | float) and not isinstance(value, bool) else 0


def outcome_of(body: bytes, stored_at: int = 0) -> Outcome:
    """The ``Outcome`` of one stored line (unreadable -> code ``unreadable``).

    ``created`` is the served body's ``created`` / ``created_at``; an embeddings body has
    neither, so it is ``stored_at`` (when the line was stored, unix seconds).

    Tokens come from the served body's ``usage``: chat and completions
    ``prompt_tokens`` / ``completion_tokens`` (details ``prompt_tokens_details.
    cached_tokens``, ``completion_tokens_details.reasoning_tokens``), responses
    ``input_tokens`` / ``output_tokens`` (``input_tokens_details`` /
    ``output_tokens_details``), embeddings ``prompt_tokens``.
    """
    try:
        record = orjson.loads(body)
    except orjson.JSONDecodeError:
        return Outcome("unreadable")
    if not isinstance(record, dict):
        return Outcome("unreadable")
    error = error_of(record)
    if error is not None:
        return Outcome(str(error.get("code") or "error"))
    response = record.get("response")
    payload = response.get("body") if isinstance(response, dict) else None
    payload = payload if isinstance(payload, dict) else {}
    usage = payload.get("usage")
    usage = usage if isinstance(usage, dict) else {}
    inp = _int(usage.get("input_tokens", usage.get("prompt_tokens")))
    out = _int(usage.get("output_tokens", usage.get("completion_tokens")))
    in_details = usage.get("input_tokens_details") or usage.get("prompt_tokens_details")
    out_details = usage.get("output_tokens_details") or usage.get("completion_tokens_details")
    cached = _int(in_details.get("cached_tokens")) if isinstance(in_details, dict) else 0
    reasoning = _int(out_details.get("reasoning_tokens")) if isinstance(out_details, dict) else 0
    total = _int(usage.get("total_tokens")) or inp + out
    created = _int(payload.get("created", payload.get("created_at"))) or stored_at
    return Outcome("", inp, out, total, cached, reasoning, created)


def outcome_code(body: bytes) -> str:
    """"" for a served result, else its error code (unreadable -> ``unreadable``)."""
    return outcome_of(body).code


def batch_status(
    store: BatchStore,
    batch_id: str,
    uri: str,
    use_cache: bool = True,
    workers: int = DEFAULT_WORKERS,
    now: float | None = None,
) -> dict[str, Any]:
    """The status object of ``batch_id`` under the results location ``uri``."""
    listing = scan_batch(store, batch_id)
    cache = OutcomeCache(_cache_path(uri, batch_id, listing.manifest) if use_cache else None)
    keys = listing.result_keys
    todo = [k for k in keys if k not in cache.known]
    fetched = []
    for key, body, stored_at in ordered_map(lambda k: (k, *store.get_stored(k)), todo,
                                            workers):
        if body is not None:
            fetched.append((key, outcome_of(body, stored_at)))
    cache.add(fetched)
    # With a manifest the counts are of its ids (so completed + failed <= total); results
    # for other ids show in ``unexpected``.
    counted = [k for k in keys if k in listing.present] if listing.manifest else keys
    outcomes = [cache.known[k] for k in counted if k in cache.known]
    has_manifest = listing.manifest is not None
    cancel = read_cancel(store, batch_id) if has_manifest else None
    failed_marker = read_failed(store, batch_id) if has_manifest else None
    collected = read_collected(store, batch_id)
    return _status_object(listing, uri, outcomes, cancel, failed_marker, collected,
                          time.time() if now is None else now)


def lifecycle_status(manifest: Manifest | None, missing: int, expired_lines: int,
                     cancel: CancelMarker | None, failed: FailedMarker | None,
                     now: float) -> str:
    """The batch's OpenAI status; see the module docstring for the order of the checks."""
    if manifest is None:
        return "in_progress"
    if failed is not None and (manifest.sent_at is None or failed.failed_at > manifest.sent_at):
        return "failed"  # a later produce of the same file that finished supersedes it
    if manifest.state == ManifestState.SENDING:
        return "validating"
    if cancel is not None:
        return "cancelling" if missing else "cancelled"
    past_window = manifest.expires_at is not None and now >= manifest.expires_at
    if past_window and (missing or expired_lines):
        return "expired"
    return "in_progress" if missing else "completed"


def _usage(outcomes: list[Outcome]) -> dict[str, Any]:
    return {
        "input_tokens": sum(o.input_tokens for o in outcomes),
        "input_tokens_details": {"cached_tokens": sum(o.cached_tokens for o in outcomes)},
        "output_tokens": sum(o.output_tokens for o in outcomes),
        "output_tokens_details": {"reasoning_tokens": sum(o.reasoning_tokens for o in outcomes)},
        "total_tokens": sum(o.total_tokens for o in outcomes),
    }


def _status_object(
    listing: BatchListing, uri: str, outcomes: list[Outcome], cancel: CancelMarker | None,
    failed_marker: FailedMarker | None, collected: Collected | None, now: float,
) -> dict[str, Any]:
    manifest = listing.manifest
    missing = listing.missing
    failed = sum(1 for o in outcomes if o.code)
    completed = len(outcomes) - failed
    expired_lines = sum(1 for o in outcomes if o.code == "batch_expired")
    total = manifest.total if manifest is not None else completed + failed
    status = lifecycle_status(manifest, len(missing), expired_lines, cancel, failed_marker,
                              now)
    created = manifest.created if manifest is not None else 0
    # The newest record's time (served bodies carry one); never before the batch began.
    last = max([created, *(o.created for o in outcomes)])
    times: dict[str, int | None] = {
        "in_progress_at": (manifest.sent_at or created) if manifest is not None
        and status not in ("validating", "failed") else None,
        "expires_at": manifest.expires_at if manifest is not None else None,
        "cancelling_at": cancel.cancelling_at if cancel is not None else None,
        "cancelled_at": max(last, cancel.cancelling_at)
        if cancel is not None and status == "cancelled" else None,
        "expired_at": (manifest.expires_at or last)
        if manifest is not None and status == "expired" else None,
        "completed_at": last if status == "completed" else None,
        "failed_at": failed_marker.failed_at
        if failed_marker is not None and status == "failed" else None,
    }
    errors = None
    if failed_marker is not None and status == "failed":
        errors = {"object": "list", "data": [{
            "code": "produce_failed", "message": failed_marker.error, "line": None,
            "param": None}]}
    return {
        "id": listing.batch_id,
        "object": "batch",
        "endpoint": (manifest.endpoint if manifest else None) or "",
        "input_file_id": manifest.input if manifest else "",
        "completion_window": (manifest.completion_window if manifest else None) or "none",
        "status": status,
        "created_at": created,
        **times,
        "errors": errors,
        "output_file_id": collected.output_file_id if collected else None,
        "error_file_id": collected.error_file_id if collected else None,
        "request_counts": {"total": total, "completed": completed, "failed": failed},
        "usage": _usage(outcomes),
        "metadata": None,
        "results": uri,
        "manifest": manifest is not None,
        "missing_count": len(missing),
        "missing": missing[:MISSING_SHOWN],
        "conflicts": len(listing.conflicts),
        "unexpected": len(listing.unexpected),
    }
