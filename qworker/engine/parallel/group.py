"""One rank's view of the tensor-parallel process group, and the collectives the engine uses.

Model collectives (the layers' all-reduces, the logits gather, the previous step's
sampled ids) run on the default group: NCCL on CUDA (capturable in CUDA graphs), gloo
on the CPU. Host data (the step message, setup agreements) runs on a gloo group: on the
CPU that is the default group itself. Every call is made by every rank in the same
order: rank 0's engine thread and each follower's main loop are the only callers.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from qworker.models.parallel_layers import ShardInfo


@dataclass(slots=True)
class RankGroup:
    """Rank ``rank`` of ``world_size`` in the initialised process group (see the module
    docstring); also the ``Reducer`` the sharded layers sum through."""

    rank: int
    world_size: int
    device: torch.device
    host_group: Any  # the gloo group for host tensors (the default group on the CPU)
    #: Waits, over the pipes rather than a collective (so with no timeout but the ranks'
    #: liveness), until every rank reached the same point: set by launcher and follower.
    rendezvous: Callable[[], None] | None = None

    @classmethod
    def join(cls, rank: int, world_size: int, store: dist.Store, device: torch.device,
             timeout_s: float) -> RankGroup:
        """Initialise the default process group through ``store`` (every rank calls this)."""
        if dist.is_initialized():
            raise ValueError("tensor_parallel_size > 1 needs a process where torch.distributed "
                             "is not initialised yet (the engine starts its own group)")
        timeout = datetime.timedelta(seconds=timeout_s)
        cuda = device.type == "cuda"
        if cuda:
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if cuda else "gloo", store=store, rank=rank,
                                world_size=world_size, timeout=timeout,
                                device_id=device if cuda else None)
        host = dist.new_group(backend="gloo", timeout=timeout) if cuda else dist.group.WORLD
        return cls(rank, world_size, device, host)

    def wait_all(self) -> None:
        """Block until every rank got here (after loading, which may take long and
        unevenly: collectives time out after ``tensor_parallel_timeout``)."""
        if self.rendezvous is not None:
            self.rendezvous()

    @property
    def shard(self) -> ShardInfo:
        """The slice of the model this rank holds, summing through this group."""
        return ShardInfo(self.rank, self.world_size, self)

    # ---- model collectives (default group) ------------------------------------------

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` in place over the ranks; returns it."""
        dist.all_reduce(tensor)
        return tensor

    def gather_logits(self, local: torch.Tensor, vocab_size: int) -> torch.Tensor | None:
        """Rank 0: every rank's vocabulary columns of ``local`` ``[rows, V / N]`` side by
        side, cut to ``vocab_size`` (the padding rows dropped); the others: None."""
        local = local.contiguous()
        if self.rank:
            dist.gather(local, None, dst=0)
            return None
        parts = [torch.empty_like(local) for _ in range(self.world_size)]
        dist.gather(local, parts, dst=0)
        logits = torch.cat(parts, dim=1)
        return logits if logits.shape[1] == vocab_size else logits[:, :vocab_size]

    def broadcast_device(self, tensor: torch.Tensor) -> None:
        """Rank 0's ``tensor`` (on the device) into every rank's ``tensor``."""
        dist.broadcast(tensor, src=0)

    # ---- host data (gloo) ----------------------------------------------------------------

    def broadcast_host(self, tensor: torch.Tensor) -> None:
        """Rank 0's host ``tensor`` into every rank's ``tensor`` (same size everywhere)."""
        dist.broadcast(tensor, src=0, group=self.host_group)

    def agree_min(self, value: int) -> int:
        """The smallest of every rank's ``value`` (the KV pool each rank can hold)."""
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.host_group)
        return int(t.item())

    def all_ints(self, value: int) -> list[int]:
        """Every rank's ``value``, in rank order."""
        t = torch.zeros(self.world_size, dtype=torch.int64)
        t[self.rank] = value
        dist.all_reduce(t, group=self.host_group)
        return [int(v) for v in t.tolist()]

    def leave(self) -> None:
        """Destroy the process group (this process may start another one later)."""
        if dist.is_initialized():
            dist.destroy_process_group()
