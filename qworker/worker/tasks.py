"""The worker's background tasks (preparing, answering, settling), kept so a drain can wait.

Every per-job coroutine runs as a task owned by one ``Tasks``: a drain waits for them
up to its store budget and cancels the rest (whose jobs are then handed back). A task
that raises is logged; the supervisor in ``qworker.worker.settle`` has already turned
the failure into the job's fate before it gets here. Event loop only.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any

log = logging.getLogger(__name__)


class Tasks:
    """A set of running tasks; ``len`` is how many still run."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()

    def __len__(self) -> int:
        return len(self._tasks)

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str | None = None) -> asyncio.Task[Any]:
        """Run ``coro`` in the background until it ends."""
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("worker task %s failed", task.get_name(), exc_info=task.exception())

    async def wait(self, timeout: float) -> int:
        """Wait up to ``timeout`` seconds for every task (new ones too); cancel what is left.

        Returns how many were cancelled.
        """
        loop = asyncio.get_running_loop()
        until = loop.time() + max(0.0, timeout)
        while self._tasks:
            left = until - loop.time()
            if left <= 0:
                break
            await asyncio.wait(set(self._tasks), timeout=left)
        pending = set(self._tasks)
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
        return len(pending)
