"""The phases of a worker's drain, each within its share of ``drain_budget``.

Each phase ends ``budget.<phase>`` seconds after the previous one ended (sooner when
its work is done), so the whole drain stays within ``budget.total`` (docs/operations.md,
"The drain budget"): prepare (messages being parsed land at the gate; the jobs that
never started are handed back), run (jobs in the engine finish; sink and dead-letter
writes are retried until it ends), abort (what still runs is aborted and handed back),
store (writes under way finish; whatever is still unsettled is handed back). Close is
the caller's (``Worker.run``), until the returned time.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable

from qworker.worker.admission import Admission
from qworker.worker.drain import DrainBudget, DrainControl
from qworker.worker.engine_thread import EngineThread
from qworker.worker.gate import Gate
from qworker.worker.job import AbortReason, Fate, JobState
from qworker.worker.job_table import JobTable
from qworker.worker.settle import Settler
from qworker.worker.tasks import Tasks

log = logging.getLogger(__name__)

S = JobState
Waiter = Callable[[Callable[[], bool], float, bool], Awaitable[None]]


async def drain_phases(table: JobTable, settler: Settler, tasks: Tasks, gate: Gate,
                       thread: EngineThread, admission: Admission, budget: DrainBudget,
                       control: DrainControl, wait_until: Waiter,
                       store_until: Callable[[float], None]) -> float:
    """Run the prepare, run, abort and store phases; return when the close phase ends.

    ``wait_until(done, until, immediate_stops)`` waits on the worker's progress events;
    ``store_until(t)`` tells the sink and dead-letter retriers when to stop retrying.
    """
    immediate = control.immediate
    now = time.monotonic()
    store_until(now + budget.prepare + budget.run)
    await wait_until(lambda: not table.in_state(S.RECEIVED, S.PREPARING),
                     now + budget.prepare, False)
    for job in table.waiting():  # jobs that never started go back first
        settler.settle_later(job, Fate.HANDED_BACK)
    run_until = time.monotonic() + budget.run
    store_until(run_until)
    if table.running and not immediate.is_set():
        log.info("draining: %d jobs in flight, up to %.0fs", len(table.running), budget.run)
        await wait_until(lambda: not table.running, run_until, True)
    for job in table.running.values():
        if job.abort is None:
            job.abort = AbortReason.DRAIN
            assert job.request_id is not None
            thread.abort(job.request_id)
    abort_s = min(1.0, budget.abort) if immediate.is_set() else budget.abort
    await wait_until(lambda: not table.running, time.monotonic() + abort_s, False)
    for job in list(table.running.values()):
        gate.released(job)
        settler.settle_later(job, Fate.HANDED_BACK)
    admission.final_sum = 0
    store_until(time.monotonic())
    await tasks.wait(min(2.0, budget.store) if immediate.is_set() else budget.store)
    for job in table:  # a store or settle cut short: the message goes back
        await settler.settle(job, Fate.HANDED_BACK, force=True)
    log.info("drained (%s)", control.reason.value if control.reason else "done")
    return time.monotonic() + budget.close
