"""Result sinks and the factory that opens one from a URI.

URIs (docs/formats.md, "URIs"): ``s3://bucket/prefix``, ``file:///path/dir``.

Contract for ``qworker.worker.sinks.s3`` (imported lazily, so a file-only worker
needs no boto3): ``open_sink(uri: str, settings: WorkerSettings) -> Sink`` and
``collect(uri: str, batch_id: str, settings: WorkerSettings) -> Iterator[bytes]``
(blocking; yields the body of every object under ``<prefix>/<batch_id>/``).

Keys given to ``Sink.put`` are complete: ``schema.result_key(sink_prefix(uri), batch_id,
custom_id)``, i.e. for S3 the object key inside the bucket, prefix included; for a
directory the path relative to it.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

from qworker.worker.sinks.base import Sink

if TYPE_CHECKING:
    from qworker.config import WorkerSettings

__all__ = ["Sink", "collect", "open_sink", "sink_prefix", "sink_scheme"]


def sink_scheme(uri: str) -> str:
    """Return the URI's scheme (``s3`` or ``file``); ValueError otherwise."""
    scheme, sep, _ = uri.partition("://")
    if not sep or scheme not in ("s3", "file"):
        raise ValueError(f"sink URI {uri!r} must start with s3:// or file://")
    return scheme


def sink_prefix(uri: str) -> str:
    """The key prefix the worker puts results under: the S3 prefix, or "" for a dir."""
    if sink_scheme(uri) == "s3":
        _, _, rest = uri.partition("://")
        _, _, prefix = rest.partition("/")
        return prefix.strip("/")
    return ""


def open_sink(uri: str, settings: WorkerSettings) -> Sink:
    """Build the sink for ``uri``; keys passed to ``put`` come from ``schema.result_key``."""
    if sink_scheme(uri) == "file":
        from qworker.worker.sinks.file import FileSink

        return FileSink.from_uri(uri)
    module = importlib.import_module("qworker.worker.sinks.s3")
    return module.open_sink(uri, settings)


def collect(uri: str, batch_id: str, settings: WorkerSettings) -> Iterator[bytes]:
    """Yield the stored result record (bytes) of every job of ``batch_id``. Blocking."""
    if sink_scheme(uri) == "file":
        from qworker.worker.sinks.file import collect_dir

        return collect_dir(uri, batch_id)
    module = importlib.import_module("qworker.worker.sinks.s3")
    return module.collect(uri, batch_id, settings)
