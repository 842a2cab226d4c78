"""Rank 0's handle on a tensor-parallel group: the spawned ranks, their pipes, the group.

``TensorParallelGroup.start`` spawns ranks 1..N-1 with ``torch.multiprocessing``
(spawn: a fresh interpreter each, so a user's script must guard its entry point with
``if __name__ == "__main__":``, as for any spawn), makes them join the process group
through a ``TCPStore`` on loopback, and keeps one pipe to each. Over the pipe go the
control messages (set up an engine, release it, shut down) and each step's header
(``wire``); a follower blocks on its pipe while the engine is idle, and a closed pipe
(rank 0 gone, however it died) ends it. One group serves one engine at a time; an
engine that started its group shuts it down on ``close`` (or at exit), one given a
group only releases it.

Failures: a follower that exits is seen by rank 0's next collective (gloo reports the
closed connection at once), by its next pipe write, or by ``failure``'s liveness scan;
a follower that hangs makes rank 0's collective time out (``tensor_parallel_timeout``)
or the worker's step watchdog fire first. Either way the engine raises
``EngineDeadError`` and ``shutdown`` kills what is left: no rank outlives rank 0's
engine (docs/operations.md, "Tensor parallelism").
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import pickle
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from qworker.engine.parallel.follower import CONTROL, FollowerArgs, Message, main
from qworker.engine.parallel.group import RankGroup
from qworker.errors import EngineDeadError

logger = logging.getLogger(__name__)

_STEP = b"S"
_JOIN_POLL_S = 0.2
#: How long rank 0 waits for a follower to start, or to load its shard (the ranks load
#: side by side; a slow disk or a 70B shard takes minutes). Liveness is checked meanwhile.
_SETUP_WAIT_S = 1800.0


@dataclass(slots=True)
class _Follower:
    rank: int
    process: BaseProcess
    conn: Connection


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "is still running"
    if code < 0:
        return f"was killed by signal {-code}"
    return f"exited with status {code}"


class TensorParallelGroup:
    """Ranks 1..N-1 of a tensor-parallel group, seen from rank 0 (see the module docstring).

    Thread-safety: ``send_header`` (the engine thread) and the control calls (any thread)
    share a lock; ``shutdown`` waits for it at most briefly, then kills.
    """

    def __init__(self, rank0: RankGroup, followers: list[_Follower], timeout_s: float,
                 store: dist.Store) -> None:
        self.rank0 = rank0
        self._store = store  # kept alive: the followers' store clients talk to it
        self.followers = followers
        self.timeout_s = timeout_s
        self.broken: EngineDeadError | None = None
        self.closed = False
        self.in_use = False
        self._lock = threading.Lock()
        self._failing = threading.Lock()  # one verdict when several threads see the death

    @classmethod
    def start(cls, world_size: int, device: torch.device, timeout_s: float = 600.0
              ) -> TensorParallelGroup:
        """Spawn ranks 1..``world_size``-1 and join the process group with them (rank 0 on
        ``device``: the CPU, or ``cuda:0`` with rank ``r`` on ``cuda:r``)."""
        if world_size < 2:
            raise ValueError(f"a tensor-parallel group needs 2 or more ranks, got {world_size}")
        if dist.is_initialized():
            raise ValueError("tensor_parallel_size > 1 needs a process where torch.distributed "
                             "is not initialised yet (the engine starts its own group)")
        started = time.perf_counter()
        timeout = datetime.timedelta(seconds=timeout_s)
        store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, timeout=timeout,
                              wait_for_workers=False)
        ctx = mp.get_context("spawn")
        followers: list[_Follower] = []
        level = logging.getLogger("qworker").getEffectiveLevel()
        try:
            for rank in range(1, world_size):
                ours, theirs = ctx.Pipe()
                args = FollowerArgs(rank, world_size, store.port, device.type, timeout_s, level)
                process = ctx.Process(target=main, args=(args, theirs), daemon=True,
                                      name=f"qworker-tp-rank{rank}")
                process.start()
                theirs.close()  # only the follower holds its end: its death closes the pipe
                followers.append(_Follower(rank, process, ours))
            for f in followers:  # started (torch imported): the rendezvous is quick now
                _expect(f, Message.JOINING, time.monotonic() + _SETUP_WAIT_S)
            rank0 = RankGroup.join(0, world_size, store, device, timeout_s)
        except BaseException:
            _kill(followers)
            raise
        group = cls(rank0, followers, timeout_s, store)
        rank0.rendezvous = group._rendezvous
        threading.Thread(target=group._watch, name="qworker-tp-watch", daemon=True).start()
        logger.info("tensor parallel: %d ranks on %s (%s) joined in %.1fs", world_size,
                    device.type, "nccl" if device.type == "cuda" else "gloo",
                    time.perf_counter() - started)
        return group

    @property
    def world_size(self) -> int:
        """Ranks in the group, rank 0 included."""
        return self.rank0.world_size

    @property
    def pids(self) -> list[int]:
        """Process ids of ranks 1..N-1."""
        return [f.process.pid or 0 for f in self.followers]

    # ---- engine setup --------------------------------------------------------------

    def begin_setup(self, config: Any) -> None:
        """Tell every follower to build its shard of the engine ``config`` describes (they
        then run the same setup as rank 0, side by side)."""
        if self.closed or self.broken is not None:
            raise ValueError("this tensor-parallel group was shut down or broke; start another")
        if self.in_use:
            raise ValueError("this tensor-parallel group already serves an engine")
        self.in_use = True
        self._control(Message.SETUP, config)

    def finish_setup(self) -> list[int]:
        """Wait for every follower to report its shard ready; returns each follower's
        weight bytes (rank order). Raises ``EngineDeadError`` when one failed."""
        deadline = time.monotonic() + _SETUP_WAIT_S
        return [int(self._expect(f, Message.READY, deadline)) for f in self.followers]

    def _rendezvous(self) -> None:
        """Every follower loaded its shard (rank 0 has too): let them all go on."""
        deadline = time.monotonic() + _SETUP_WAIT_S
        for f in self.followers:
            self._expect(f, Message.LOADED, deadline)
        self._control(Message.GO, None)

    def _expect(self, f: _Follower, kind: Message, deadline: float) -> Any:
        try:
            return _expect(f, kind, deadline)
        except EngineDeadError as exc:
            raise self.failure(exc) from exc

    @contextlib.contextmanager
    def stepping(self) -> Iterator[None]:
        """Held around one step on rank 0 (shipping and collectives): ``shutdown`` then
        knows not to tear the process group down under it."""
        with self._lock:
            yield

    def setup_failed(self, exc: BaseException) -> BaseException:
        """Rank 0's setup raised ``exc``: the followers are somewhere in theirs, so the
        group is shut down. Returns the error to raise (a follower's own report when it
        failed first, else ``exc``)."""
        reports = []
        for f in self.followers:
            try:
                while f.conn.poll(0):
                    kind, what = pickle.loads(f.conn.recv_bytes())
                    if kind == Message.ERROR:
                        reports.append(f"rank {f.rank}: {what}")
            except (EOFError, OSError):
                continue
        self.shutdown()
        if reports and not isinstance(exc, ValueError):
            return EngineDeadError("tensor-parallel setup failed on " + "; ".join(reports))
        return exc

    # ---- steps -------------------------------------------------------------------------

    def send_header(self, header: bytes) -> None:
        """Wake every follower with the next step's header (``wire.Header``); inside
        ``stepping``."""
        if self.broken is not None:
            raise self.broken
        for f in self.followers:
            if not f.process.is_alive():
                raise self.failure()
            f.conn.send_bytes(_STEP + header)

    def failure(self, exc: BaseException | None = None) -> EngineDeadError:
        """The ``EngineDeadError`` that ends this group, naming the ranks that died (marks
        the group broken; ``shutdown`` still has to run)."""
        with self._failing:
            if self.broken is None:
                self.broken = self._verdict(exc)
        return self.broken

    def _verdict(self, exc: BaseException | None) -> EngineDeadError:
        time.sleep(0.1)  # a rank that just died: let its exit status arrive
        dead = [f"rank {f.rank} (pid {f.process.pid}) {_describe_exit(f.process.exitcode)}"
                for f in self.followers if not f.process.is_alive()]
        if dead:
            why = "tensor-parallel " + ", ".join(dead)
        else:
            why = "a tensor-parallel collective failed (a rank hung or left)"
        if exc is not None:
            why += f": {' '.join(str(exc).split())[:300]}"
        logger.error("%s", why)
        return EngineDeadError(why)

    def _watch(self) -> None:
        """Mark the group broken as soon as a follower exits unasked: a step blocked in a
        collective (NCCL does not notice a dead peer) may never return, but the worker's
        watchdog reads ``broken`` (``Engine.failed``) and stops with exit 70 at once."""
        sentinels = [f.process.sentinel for f in self.followers]
        while not self.closed:
            if wait(sentinels, timeout=1.0) and not self.closed:
                self.failure()
                return

    # ---- ending ----------------------------------------------------------------------

    def release(self) -> None:
        """The engine is done: followers drop their shard and wait for the next setup."""
        if self.in_use and not self.closed and self.broken is None:
            self.in_use = False
            self._control(Message.RELEASE, None)

    def shutdown(self, grace_s: float = 5.0) -> None:
        """Stop every follower (asked first, killed after ``grace_s``) and leave the group.
        Safe from any thread, more than once, and while a step is stuck in a collective."""
        if self.closed:
            return
        self.closed = True
        got = self._lock.acquire(timeout=1.0)
        try:
            if got and self.broken is None:
                for f in self.followers:
                    with contextlib.suppress(OSError):
                        f.conn.send_bytes(CONTROL + pickle.dumps((Message.SHUTDOWN, None)))
            deadline = time.monotonic() + (grace_s if got and self.broken is None else 0.0)
            for f in self.followers:
                f.process.join(max(0.0, deadline - time.monotonic()))
            _kill(self.followers)
            for f in self.followers:
                f.conn.close()
            if got:  # a step stuck in a collective would use the group as it is destroyed
                self.rank0.leave()
        finally:
            if got:
                self._lock.release()
        logger.info("tensor parallel: %d ranks shut down", self.world_size)

    def _control(self, command: Message, arg: Any) -> None:
        message = CONTROL + pickle.dumps((command, arg))
        with self._lock:
            for f in self.followers:
                try:
                    f.conn.send_bytes(message)
                except OSError as exc:
                    raise self.failure(exc) from exc


def _expect(f: _Follower, kind: Message, deadline: float) -> Any:
    """The next message of follower ``f``, which must be ``kind`` (its payload returned);
    ``EngineDeadError`` when it reports an error, dies or stays silent past ``deadline``."""
    while time.monotonic() < deadline:
        if f.conn.poll(_JOIN_POLL_S):
            try:
                got, what = pickle.loads(f.conn.recv_bytes())
            except (EOFError, OSError):
                break
            if got == kind:
                return what
            raise EngineDeadError(f"tensor-parallel rank {f.rank}: {what}" if got == Message.ERROR
                                  else f"tensor-parallel rank {f.rank} sent {got!r}, "
                                  f"expected {kind!r}")
        if not f.process.is_alive():
            break
    if f.process.is_alive():
        raise EngineDeadError(f"tensor-parallel rank {f.rank} did not answer ({kind})")
    f.process.join(1.0)
    raise EngineDeadError(f"tensor-parallel rank {f.rank} (pid {f.process.pid}) "
                          f"{_describe_exit(f.process.exitcode)}")


def _kill(followers: list[_Follower]) -> None:
    """SIGKILL and reap every follower still alive."""
    for f in followers:
        if f.process.is_alive():
            f.process.kill()
    for f in followers:
        f.process.join(5.0)
