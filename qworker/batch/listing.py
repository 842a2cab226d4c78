"""What a batch's folder holds: its result keys, conflicts, and (with a manifest) the gaps.

``scan_batch`` lists ``<results>/<batch>/`` once (in parallel ranges cut at the
manifest's expected keys) and sorts what it finds: results of the manifest's ids,
results of ids the manifest does not name, and conflict records under ``_conflicts/``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from qworker.batch.manifest import Manifest, read_manifest
from qworker.batch.store import BatchStore
from qworker.schema import CONFLICTS_DIR, batch_folder, result_key


@dataclass(slots=True)
class BatchListing:
    """One listing of a batch. ``expected`` maps result key -> custom_id in input order."""

    batch_id: str
    manifest: Manifest | None
    expected: dict[str, str] = field(default_factory=dict)
    present: set[str] = field(default_factory=set)
    unexpected: list[str] = field(default_factory=list)
    conflicts: list[str] = field(default_factory=list)

    @property
    def missing(self) -> list[str]:
        """custom_ids of the manifest without a stored result, in input order."""
        return [cid for key, cid in self.expected.items() if key not in self.present]

    @property
    def result_keys(self) -> list[str]:
        """Every stored result key: the manifest's in input order, then the others."""
        ordered = [key for key in self.expected if key in self.present]
        return ordered + self.unexpected


#: Keys per ranged lister at least: a range's last page overshoots by up to a page
#: (1000 keys), so ranges this long waste at most a fifth of the listing.
MIN_RANGE_KEYS = 5000


def split_points(keys: list[str], parts: int) -> list[str]:
    """Up to ``parts - 1`` keys cutting the sorted ``keys`` into runs of equal length
    (each at least ``MIN_RANGE_KEYS`` long)."""
    parts = min(parts, len(keys) // MIN_RANGE_KEYS)
    if parts <= 1:
        return []
    ordered = sorted(keys)
    step = len(ordered) / parts
    return sorted({ordered[int(i * step)] for i in range(1, parts)})


def scan_batch(store: BatchStore, batch_id: str, listers: int = 16) -> BatchListing:
    """List the batch's folder and its ``_conflicts/``; see the module docstring."""
    manifest = read_manifest(store, batch_id)
    listing = BatchListing(batch_id, manifest)
    if manifest is not None:
        listing.expected = {result_key(store.prefix, batch_id, cid): cid
                            for cid in manifest.custom_ids}
    folder = batch_folder(store.prefix, batch_id)
    names = store.list_names(folder, split_points(list(listing.expected), listers))
    for key in names:
        if key[len(folder):].startswith("_"):
            continue  # qworker's own objects (the manifest)
        if key in listing.expected:
            listing.present.add(key)
        else:
            listing.unexpected.append(key)
    listing.conflicts = store.list_names(f"{folder}{CONFLICTS_DIR}/")
    return listing
