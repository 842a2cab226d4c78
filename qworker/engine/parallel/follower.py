"""The main loop of tensor-parallel ranks 1..N-1 (a process spawned by ``launcher``).

A follower joins the process group, then waits on its pipe to rank 0. ``setup`` builds
its shard of an engine with the very code rank 0 runs (``engine_setup.build_runner``:
same profiling forwards, same graph captures, the pool size agreed at the minimum),
reports ``ready`` with its weight bytes, and serves: each step header is followed by
the step's payload broadcast and, when the step feeds them, the previous step's sampled
ids; the follower replays it (``ParallelModelRunner.run_shipped``). ``release`` drops the
shard and waits for the next setup; ``shutdown`` or a closed pipe (rank 0 is gone) ends
the process. An exception ends it too, with status 1: rank 0 sees the rank die.
"""

from __future__ import annotations

import gc
import logging
import os
import pickle
import sys
import traceback
from dataclasses import dataclass
from enum import StrEnum
from multiprocessing.connection import Connection
from typing import Any

import torch

CONTROL = b"C"


class Message(StrEnum):
    """The pipe messages between rank 0 and a follower (besides step headers)."""

    JOINING = "joining"  # follower: started, joining the process group
    SETUP = "setup"  # rank 0: build your shard of this engine config
    LOADED = "loaded"  # follower: shard loaded, waiting for GO
    GO = "go"  # rank 0: every rank loaded, go on with the setup
    READY = "ready"  # follower: set up (with its weight bytes), serving steps
    ERROR = "error"  # follower: setup failed (with the reason), exiting
    RELEASE = "release"  # rank 0: the engine is closed, drop the shard
    SHUTDOWN = "shutdown"  # rank 0: exit

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class FollowerArgs:
    """What a spawned rank needs to join its group."""

    rank: int
    world_size: int
    store_port: int
    device_type: str  # "cpu" or "cuda" (rank r on cuda:r)
    timeout_s: float
    log_level: int


def main(args: FollowerArgs, conn: Connection) -> None:
    """Entry point of a spawned rank (see the module docstring)."""
    logging.basicConfig(
        level=args.log_level, stream=sys.stderr,
        format=f"%(asctime)s %(levelname)s [tp rank {args.rank}] %(name)s: %(message)s")
    try:
        _run(args, conn)
    except (EOFError, BrokenPipeError):
        logger.info("rank 0 is gone: exiting")
    except BaseException:  # rank 0 sees this rank die and fails its engine
        logger.critical("tensor-parallel rank %d failed:\n%s", args.rank, traceback.format_exc())
        sys.stderr.flush()
        os._exit(1)
    sys.stderr.flush()
    os._exit(0)  # no atexit work: a process group torn down by rank 0 could hang it


def _run(args: FollowerArgs, conn: Connection) -> None:
    import datetime

    import torch.distributed as dist

    from qworker.engine.parallel.group import RankGroup

    device = torch.device("cuda", args.rank) if args.device_type == "cuda" else torch.device("cpu")
    _tell(conn, Message.JOINING, None)
    store = dist.TCPStore("127.0.0.1", args.store_port, args.world_size, is_master=False,
                          timeout=datetime.timedelta(seconds=args.timeout_s))
    group = RankGroup.join(args.rank, args.world_size, store, device, args.timeout_s)

    def rendezvous() -> None:  # rank 0 answers GO once every rank reported LOADED
        _tell(conn, Message.LOADED, None)
        command, _ = _control(conn.recv_bytes())
        if command != Message.GO:
            raise RuntimeError(f"expected 'go' from rank 0, got {command!r}")

    group.rendezvous = rendezvous
    while True:
        command, arg = _control(conn.recv_bytes())
        if command == Message.SHUTDOWN:
            break
        if command != Message.SETUP:
            raise RuntimeError(f"unexpected control message {command!r} between engines")
        if _serve_engine(arg, group, conn) == Message.SHUTDOWN:
            break
    group.leave()


def _tell(conn: Connection, kind: str, what: Any) -> None:
    conn.send_bytes(pickle.dumps((kind, what)))


def _control(data: bytes) -> tuple[str, Any]:
    if data[:1] != CONTROL:
        raise RuntimeError("a step arrived with no engine set up")
    command, arg = pickle.loads(data[1:])
    return command, arg


def _serve_engine(config: Any, group: Any, conn: Connection) -> str:
    """Build this rank's shard of ``config``'s engine and serve steps until released."""
    from qworker.engine.engine_setup import build_runner
    from qworker.engine.parallel.runner import ParallelModelRunner
    from qworker.engine.parallel.wire import Header

    try:
        parts = build_runner(config, group)
    except Exception as exc:
        _tell(conn, Message.ERROR, " ".join(str(exc).split())[:500])
        raise
    runner = parts.runner
    assert isinstance(runner, ParallelModelRunner)
    _tell(conn, Message.READY, parts.weight_bytes)
    del parts
    payload = torch.zeros(1 << 12, dtype=torch.int64)
    prev = torch.zeros(0, dtype=torch.int64, device=runner.device)
    try:
        while True:
            data = conn.recv_bytes()
            if data[:1] == CONTROL:
                return _control(data)[0]
            header = Header.from_bytes(data[1:])
            if header.payload_len > len(payload):
                payload = torch.zeros(max(header.payload_len, 2 * len(payload)),
                                      dtype=torch.int64)
            view = payload[: header.payload_len]
            group.broadcast_host(view)
            prev_tokens = None
            if header.prev_len:
                if len(prev) < header.prev_len:
                    prev = torch.zeros(2 * header.prev_len, dtype=torch.int64,
                                       device=runner.device)
                prev_tokens = prev[: header.prev_len]
                group.broadcast_device(prev_tokens)
            runner.run_shipped(header, view.numpy(), prev_tokens)
    finally:
        runner.drop_cuda_graphs()
        del runner
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
