"""The worker fleet: 2-3 ``qworker run`` processes in one group, killed, drained, restarted.

Each slot holds one worker process at a time (an *incarnation*). The fleet scrapes
every live incarnation's ``/metrics`` in the background so that counters of a worker
that is later SIGKILLed are not lost entirely (they are as fresh as the last scrape).
"""

from __future__ import annotations

import contextlib
import enum
import http.client
import logging
import os
import random
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from .servers import AWS_ENV, free_port

log = logging.getLogger(__name__)


class Fate(enum.Enum):
    """Why an incarnation ended (or that it has not)."""

    RUNNING = "running"
    KILLED = "killed"      # SIGKILL from the campaign
    DRAINED = "drained"    # SIGTERM from the campaign
    EXITED = "exited"      # left by itself (--until-idle) or crashed


@dataclass(slots=True)
class Incarnation:
    """One worker process of a slot."""

    proc: subprocess.Popen[bytes]
    metrics_port: int
    log_path: Path
    started: float
    fate: Fate = Fate.RUNNING
    signalled_at: float | None = None
    ended_at: float | None = None
    returncode: int | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    tag: str = ""              # "hang", "idle-restart", ... ("" = a plain worker)
    expect_rc: tuple[int, ...] = (0,)  # exit codes the contract allows when it leaves itself
    progress_at_exit: int | None = None  # results in the sink when its own exit was seen


@dataclass(slots=True)
class Slot:
    """A place in the fleet; ``restart_at`` is when its next incarnation starts."""

    index: int
    lives: list[Incarnation] = field(default_factory=list)
    restart_at: float | None = None
    next_argv: list[str] | None = None  # the next incarnation's argv, once
    next_tag: str = ""
    next_expect_rc: tuple[int, ...] = (0,)

    @property
    def current(self) -> Incarnation | None:
        """The newest incarnation, if any."""
        return self.lives[-1] if self.lives else None


