"""Runs the engine's step loop on a dedicated thread and hands results to asyncio.

The event loop never waits on a model step: ``submit`` and ``abort`` only queue work
(the engine's ``add_request`` / ``abort`` are thread-safe), and each step's finished
``RequestOutput`` list is delivered back on the loop with ``call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
from collections.abc import Callable
from typing import Any, Protocol

from qworker.engine.outputs import RequestOutput
from qworker.engine.sampling_params import SamplingParams
from qworker.engine.stats import EngineStats

log = logging.getLogger(__name__)


class EngineLike(Protocol):
    """The part of ``Engine`` (or ``EchoEngine``) the worker drives."""

    tokenizer: Any
    model_name: str
    max_model_len: int

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
    ) -> None: ...
    def encode_chat(self, messages: list[dict]) -> list[int]: ...
    def step(self) -> list[RequestOutput]: ...
    def abort(self, request_id: str) -> None: ...
    def has_unfinished(self) -> bool: ...
    def stats(self) -> EngineStats: ...


class EngineThread:
    """Owns the thread that calls ``engine.step()``.

    ``on_outputs(list[RequestOutput])`` runs on ``loop`` after every step that
    finished something; ``on_step_error(exc)`` runs on ``loop`` when a step raised
    (the thread keeps going). ``pending_blocks`` counts prompt blocks submitted that
    the engine's ``stats()`` may not show yet, for admission.
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
        self._lock = threading.Lock()
        self._inbox_blocks = 0  # submitted since the current step began
        self._stepping_blocks = 0  # submitted before the current step began
        self.steps = 0
        self._thread = threading.Thread(target=self._run, name="qworker-engine", daemon=True)

    def start(self) -> None:
        """Start the step loop."""
        self._thread.start()

    def submit(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        n_tokens: int | None = None,
    ) -> None:
        """Add a request; raises the engine's validation errors synchronously.

        ``n_tokens`` (the prompt length, estimated for text) feeds ``pending_blocks``.
        """
        self.engine.add_request(request_id, prompt, params, arrival_time)
        if n_tokens is None:
            n_tokens = len(prompt) if isinstance(prompt, list) else len(prompt.encode())
        with self._lock:
            self._inbox_blocks += math.ceil(n_tokens / self._block_size)
        self._wake.set()

    def abort(self, request_id: str) -> None:
        """Abort a request; its output comes back with finish_reason "abort"."""
        self.engine.abort(request_id)
        self._wake.set()

    @property
    def pending_blocks(self) -> int:
        """Prompt blocks submitted that may not be reflected in ``engine.stats()`` yet."""
        with self._lock:
            return self._inbox_blocks + self._stepping_blocks

    def stop(self, timeout: float = 10.0) -> None:
        """Stop stepping and join the thread (the current step completes first)."""
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self.engine.has_unfinished():
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            with self._lock:
                self._stepping_blocks, self._inbox_blocks = self._inbox_blocks, 0
            try:
                outputs = self.engine.step()
            except BaseException as exc:  # reported to the worker, thread lives on
                log.exception("engine step failed")
                self._call(self._on_step_error, exc)
                outputs = []
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
