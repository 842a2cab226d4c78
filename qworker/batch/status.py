"""``qworker status``: an OpenAI-batch-object-like view of a stored batch.

The object has the fields of OpenAI's ``Batch`` (``id``, ``object: "batch"``,
``status``, ``request_counts {total, completed, failed}``, ...) plus qworker's
``missing_count`` / ``missing`` (custom_ids without a result, first 100, input order),
``conflicts`` and ``unexpected`` (results for ids the manifest does not name). Status is
``completed`` once every id of the manifest has a result, else ``in_progress``; without
a manifest the total is what is stored and the status stays ``in_progress``. With a
manifest, ``request_counts`` count only the manifest's ids.

Counting ``failed`` means reading each result once. Results never change after they
are written (the first write wins), so what was read is remembered in a local cache
(``$XDG_CACHE_HOME/qworker/status/``): polling a large batch reads only new objects.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import orjson

from qworker.batch.listing import BatchListing, scan_batch
from qworker.batch.store import DEFAULT_WORKERS, BatchStore
from qworker.schema import error_of

MISSING_SHOWN = 100


def _cache_path(uri: str, batch_id: str) -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    digest = hashlib.sha256(f"{uri}\n{batch_id}".encode()).hexdigest()[:24]
    return base / "qworker" / "status" / f"{digest}.tsv"


class OutcomeCache:
    """key -> error code ("" for a success) of results already read; append-only file."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.known: dict[str, str] = {}
        if path is not None and path.exists():
            for line in path.read_text(encoding="utf-8").splitlines():
                key, sep, code = line.partition("\t")
                if sep:
                    self.known[key] = code

    def add(self, items: Iterable[tuple[str, str]]) -> None:
        """Remember new outcomes (and append them to the file)."""
        new = [(k, c) for k, c in items if k not in self.known]
        self.known.update(new)
        if self.path is not None and new:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self.path.open("a", encoding="utf-8") as f:
                f.writelines(f"{k}\t{c}\n" for k, c in new)


def outcome_code(body: bytes) -> str:
    """"" for a served result, else its error code (unreadable -> ``unreadable``)."""
    try:
        record = orjson.loads(body)
    except orjson.JSONDecodeError:
        return "unreadable"
    error = error_of(record) if isinstance(record, dict) else {"code": "unreadable"}
    return "" if error is None else str(error.get("code") or "error")


def batch_status(
    store: BatchStore,
    batch_id: str,
    uri: str,
    use_cache: bool = True,
    workers: int = DEFAULT_WORKERS,
) -> dict[str, Any]:
    """The status object of ``batch_id`` under the results location ``uri``."""
    listing = scan_batch(store, batch_id)
    cache = OutcomeCache(_cache_path(uri, batch_id) if use_cache else None)
    keys = listing.result_keys
    todo = [k for k in keys if k not in cache.known]
    fetched = []
    for key, body in store.get_many(todo, workers):
        if body is not None:
            fetched.append((key, outcome_code(body)))
    cache.add(fetched)
    # With a manifest the counts are of its ids (so completed + failed <= total); results
    # for other ids show in ``unexpected``.
    counted = [k for k in keys if k in listing.present] if listing.manifest else keys
    codes = [cache.known[k] for k in counted if k in cache.known]
    failed = sum(1 for c in codes if c)
    return _status_object(listing, uri, len(codes) - failed, failed)


def _status_object(
    listing: BatchListing, uri: str, completed: int, failed: int
) -> dict[str, Any]:
    manifest = listing.manifest
    missing = listing.missing
    if manifest is not None:
        total = manifest.total
        done = not missing
    else:
        total = completed + failed
        done = False
    status = "completed" if done else "in_progress"
    created = manifest.created if manifest is not None else 0
    return {
        "id": listing.batch_id,
        "object": "batch",
        "endpoint": (manifest.endpoint if manifest else None) or "",
        "input_file_id": manifest.input if manifest else "",
        "completion_window": "none",
        "status": status,
        "created_at": created,
        "in_progress_at": created or None,
        "output_file_id": None,
        "error_file_id": None,
        "request_counts": {"total": total, "completed": completed, "failed": failed},
        "metadata": None,
        "results": uri,
        "manifest": manifest is not None,
        "missing_count": len(missing),
        "missing": missing[:MISSING_SHOWN],
        "conflicts": len(listing.conflicts),
        "unexpected": len(listing.unexpected),
    }
