"""Object keys of a batch (docs/formats.md, "Object keys").

``<prefix>/<batch>/<safe(custom_id)>.json`` holds one result; beside the results,
qworker's own objects start with ``_`` (``_manifest.json``, ``_conflicts/``, and at the
prefix level ``_dead_letters/``), a name
``safe_segment`` never yields for an id. ``safe_segment`` makes any string a safe,
injective key segment; ``result_key`` builds the full key every sink is given.
"""

from __future__ import annotations

import hashlib
import re

DEFAULT_BATCH = "default"
MAX_SAFE_BYTES = 200
_HASH_MARK = "sha256-"
_SAFE = re.compile(rb"[A-Za-z0-9._-]")
MANIFEST_NAME = "_manifest.json"
CANCEL_NAME = "_cancel.json"
COLLECTED_NAME = "_collected.json"
FAILED_NAME = "_failed.json"
CONFLICTS_DIR = "_conflicts"
DEAD_LETTERS_DIR = "_dead_letters"


def safe_segment(value: str) -> str:
    """One key segment for ``value``: keeps ``[A-Za-z0-9._-]``, percent-encodes the rest.

    Never ``.`` or ``..``; an encoding longer than 200 bytes becomes
    ``sha256-<hex>`` of the UTF-8 value. Injective: a short value that would itself
    start with ``sha256-`` has its first byte encoded, and so does a leading ``_``
    (names starting with ``_`` are qworker's own objects).
    """
    raw = value.encode("utf-8")
    out = "".join(chr(b) if _SAFE.fullmatch(bytes([b])) else f"%{b:02X}" for b in raw)
    if out in ("", ".", ".."):
        out = "".join(f"%{b:02X}" for b in raw) or "%00"
    if len(out) > MAX_SAFE_BYTES:
        return _HASH_MARK + hashlib.sha256(raw).hexdigest()
    if out.startswith((_HASH_MARK, "_")):
        out = f"%{ord(out[0]):02X}" + out[1:]
    return out


def result_key(prefix: str, batch_id: str | None, custom_id: str) -> str:
    """``<prefix>/<batch_id or "default">/<safe(custom_id)>.json`` (no prefix: no leading /)."""
    batch = safe_segment(batch_id) if batch_id else DEFAULT_BATCH
    key = f"{batch}/{safe_segment(custom_id)}.json"
    prefix = prefix.strip("/")
    return f"{prefix}/{key}" if prefix else key


def batch_folder(prefix: str, batch_id: str | None) -> str:
    """``<prefix>/<batch>/``: the key prefix (with its trailing ``/``) of one batch."""
    return result_key(prefix, batch_id, "x").rsplit("/", 1)[0] + "/"


def manifest_key(prefix: str, batch_id: str | None) -> str:
    """``<prefix>/<batch>/_manifest.json``, written by ``qworker produce``."""
    return batch_folder(prefix, batch_id) + MANIFEST_NAME


def cancel_key(prefix: str, batch_id: str | None) -> str:
    """``<prefix>/<batch>/_cancel.json``, written once by ``qworker cancel``."""
    return batch_folder(prefix, batch_id) + CANCEL_NAME


def collected_key(prefix: str, batch_id: str | None) -> str:
    """``<prefix>/<batch>/_collected.json``: where ``qworker collect`` last wrote the batch."""
    return batch_folder(prefix, batch_id) + COLLECTED_NAME


def failed_key(prefix: str, batch_id: str | None) -> str:
    """``<prefix>/<batch>/_failed.json``: ``qworker produce`` could not send the batch."""
    return batch_folder(prefix, batch_id) + FAILED_NAME


def conflict_key(prefix: str, batch_id: str | None, custom_id: str, fingerprint: str) -> str:
    """``<prefix>/<batch>/_conflicts/<safe(custom_id)>-<fingerprint[:12]>.json``."""
    folder = batch_folder(prefix, batch_id) + CONFLICTS_DIR
    return f"{folder}/{safe_segment(custom_id)}-{fingerprint[:12]}.json"


def dead_letter_key(prefix: str, source: str, message_id: str) -> str:
    """``<prefix>/_dead_letters/<source>-<safe(message_id)>.json`` (a message that is no job,
    where the source has no dead-letter target or it refused the message)."""
    name = f"{DEAD_LETTERS_DIR}/{source}-{safe_segment(message_id)}.json"
    prefix = prefix.strip("/")
    return f"{prefix}/{name}" if prefix else name
