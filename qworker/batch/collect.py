"""``qworker collect``: a batch's stored results as OpenAI-style JSONL files.

With a manifest, lines come in the input's order (the listing tells which are
stored; the others are missing ids), then results for ids the manifest does not
name; without one, in key order. Served lines go to ``results``, failed ones (400, 500,
expired) to ``errors``, followed by the batch's conflict records
(``_conflicts/``, ``duplicate_custom_id``). GETs run on a thread pool; progress is a
tqdm bar on stderr.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import IO

import orjson

from qworker.batch.listing import BatchListing, scan_batch
from qworker.batch.store import DEFAULT_WORKERS, BatchStore
from qworker.schema import is_error_record


@dataclass(slots=True)
class CollectStats:
    """What one collect wrote."""

    results: int = 0
    errors: int = 0
    conflicts: int = 0
    unexpected: int = 0
    total: int | None = None
    missing: list[str] = field(default_factory=list)


def collect_batch(
    store: BatchStore,
    batch_id: str,
    results: IO[bytes],
    errors: IO[bytes],
    progress: bool = True,
    workers: int = DEFAULT_WORKERS,
    listing: BatchListing | None = None,
) -> CollectStats:
    """Write every stored line of ``batch_id``; see the module docstring.

    ``listing``: the batch's ``scan_batch`` if the caller already made it.
    """
    from tqdm import tqdm

    listing = listing or scan_batch(store, batch_id)
    stats = CollectStats(total=listing.manifest.total if listing.manifest else None)
    stats.unexpected = len(listing.unexpected)
    # Only what the listing saw: a mostly-missing batch costs no storm of 404s.
    keys = listing.result_keys
    stats.missing = listing.missing
    bar = tqdm(total=len(keys) + len(listing.conflicts), unit="obj", file=sys.stderr,
               disable=not progress, desc=f"collect {batch_id}", dynamic_ncols=True)
    try:
        for key, body in store.get_many(keys, workers):
            bar.update(1)
            if body is None:
                stats.missing.append(listing.expected.get(key, key))
                continue
            line = body.strip() + b"\n"
            if _failed(body):
                errors.write(line)
                stats.errors += 1
            else:
                results.write(line)
                stats.results += 1
        for _key, body in store.get_many(listing.conflicts, workers):
            bar.update(1)
            if body is not None:
                errors.write(body.strip() + b"\n")
                stats.conflicts += 1
    finally:
        bar.close()
    return stats


def _failed(body: bytes) -> bool:
    try:
        record = orjson.loads(body)
    except orjson.JSONDecodeError:
        return True
    return not isinstance(record, dict) or is_error_record(record)
