"""Job sources and the factory that opens one from a URI.

URIs (docs/formats.md, "URIs"): ``kafka://host:port[,host:port]/topic?group=NAME``,
``sqs://QUEUE_URL_OR_NAME``, ``file:///path/requests.jsonl``.

Contract for the queue modules, imported lazily so a file-only worker needs
neither aiokafka nor boto3:

- ``qworker.worker.sources.kafka`` and ``qworker.worker.sources.sqs`` each define
  ``open_source(uri: str, settings: WorkerSettings) -> Source`` and
  ``async def produce(uri: str, items: Iterable[tuple[str | None, bytes]],
  settings: WorkerSettings) -> int`` (send every ``(key, body)``; key is the job's
  custom_id; return how many were sent).
"""

from __future__ import annotations

import asyncio
import importlib
from collections.abc import Iterable
from typing import TYPE_CHECKING

from qworker.worker.sources.base import Message, Source

if TYPE_CHECKING:
    from qworker.config import WorkerSettings

__all__ = ["Message", "Source", "open_source", "produce", "source_scheme"]

_MODULES = {"kafka": "qworker.worker.sources.kafka", "sqs": "qworker.worker.sources.sqs"}


def source_scheme(uri: str) -> str:
    """Return the URI's scheme (``kafka``, ``sqs`` or ``file``); ValueError otherwise."""
    scheme, sep, _ = uri.partition("://")
    if not sep or scheme not in ("kafka", "sqs", "file"):
        raise ValueError(f"source URI {uri!r} must start with kafka://, sqs:// or file://")
    return scheme


def open_source(uri: str, settings: WorkerSettings) -> Source:
    """Build (not start) the source for ``uri``; call ``await source.start()`` next."""
    scheme = source_scheme(uri)
    if scheme == "file":
        from qworker.worker.sources.file import FileSource

        return FileSource.from_uri(uri, settings)
    module = importlib.import_module(_MODULES[scheme])
    return module.open_source(uri, settings)


def produce(uri: str, items: Iterable[tuple[str | None, bytes]], settings: WorkerSettings) -> int:
    """Push ``(key, body)`` job messages to the source at ``uri``; return the count sent.

    Blocking (runs its own event loop): meant for the CLI, not for the worker.
    """
    scheme = source_scheme(uri)
    if scheme == "file":
        from qworker.worker.sources.file import append_jobs

        return append_jobs(uri, (body for _, body in items))
    module = importlib.import_module(_MODULES[scheme])
    return asyncio.run(module.produce(uri, items, settings))
