"""The model runner of a tensor-parallel rank: logits gathered on rank 0, steps shipped.

Every rank runs a ``ParallelModelRunner`` over its shard of the model and its own KV
pool (the same blocks, its own heads). During setup every rank executes the same
profiling forwards and graph captures side by side. Then rank 0 ``lead``s: each
``execute`` first ships the step (``wire``) to the followers, which run the same
forward on it (``follower``); block copies and swaps are replayed in rank 0's order
with the next step. An exception once a step has been shipped leaves the ranks out of
step, so it fails the engine (``EngineDeadError``), as does a rank that died.
"""

from __future__ import annotations

import logging
from contextlib import AbstractContextManager
from typing import Protocol

import numpy as np
import torch

from qworker.engine.model_runner import ModelRunner
from qworker.engine.parallel.group import RankGroup
from qworker.engine.parallel.wire import BlockOp, Header, decode_ops, encode_op, pack, unpack
from qworker.engine.step_inputs import PreparedStep, StepInput
from qworker.errors import EngineDeadError

logger = logging.getLogger(__name__)


class StepLink(Protocol):
    """Rank 0's line to the followers (``launcher.TensorParallelGroup``)."""

    def stepping(self) -> AbstractContextManager[None]:
        """Held around the shipping and the collectives of one step."""

    def send_header(self, header: bytes) -> None:
        """Wake every follower with the next step's header (raises when one is gone)."""

    def failure(self, exc: BaseException | None = None) -> EngineDeadError:
        """The error that ends the group (naming a rank that died); marks it broken."""


class ParallelModelRunner(ModelRunner):
    """A ``ModelRunner`` on one rank's shard (see the module docstring)."""

    def __init__(self, *args: object, group: RankGroup, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.group = group
        self._link: StepLink | None = None
        self._ops: list[int] = []
        self._payload = np.zeros(1 << 12, dtype=np.int64)
        self._graph_generation = -1
        self.broken: EngineDeadError | None = None
        #: Parameter bytes of every rank's shard, rank order (rank 0, once leading).
        self.weight_bytes_per_rank: list[int] = []

    def enable_cuda_graphs(self, *args: object, **kwargs: object) -> int:
        """``ModelRunner.enable_cuda_graphs`` (every rank captures the same buckets, the
        all-reduces inside the graphs)."""
        held = super().enable_cuda_graphs(*args, **kwargs)  # type: ignore[arg-type]
        self._graph_generation = self.inputs.generation
        return held

    # ---- rank 0 --------------------------------------------------------------------

    def lead(self, link: StepLink) -> None:
        """From now on ship every step and block operation to the followers over ``link``."""
        self._link = link
        self.inputs.table_log = []

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """Copy device blocks to host blocks here (and, shipped, on every rank)."""
        super().swap_out(pairs)
        self._record(BlockOp.SWAP_OUT, pairs)

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """Copy host blocks back to device blocks here (and, shipped, on every rank)."""
        super().swap_in(pairs)
        self._record(BlockOp.SWAP_IN, pairs)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write of whole blocks here (and, shipped, on every rank)."""
        super().copy_blocks(pairs)
        self._record(BlockOp.COPY, pairs)

    def _record(self, kind: BlockOp, pairs: list[tuple[int, int]]) -> None:
        if self._link is not None and pairs:
            encode_op(self._ops, kind, pairs)

    def execute(self, step: StepInput, prev_tokens: torch.Tensor | None = None
                ) -> torch.Tensor | None:
        """Rank 0 leading: ship ``step`` (and ``prev_tokens`` when it feeds them), then run
        it; fp32 logits of the sampling rows over the whole vocabulary."""
        link = self._link
        if link is None:
            return super().execute(step, prev_tokens)
        if self.broken is not None:
            raise self.broken
        with torch.inference_mode():
            prepared = self.prepare(step, prev_tokens)
            layout = self.inputs.last_layout
            assert layout is not None and self.inputs.table_log is not None
            feeds = prev_tokens is not None and layout.num_fed > 0
            prev = prev_tokens.contiguous() if feeds and prev_tokens is not None else None
            n64, n32 = self.inputs.packed()
            header, self._payload = pack(layout, n64, n32, self.inputs.table_log, self._ops,
                                         0 if prev is None else len(prev), self._payload)
            self.inputs.table_log.clear()
            self._ops.clear()
            try:
                with link.stepping():
                    link.send_header(header.to_bytes())
                    self.group.broadcast_host(
                        torch.from_numpy(self._payload[: header.payload_len]))
                    if prev is not None:
                        self.group.broadcast_device(prev)
                    return self.forward(prepared)
            except EngineDeadError as exc:
                self.broken = exc
                raise
            except Exception as exc:
                self.broken = link.failure(exc)
                raise self.broken from exc

    # ---- every rank ------------------------------------------------------------------

    def forward(self, prepared: PreparedStep) -> torch.Tensor | None:
        """Run this rank's shard; rank 0 returns the logits over the whole vocabulary (every
        rank's columns gathered), the others None."""
        logits = super().forward(prepared)
        if logits is None:
            return None
        return self.group.gather_logits(logits, self.spec.vocab_size)

    # ---- followers -------------------------------------------------------------------

    def run_shipped(self, header: Header, payload: np.ndarray,
                    prev_tokens: torch.Tensor | None) -> None:
        """Replay one shipped step on a follower: its block operations, then its forward
        (``prev_tokens``: the previous step's sampled ids, when the step feeds them)."""
        n64, n32, runs, ops = unpack(header, payload)
        for kind, pairs in decode_ops(ops):
            if kind is BlockOp.SWAP_OUT:
                super().swap_out(pairs)
            elif kind is BlockOp.SWAP_IN:
                super().swap_in(pairs)
            else:
                super().copy_blocks(pairs)
        with torch.inference_mode():
            prepared = self.inputs.load_packed(header.layout, n64, n32, runs, prev_tokens)
            if self.graphs is not None and self.inputs.generation != self._graph_generation:
                self.drop_cuda_graphs()  # buffers grew (so did rank 0's, which dropped its own)
            self.forward(prepared)
