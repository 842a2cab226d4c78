"""CUDA graphs for decode steps: one graph per batch-size bucket, replayed.

A pure-decode step of ``n`` sequences runs as the graph of the smallest bucket
``>= n`` (``graph_batch_sizes``), its inputs padded by ``StepInputBuilder.build(pad_to=)``
into the very buffers the graph was captured on, so a replay is one launch instead of
the forward's ~1,000 kernel launches and their Python dispatch. Mixed and prefill
steps, and decode batches above the largest bucket, run eagerly.

Capture comes after a warm-up forward of the same bucket (kernel compilation, cupy's
context, RoPE tables on the device: nothing may initialise inside a capture). The
captured metadata has ``max_seq_len = max_model_len``, no host copies of the lengths
(a graph cannot depend on host values) and, per sliding window, the backend's fixed
decode plan for the bucket (``AttentionMetadata.decode_plan``: a grid that does not
depend on the step, see ``qworker/attention/backend.py``). All graphs share one memory
pool; ``capture_all`` reports the device memory they hold, which pool sizing subtracts
(``engine_setup``).

``graph_factory`` stands in for ``torch.cuda.CUDAGraph`` in CPU tests: a graph that
re-runs its captured function on replay reads the same static buffers, so padding,
bucket choice and buffer reuse are checked without a GPU.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Protocol

import torch

from qworker.attention.paged_attention import forward_context
from qworker.engine.step_inputs import PreparedStep, StepInput, StepInputBuilder

logger = logging.getLogger(__name__)


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """Buckets 1, 2, 4, 8, then every multiple of 16 up to ``max_num_seqs`` (which is
    always the last bucket)."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_num_seqs]
    sizes += list(range(16, max_num_seqs, 16))
    return [*sizes, max_num_seqs]


def bucket_for(num_seqs: int, sizes: list[int]) -> int | None:
    """The smallest bucket holding ``num_seqs`` sequences; None above the largest."""
    i = bisect.bisect_left(sizes, num_seqs)
    return sizes[i] if i < len(sizes) else None


class Graph(Protocol):
    """What a captured graph offers: replay it."""

    def replay(self) -> None:
        """Run the captured work again on the same buffers."""


GraphFactory = Callable[[Callable[[], torch.Tensor], Any], tuple[Graph, torch.Tensor]]


def cuda_graph_factory(fn: Callable[[], torch.Tensor], pool: Any) -> tuple[Graph, torch.Tensor]:
    """Capture ``fn`` into a ``torch.cuda.CUDAGraph`` sharing memory ``pool``."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = fn()
    return graph, out


#: The fixed decode plans of one bucket, per sliding window (None: full attention).
PlanFactory = Callable[[int], dict[int | None, Any]]


@dataclass(slots=True)
class _Captured:
    graph: Graph
    output: torch.Tensor  # hidden states [bucket, hidden], rewritten by every replay
    plans: dict[int | None, Any] | None  # kept alive: the graph uses their workspaces


class CudaGraphRunner:
    """Captures and replays the model's decode forward per batch-size bucket."""

    def __init__(self, model: torch.nn.Module, inputs: StepInputBuilder, sizes: list[int],
                 max_model_len: int, graph_factory: GraphFactory | None = None,
                 plan_factory: PlanFactory | None = None) -> None:
        self.model = model
        self._plans = plan_factory
        self.inputs = inputs
        self.sizes = sorted(sizes)
        self.max_model_len = max_model_len
        self._factory = graph_factory or cuda_graph_factory
        self._graphs: dict[int, _Captured] = {}
        self._generation = inputs.generation
        self.memory_bytes = 0
        self.capture_seconds = 0.0

    @property
    def captured(self) -> bool:
        """True once ``capture_all`` ran (and the buffers have not moved since)."""
        return bool(self._graphs)

    def bucket(self, step: StepInput) -> int | None:
        """The bucket a step replays in, or None when it runs eagerly."""
        if not self._graphs or not step.token_chunks:
            return None
        if self.inputs.generation != self._generation:  # buffers moved: graphs are stale
            logger.warning("step buffers were reallocated; CUDA graphs dropped")
            self.release()
            return None
        if any(len(c) != 1 for c in step.token_chunks):
            return None
        return bucket_for(len(step.token_chunks), self.sizes)

    def capture_all(self) -> int:
        """Warm up and capture every bucket, largest first; returns the device bytes the
        graphs hold (also in ``memory_bytes``)."""
        started = time.perf_counter()
        self._graphs.clear()
        on_gpu = self.inputs.device.type == "cuda"
        pool = torch.cuda.graph_pool_handle() if on_gpu else None
        before = _free_bytes() if on_gpu else 0
        for size in sorted(self.sizes, reverse=True):
            prepared = self.inputs.build(_dummy_decode(size))
            meta = replace(prepared.meta, max_seq_len=self.max_model_len,
                           host_query_start_loc=None, host_seq_lens=None)
            ids, pos = prepared.input_ids, prepared.positions
            plans = self._plans(size) if self._plans is not None else None

            def run(meta: Any = meta, ids: torch.Tensor = ids, pos: torch.Tensor = pos,
                    plans: dict[int | None, Any] | None = plans) -> torch.Tensor:
                with forward_context(_fresh(meta), plans):
                    return self.model(ids, pos)

            with torch.inference_mode():
                run()  # warm-up: compile kernels, move tables, before any capture
                if on_gpu:
                    torch.cuda.synchronize(self.inputs.device)
                graph, out = self._factory(run, pool)
            self._graphs[size] = _Captured(graph, out, plans)
        self._generation = self.inputs.generation
        if on_gpu:
            torch.cuda.synchronize(self.inputs.device)
            self.memory_bytes = max(0, before - _free_bytes())
        self.capture_seconds = time.perf_counter() - started
        logger.info("CUDA graphs: %d decode buckets (1..%d) captured in %.1fs, %.1f MiB",
                    len(self._graphs), max(self.sizes), self.capture_seconds,
                    self.memory_bytes / 2**20)
        return self.memory_bytes

    def replay(self, prepared: PreparedStep) -> torch.Tensor:
        """Hidden states ``[bucket, hidden]`` of a step built with ``pad_to=bucket``."""
        captured = self._graphs[prepared.meta.num_seqs]
        captured.graph.replay()
        return captured.output

    def release(self) -> None:
        """Drop every graph (the buffers or the KV pool they point at are changing)."""
        self._graphs.clear()
        self.memory_bytes = 0


def _dummy_decode(size: int) -> StepInput:
    """A decode step of ``size`` padding-like sequences (length 1, slot -1)."""
    return StepInput([[0]] * size, [0] * size, [[]] * size, [1] * size,
                     table_keys=[-2] * size)


def _fresh(meta: Any) -> Any:
    """New metadata and tensor objects over the same static memory for each run:
    backends may cache per-step plans by object identity, and each replay is a new step."""
    return replace(meta, query_start_loc=meta.query_start_loc[:], seq_lens=meta.seq_lens[:],
                   block_tables=meta.block_tables[:], slot_mapping=meta.slot_mapping[:])


def _free_bytes() -> int:
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info()
    return int(free)
