"""Runs the engine's step loop on a dedicated thread and hands results to asyncio.

The event loop never waits on a model step: ``submit`` and ``abort`` only queue work
(the engine's ``add_validated`` / ``abort`` are thread-safe), and each step's finished
``RequestOutput`` list is delivered back on the loop with ``call_soon_threadsafe``.
``step_running_for`` and ``alive`` let the worker's watchdog see a hung step or a
dead thread (docs/operations.md, exit 70).
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, Protocol, cast

from qworker.engine.outputs import RequestOutput
from qworker.engine.sampling_params import SamplingParams
from qworker.engine.stats import EngineStats
from qworker.errors import EngineDeadError

log = logging.getLogger(__name__)


class EngineLike(Protocol):
    """The part of ``Engine`` (or ``EchoEngine``) the worker drives.

    ``task`` is what it serves: ``"generate"`` or ``"embed"`` (``EmbeddingEngineLike``).
    """

    tokenizer: Any
    model_name: str
    max_model_len: int
    task: str

    def validate_prompt(
        self, prompt: str | list[int], params: SamplingParams
    ) -> tuple[str | None, list[int]]: ...
    def add_validated(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
    ) -> None: ...
    def encode_chat(self, messages: list[dict]) -> list[int]: ...
    def inbox_batch(self) -> AbstractContextManager[None]: ...
    def step(self) -> list[RequestOutput]: ...
    def abort(self, request_id: str) -> None: ...
    def has_unfinished(self) -> bool: ...
    def stats(self) -> EngineStats: ...
    def close(self) -> None: ...
    def failed(self) -> str | None: ...


class EmbeddingEngineLike(EngineLike, Protocol):
    """An engine of task ``"embed"``: what the worker drives besides ``EngineLike``.

    ``add_embedding`` is thread-safe; a finished request comes back from ``step`` with
    one vector per input in ``RequestOutput.embeddings`` (None once aborted).
    """

    embedding_dim: int
    max_num_batched_tokens: int

    def validate_embedding_input(self, item: str | list[int]) -> list[int]: ...
    def check_dimensions(self, dimensions: int | None) -> None: ...
    def add_embedding(self, request_id: str, inputs: list[list[int]],
                      dimensions: int | None = None,
                      arrival_time: float | None = None) -> None: ...


class EngineThread:
    """Owns the thread that calls ``engine.step()``.

    ``on_outputs(list[RequestOutput])`` runs on ``loop`` after every step that
    finished something; ``on_step_error(exc)`` runs on ``loop`` when a step raised:
    the thread then waits, without stepping the same broken batch again, until the
    handler has dealt with it and called ``resume``. ``pending_blocks`` counts prompt
    blocks submitted that the engine's ``stats()`` may not show yet, for admission.
    """

    def __init__(
        self,
        engine: EngineLike,
        loop: asyncio.AbstractEventLoop,
        on_outputs: Callable[[list[RequestOutput]], None],
        on_step_error: Callable[[BaseException], None],
        block_size: int = 16,
    ) -> None:
        self.engine = engine
        self._loop = loop
        self._on_outputs = on_outputs
        self._on_step_error = on_step_error
        self._block_size = block_size
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._resumed = threading.Event()
        self._resumed.set()
        self._lock = threading.Lock()
        self._inbox_blocks = 0  # submitted since the current step began
        self._stepping_blocks = 0  # submitted before the current step began
        self.steps = 0
        self.died_of: BaseException | None = None  # what ended the thread, if it died
        self._step_started: float | None = None
        self._thread = threading.Thread(target=self._guarded, name="qworker-engine", daemon=True)

    def start(self) -> None:
        """Start the step loop."""
        self._thread.start()

    def submit(
        self,
        request_id: str,
        text: str | None,
        token_ids: list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
    ) -> None:
        """Add a request whose prompt the engine already validated (``validate_prompt``)."""
        self.engine.add_validated(request_id, text, token_ids, params, arrival_time)
        with self._lock:
            self._inbox_blocks += math.ceil(len(token_ids) / self._block_size)
        self._wake.set()

    def submit_embedding(self, request_id: str, inputs: list[list[int]],
                         dimensions: int | None, arrival_time: float | None = None) -> None:
        """Add an embedding request of validated inputs (an ``embed`` engine's only kind).

        It holds no KV blocks after its step, so it adds nothing to ``pending_blocks``.
        """
        cast(EmbeddingEngineLike, self.engine).add_embedding(request_id, inputs, dimensions,
                                                              arrival_time)
        self._wake.set()

    def batch(self) -> AbstractContextManager[None]:
        """Requests submitted inside the block start in the same engine step (without it
        the thread, woken by the first, may step before the rest arrive)."""
        return self.engine.inbox_batch()

    def abort(self, request_id: str) -> None:
        """Abort a request; its output comes back with finish_reason "abort"."""
        self.engine.abort(request_id)
        self._wake.set()

    @property
    def pending_blocks(self) -> int:
        """Prompt blocks submitted that may not be reflected in ``engine.stats()`` yet."""
        with self._lock:
            return self._inbox_blocks + self._stepping_blocks

    def resume(self) -> None:
        """Let the thread step again after a failed step (called by ``on_step_error``)."""
        self._resumed.set()
        self._wake.set()

    @property
    def alive(self) -> bool:
        """True while the step thread runs (it only ends through ``stop``)."""
        return self._thread.is_alive()

    def step_running_for(self, now: float | None = None) -> float:
        """Seconds the current step has been running (0.0 between steps)."""
        started = self._step_started
        if started is None:
            return 0.0
        return (time.monotonic() if now is None else now) - started

    def stop(self, timeout: float = 10.0) -> None:
        """Stop stepping and join the thread (the current step completes first)."""
        self._stop.set()
        self._resumed.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _guarded(self) -> None:
        try:
            self._run()
        except BaseException as exc:  # the worker's watchdog sees the dead thread: exit 70
            self.died_of = exc
            log.critical("the engine thread died", exc_info=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self._resumed.is_set():
                self._resumed.wait(0.05)
                continue
            if not self.engine.has_unfinished():
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            with self._lock:
                self._stepping_blocks, self._inbox_blocks = self._inbox_blocks, 0
            self._step_started = time.monotonic()
            try:
                outputs = self.engine.step()
            except EngineDeadError:
                raise  # no later step can work (a tensor-parallel rank died): exit 70
            except Exception as exc:  # reported to the worker, thread lives on
                log.exception("engine step failed")
                self._resumed.clear()
                self._call(self._on_step_error, exc)
                outputs = []
            finally:
                self._step_started = None
            with self._lock:
                self._stepping_blocks = 0
            self.steps += 1
            if outputs:
                self._call(self._on_outputs, outputs)

    def _call(self, fn: Callable[[Any], None], arg: Any) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, arg)
        except RuntimeError:
            log.warning("event loop closed; dropping an engine callback")


async def watchdog(thread: EngineThread, step_timeout: float,
                   on_failure: Callable[[str], None], interval: float = 0.5) -> None:
    """Call ``on_failure(why)`` once, and return, when ``thread`` died, its engine says it
    can never step again (a tensor-parallel rank died), or one step has run longer than
    ``step_timeout`` seconds (0 disables that check); docs/operations.md."""
    while True:
        await asyncio.sleep(interval)
        dead = thread.engine.failed()
        if dead is not None:
            on_failure(f"the engine failed: {dead}")
            return
        if not thread.alive:
            cause = thread.died_of
            on_failure("the engine thread died" + (f" ({cause})" if cause is not None else ""))
            return
        running = thread.step_running_for()
        if step_timeout and running > step_timeout:
            on_failure(f"an engine step has run for {running:.0f}s "
                       f"(engine_step_timeout {step_timeout:.0f}s)")
            return