def parse_metrics(text: str) -> dict[str, float]:
    """Sum a Prometheus text exposition by metric name (labels dropped)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_part, _, value = line.rpartition(" ")
        name = name_part.split("{", 1)[0].strip()
        with contextlib.suppress(ValueError):
            out[name] = out.get(name, 0.0) + float(value)
    return out


class Fleet:
    """Runs ``size`` workers with ``argv`` + ``env`` and applies kills and drains to them.

    Not thread-safe except for the internal scraper; drive it from one thread.
    """

    def __init__(self, size: int, argv: list[str], env: dict[str, str], log_dir: Path,
                 rng: random.Random) -> None:
        self.argv = argv
        self.env = env
        self.log_dir = log_dir
        self.rng = rng
        self.slots = [Slot(i) for i in range(size)]
        self._stop = threading.Event()
        self._scraper = threading.Thread(target=self._scrape_loop, name="scraper", daemon=True)
        self._lock = threading.Lock()
        #: Results in the sink now; noted on workers seen leaving by themselves.
        self.progress_fn: Callable[[], int] | None = None
        #: Until then (monotonic) a worker may exit 1: its configuration is broken for now
        #: (the campaign deleted its dead-letter queue for a while).
        self.config_exits_until = 0.0

    # -- lifecycle -----------------------------------------------------------------
    def start(self) -> None:
        """Start one worker in every slot and the metrics scraper."""
        for slot in self.slots:
            self._spawn(slot)
        self._scraper.start()

    def _spawn(self, slot: Slot) -> None:
        port = free_port()
        n = len(slot.lives)
        log_path = self.log_dir / f"worker{slot.index}.{n}.log"
        env = {**os.environ, **AWS_ENV, **self.env, "QWORKER_METRICS_PORT": str(port)}
        argv = slot.next_argv or self.argv
        with log_path.open("wb") as out:
            proc = subprocess.Popen([sys.executable, "-m", "qworker", *argv],
                                    stdout=out, stderr=subprocess.STDOUT, env=env)
        expect_rc = slot.next_expect_rc
        if time.monotonic() < self.config_exits_until:
            expect_rc = (*expect_rc, 1)
        inc = Incarnation(proc, port, log_path, time.monotonic(), tag=slot.next_tag,
                          expect_rc=expect_rc)
        with self._lock:
            slot.lives.append(inc)
        slot.restart_at = None
        slot.next_argv, slot.next_tag, slot.next_expect_rc = None, "", (0,)
        log.info("worker %d.%d started (pid %d)%s", slot.index, n, proc.pid,
                 f" as {inc.tag}" if inc.tag else "")

    def allow_config_exits(self, since: float, until: float) -> None:
        """Incarnations started from ``since`` until ``until`` (monotonic) may exit 1."""
        self.config_exits_until = until
        with self._lock:
            for slot in self.slots:
                for inc in slot.lives:
                    if inc.started >= since and 1 not in inc.expect_rc:
                        inc.expect_rc = (*inc.expect_rc, 1)

    def live(self) -> list[Slot]:
        """Slots whose current worker runs and has not been signalled."""
        return [s for s in self.slots
                if s.current and s.current.fate is Fate.RUNNING and s.current.proc.poll() is None]

    def kill(self, slot: Slot, restart_after: float, argv: list[str] | None = None,
             tag: str = "", expect_rc: tuple[int, ...] = (0,)) -> None:
        """SIGKILL the slot's worker (after a last scrape) and restart it later.

        ``argv`` / ``tag`` / ``expect_rc`` describe the next incarnation (once).
        """
        inc = slot.current
        assert inc is not None
        self._scrape(inc)
        inc.fate, inc.signalled_at = Fate.KILLED, time.monotonic()
        with contextlib.suppress(ProcessLookupError):
            os.kill(inc.proc.pid, signal.SIGKILL)
        slot.restart_at = time.monotonic() + restart_after
        slot.next_argv, slot.next_tag, slot.next_expect_rc = argv, tag, expect_rc

    def interrupt_drain(self, slot: Slot, after: float, restart_after: float) -> None:
        """SIGTERM, then a second SIGTERM ``after`` s later (exit at once, mid-drain).

        Counted like a kill: the exit code of an interrupted drain is not checked.
        """
        inc = slot.current
        assert inc is not None
        self._scrape(inc)
        inc.fate, inc.signalled_at = Fate.KILLED, time.monotonic()
        with contextlib.suppress(ProcessLookupError):
            os.kill(inc.proc.pid, signal.SIGTERM)
            time.sleep(after)
            os.kill(inc.proc.pid, signal.SIGTERM)
        slot.restart_at = time.monotonic() + restart_after

    def drain(self, slot: Slot) -> None:
        """SIGTERM the slot's worker; it restarts once it has exited."""
        inc = slot.current
        assert inc is not None
        inc.fate, inc.signalled_at = Fate.DRAINED, time.monotonic()
        with contextlib.suppress(ProcessLookupError):
            os.kill(inc.proc.pid, signal.SIGTERM)

    def tick(self, want_workers: bool, progress: int | None = None) -> None:
        """Reap exited workers; restart slots that are due (only while ``want_workers``).

        ``progress`` (results in the sink now) is noted on workers seen leaving by
        themselves, to tell an idle exit from one that left work behind.
        """
        now = time.monotonic()
        for slot in self.slots:
            inc = slot.current
            if inc is None:
                continue
            rc = inc.proc.poll()
            if rc is not None and inc.ended_at is None:
                inc.ended_at, inc.returncode = now, rc
                if inc.fate is Fate.RUNNING:
                    inc.fate = Fate.EXITED
                    if progress is None and self.progress_fn is not None:
                        progress = self.progress_fn()
                    inc.progress_at_exit = progress
                    log.info("worker %d exited by itself rc=%s", slot.index, rc)
                if slot.restart_at is None:
                    slot.restart_at = now + (0.2 if inc.fate is Fate.DRAINED else 0.5)
            if want_workers and inc.ended_at is not None and slot.restart_at is not None \
                    and now >= slot.restart_at:
                self._spawn(slot)

    def settle(self, timeout: float) -> None:
        """Restart every slot whose worker is gone, then let all run until they go idle.

        Work a killed worker left uncommitted is redelivered now and must be absorbed as
        duplicates; afterwards nothing may remain uncommitted.
        """
        # Let signalled workers finish dying first: a SIGKILLed process is not reaped yet
        # right after the signal, and a draining one may take its budget.
        end = time.monotonic() + timeout
        while time.monotonic() < end and any(
                s.current and s.current.fate is not Fate.RUNNING and s.current.proc.poll() is None
                for s in self.slots):
            time.sleep(0.1)
        self.tick(want_workers=False)
        for slot in self.slots:
            inc = slot.current
            if inc is None or inc.proc.poll() is not None:
                self._spawn(slot)
        self.wait_all(timeout)

    def wait_all(self, timeout: float) -> None:
        """Wait up to ``timeout`` s for every current worker to exit, then SIGTERM the rest."""
        end = time.monotonic() + timeout
        while time.monotonic() < end and any(
                s.current and s.current.proc.poll() is None for s in self.slots):
            self.tick(want_workers=False)
            time.sleep(0.2)
        for slot in self.slots:
            inc = slot.current
            if inc and inc.proc.poll() is None:
                self._scrape(inc)
                inc.fate, inc.signalled_at = Fate.DRAINED, time.monotonic()
                os.kill(inc.proc.pid, signal.SIGTERM)
        end = time.monotonic() + 30
        while time.monotonic() < end and any(
                s.current and s.current.proc.poll() is None for s in self.slots):
            time.sleep(0.1)
        self.tick(want_workers=False)

    def close(self) -> None:
        """Stop the scraper and SIGKILL any worker still alive (idempotent)."""
        self._stop.set()
        for slot in self.slots:
            for inc in slot.lives:
                if inc.proc.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(inc.proc.pid, signal.SIGKILL)
                    inc.proc.wait(5)

    # -- metrics -------------------------------------------------------------------
    def _scrape(self, inc: Incarnation) -> None:
        if inc.proc.poll() is not None:
            return
        try:
            url = f"http://127.0.0.1:{inc.metrics_port}/metrics"
            with urllib.request.urlopen(url, timeout=1) as resp:
                parsed = parse_metrics(resp.read().decode())
        except (OSError, http.client.HTTPException):  # a worker dying mid-answer
            return
        with self._lock:
            inc.metrics = parsed

    def _scrape_loop(self) -> None:
        while not self._stop.wait(0.5):
            with self._lock:
                incs = [s.current for s in self.slots if s.current]
            for inc in incs:
                self._scrape(inc)

    def metric_total(self, name: str) -> float:
        """Sum of ``name`` over every incarnation's last scrape."""
        with self._lock:
            return sum(inc.metrics.get(name, 0.0) for s in self.slots for inc in s.lives)

    def incarnations(self) -> list[Incarnation]:
        """Every worker process started so far."""
        return [inc for s in self.slots for inc in s.lives]
