"""A scheduled step turned into the forward's inputs without a host-device round trip.

Everything is written with numpy into persistent, preallocated host buffers (pinned
next to a GPU) and reaches the device in three ``non_blocking`` copies per step: one
int64 buffer (input ids, positions, slots, logits rows, the rows fed from the previous
step's samples), one int32 buffer (query starts, sequence lengths) and the used rows of
the block table. The block table itself is persistent: a row is rewritten only when
its sequence's table changed other than by appending (``table_keys``), otherwise only
the new block ids are written. On the CPU the host buffers *are* the device tensors
and nothing is copied.

A pinned buffer is rewritten only after the copies that read it have run (one CUDA
event per step, normally long passed). Attention metadata is built here once per step
and shared by every layer; it carries host copies of ``query_start_loc``/``seq_lens``
so no backend reads them back.

Tensor parallelism (``qworker.engine.parallel``) ships a built step to the other ranks
as it sits in the host buffers: ``last_layout`` says where (and the host facts of its
metadata), ``packed`` returns the used buffer parts, ``table_log`` records the block
table's writes, and ``load_packed`` rebuilds the same ``PreparedStep`` from them in a
follower's own buffers (where its CUDA graphs were captured).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

from qworker.attention.backend import AttentionMetadata


@dataclass(slots=True)
class StepInput:
    """One step as the runner sees it, sequences ordered decodes first.

    Per sequence: its new tokens, how many tokens are already cached, its block ids and
    how many logits rows it samples (``sample[i]``: 0, 1, or ``n`` when a request's
    first token is drawn ``n`` times; ``True``/``False`` mean 1/0). ``table_keys``
    (``KVCacheManager.table_key``) lets the block table be updated incrementally;
    ``prev_rows[i] >= 0`` says the last token of the chunk is not known on the host
    yet: it is row ``prev_rows[i]`` of the previous step's sampled ids (on the device).
    """

    token_chunks: list[list[int]]
    num_computed: list[int]
    block_tables: list[list[int]]
    sample: list[int] | list[bool]
    table_keys: list[int] | None = None
    prev_rows: list[int] | None = None


@dataclass(slots=True)
class PreparedStep:
    """The forward's device inputs and the rows whose logits are wanted."""

    input_ids: torch.Tensor  # int64 [T]
    positions: torch.Tensor  # int64 [T]
    meta: AttentionMetadata
    logits_index: torch.Tensor | None  # int64 [R] hidden rows to project; None: all T rows
    num_logit_rows: int
    graph_size: int | None = None  # the CUDA graph bucket this step replays in

    @property
    def is_decode(self) -> bool:
        """True when every sequence feeds exactly one token (a CUDA-graph candidate)."""
        return self.meta.num_decodes == self.meta.num_seqs


@dataclass(slots=True)
class StepLayout:
    """Where a built step sits in the host buffers and the host facts of its metadata
    (-1: absent); ``as_ints``/``from_ints`` carry it between ranks."""

    num_tokens: int
    num_seqs: int
    num_decodes: int
    n64: int  # int64 values used (ids, positions, slots, logits rows, feed)
    n32: int  # int32 values used (query starts, sequence lengths)
    width: int  # block-table columns the step needs
    max_query_len: int
    max_seq_len: int
    num_rows: int  # logits rows sampled
    logits_start: int  # where the logits row indices start (-1: every row samples)
    feed_start: int  # where the fed-token indices start (-1: none)
    num_fed: int
    graph_size: int  # the CUDA graph bucket replayed (-1: eager)

    def as_ints(self) -> list[int]:
        """The fields in order."""
        return [getattr(self, f) for f in self.__slots__]  # type: ignore[attr-defined]

    @classmethod
    def from_ints(cls, values: list[int]) -> StepLayout:
        """The inverse of ``as_ints``."""
        return cls(*values)


_PAD_KEY = -2  # table key of graph padding rows: their slot is -1, their table row unused


def _padded(step: StepInput, size: int) -> StepInput:
    """``step`` (decode-only) with ``size - len(step)`` padding sequences appended."""
    extra = size - len(step.token_chunks)
    keys = step.table_keys if step.table_keys is not None else [None] * len(step.token_chunks)
    return StepInput(
        token_chunks=[*step.token_chunks, *([[0]] * extra)],
        num_computed=[*step.num_computed, *([0] * extra)],
        block_tables=[*step.block_tables, *([[]] * extra)],
        sample=[*step.sample, *([0] * extra)],
        table_keys=[*keys, *([_PAD_KEY] * extra)],  # type: ignore[list-item]
        prev_rows=None if step.prev_rows is None else [*step.prev_rows, *([-1] * extra)],
    )


def _host_tensor(shape: tuple[int, ...], dtype: torch.dtype, pin: bool) -> torch.Tensor:
    return torch.zeros(shape, dtype=dtype, pin_memory=pin)


class StepInputBuilder:
    """Persistent step buffers and the incremental block table of one model runner.

    Capacities grow when a step needs more (never shrink); ``max_tokens``,
    ``max_seqs`` and ``max_blocks`` are the starting sizes.
    """

    def __init__(self, device: torch.device, block_size: int, max_tokens: int,
                 max_seqs: int, max_blocks: int) -> None:
        self.device = device
        self.block_size = block_size
        self._on_host = device.type == "cpu"
        self._pin = device.type == "cuda"
        self._copied: torch.cuda.Event | None = None
        self.generation = 0  # bumped whenever a buffer is reallocated (graphs go stale)
        #: A list to record the block table's writes in (``(row, col, count, *ids)`` runs),
        #: or None (tensor parallelism's leader sets it; ``load_packed`` replays them).
        self.table_log: list[int] | None = None
        self.last_layout: StepLayout | None = None
        self._alloc_flat(max(1, max_tokens), max(1, max_seqs))
        self._alloc_table(max(1, max_seqs), max(1, max_blocks))

    # ---- buffers -----------------------------------------------------------------------

    def _alloc_flat(self, max_tokens: int, max_seqs: int) -> None:
        self.generation += 1
        self.max_tokens, self.max_seqs_flat = max_tokens, max_seqs
        n64 = 3 * max_tokens + 3 * max_seqs
        n32 = 2 * max_seqs + 1
        self._h64 = _host_tensor((n64,), torch.int64, self._pin)
        self._h32 = _host_tensor((n32,), torch.int32, self._pin)
        self._n64, self._n32 = self._h64.numpy(), self._h32.numpy()
        if self._on_host:
            self._d64, self._d32 = self._h64, self._h32
        else:
            self._d64 = torch.zeros(n64, dtype=torch.int64, device=self.device)
            self._d32 = torch.zeros(n32, dtype=torch.int32, device=self.device)

    def _alloc_table(self, rows: int, width: int) -> None:
        self.generation += 1
        self._htable = _host_tensor((rows, width), torch.int32, self._pin)
        self._ntable = self._htable.numpy()
        self._dtable = (self._htable if self._on_host else
                        torch.zeros((rows, width), dtype=torch.int32, device=self.device))
        self._row_key: list[int | None] = [None] * rows
        self._row_len: list[int] = [0] * rows

    def _ensure(self, num_tokens: int, num_seqs: int, width: int) -> None:
        if num_tokens > self.max_tokens or num_seqs > self.max_seqs_flat:
            self._wait()
            self._alloc_flat(max(num_tokens, self.max_tokens),
                             max(num_seqs, self.max_seqs_flat))
        rows, cols = self._ntable.shape
        if num_seqs > rows or width > cols:
            self._wait()
            self._alloc_table(max(num_seqs, rows), max(width, cols))

    def _wait(self) -> None:
        """Block until the last step's copies have read the pinned buffers (they normally
        have: ``query`` costs no synchronisation)."""
        if self._copied is not None:
            if not self._copied.query():
                self._copied.synchronize()
            self._copied = None

    # ---- block table -------------------------------------------------------------------

    def _update_table(self, tables: list[list[int]], keys: list[int] | None) -> None:
        table, row_key, row_len = self._ntable, self._row_key, self._row_len
        log = self.table_log
        for i, ids in enumerate(tables):
            key = None if keys is None else keys[i]
            n = len(ids)
            if key is not None and row_key[i] == key:
                done = row_len[i]
                if n > done:
                    table[i, done:n] = ids[done:]
                    row_len[i] = n
                    if log is not None:
                        log.extend((i, done, n - done, *ids[done:]))
            else:
                table[i, :n] = ids
                row_key[i], row_len[i] = key, n
                if log is not None and n:
                    log.extend((i, 0, n, *ids))

    # ---- the step ------------------------------------------------------------------------

    def build(self, step: StepInput, prev_tokens: torch.Tensor | None = None,
              pad_to: int | None = None) -> PreparedStep:
        """Write ``step`` into the buffers, start the copies, return the device views.

        ``prev_tokens`` (int64, on the device) is the previous step's sampled ids, read
        for the sequences with ``prev_rows[i] >= 0``. ``pad_to`` (a decode-only step
        replayed by a CUDA graph of that batch size) appends padding sequences of one
        token each: id 0, position 0, slot -1 (never written), length 1 (reads a valid
        block and is dropped), so the buffers sit where the graph was captured.
        """
        if pad_to is not None and pad_to > len(step.token_chunks):
            step = _padded(step, pad_to)
        chunks = step.token_chunks
        num_seqs = len(chunks)
        bs = self.block_size
        q_lens = np.fromiter(map(len, chunks), dtype=np.int64, count=num_seqs)
        ctx = np.asarray(step.num_computed, dtype=np.int64)
        seq_lens = ctx + q_lens
        num_tokens = int(q_lens.sum())
        decode_only = num_tokens == num_seqs
        width = max(map(len, step.block_tables), default=1)
        self._ensure(num_tokens, num_seqs, width)
        self._wait()
        self._update_table(step.block_tables, step.table_keys)

        qsl = np.zeros(num_seqs + 1, dtype=np.int64)
        np.cumsum(q_lens, out=qsl[1:])
        h64 = self._n64
        t = num_tokens
        ids, pos, slots = h64[:t], h64[t : 2 * t], h64[2 * t : 3 * t]
        if decode_only:
            ids[:] = [c[0] for c in chunks]
            pos[:] = ctx
            seq_of_token = np.arange(num_seqs)
            num_decodes = num_seqs
        else:
            ids[:] = np.fromiter(itertools.chain.from_iterable(chunks), dtype=np.int64,
                                 count=num_tokens)
            seq_of_token = np.repeat(np.arange(num_seqs), q_lens)
            pos[:] = np.arange(num_tokens) - np.repeat(qsl[:-1] - ctx, q_lens)
            not_decode = q_lens != 1
            num_decodes = int(np.argmax(not_decode)) if not_decode.any() else num_seqs
        slots[:] = self._ntable[seq_of_token, pos // bs].astype(np.int64) * bs + pos % bs
        if step.table_keys is not None and _PAD_KEY in step.table_keys:
            slots[np.asarray(step.table_keys) == _PAD_KEY] = -1
        end = 3 * t

        counts = np.asarray(step.sample, dtype=np.int64)
        num_rows = int(counts.sum())
        logits_index: slice | None = None
        if num_rows and not (decode_only and num_rows == num_seqs and counts.all()):
            h64[end : end + num_rows] = np.repeat(qsl[1:] - 1, counts)
            logits_index = slice(end, end + num_rows)
            end += num_rows
        feed: tuple[slice, slice] | None = None
        if step.prev_rows is not None and prev_tokens is not None:
            prev = np.asarray(step.prev_rows, dtype=np.int64)
            fed = prev >= 0
            num_fed = int(fed.sum())
            if num_fed:
                h64[end : end + num_fed] = (qsl[1:] - 1)[fed]
                h64[end + num_fed : end + 2 * num_fed] = prev[fed]
                feed = slice(end, end + num_fed), slice(end + num_fed, end + 2 * num_fed)
                end += 2 * num_fed

        h32 = self._n32
        h32[: num_seqs + 1] = qsl
        h32[num_seqs + 1 : 2 * num_seqs + 1] = seq_lens
        layout = StepLayout(
            num_tokens=num_tokens, num_seqs=num_seqs, num_decodes=num_decodes, n64=end,
            n32=2 * num_seqs + 1, width=width,
            max_query_len=int(q_lens.max()) if num_seqs else 0,
            max_seq_len=int(seq_lens.max()) if num_seqs else 0,
            num_rows=num_rows,
            logits_start=-1 if logits_index is None else logits_index.start,
            feed_start=-1 if feed is None else feed[0].start,
            num_fed=0 if feed is None else feed[0].stop - feed[0].start,
            graph_size=pad_to if pad_to is not None and pad_to == num_seqs else -1)
        self.last_layout = layout
        return self._finish(layout, qsl, seq_lens, prev_tokens)

    def packed(self) -> tuple[np.ndarray, np.ndarray]:
        """The int64 and int32 host values of the last step built (views: copy them before
        the next step)."""
        layout = self.last_layout
        if layout is None:
            raise RuntimeError("no step was built yet")
        return self._n64[: layout.n64], self._n32[: layout.n32]

    def load_packed(self, layout: StepLayout, n64: np.ndarray, n32: np.ndarray,
                    table_runs: np.ndarray, prev_tokens: torch.Tensor | None = None
                    ) -> PreparedStep:
        """The ``PreparedStep`` another builder made (its ``last_layout``, ``packed``
        values and ``table_log`` runs since its previous step), in this builder's buffers.

        Buffers grow as the other builder's did (the same sizes arrive in the same order),
        so its block-table rewrites after a growth land here too.
        """
        self._ensure(layout.num_tokens, layout.num_seqs, layout.width)
        self._wait()
        self._n64[: layout.n64] = n64
        self._n32[: layout.n32] = n32
        table, i, end = self._ntable, 0, len(table_runs)
        while i < end:
            row, col, count = (int(v) for v in table_runs[i : i + 3])
            table[row, col : col + count] = table_runs[i + 3 : i + 3 + count]
            i += 3 + count
        s = layout.num_seqs
        qsl = n32[: s + 1].astype(np.int64)
        seq_lens = n32[s + 1 : 2 * s + 1].astype(np.int64)
        self.last_layout = layout
        return self._finish(layout, qsl, seq_lens, prev_tokens)

    def _finish(self, layout: StepLayout, qsl: np.ndarray, seq_lens: np.ndarray,
                prev_tokens: torch.Tensor | None) -> PreparedStep:
        """Start the copies of a step written into the host buffers; its device views."""
        t, num_seqs, n32 = layout.num_tokens, layout.num_seqs, layout.n32
        self._copy(layout.n64, n32, num_seqs)
        d64, d32 = self._d64, self._d32
        input_ids = d64[:t]
        if layout.num_fed and prev_tokens is not None:
            fed, k = layout.feed_start, layout.num_fed
            input_ids.index_copy_(0, d64[fed : fed + k],
                                  prev_tokens.index_select(0, d64[fed + k : fed + 2 * k]))
        meta = AttentionMetadata(
            num_seqs=num_seqs,
            num_tokens=t,
            num_decodes=layout.num_decodes,
            query_start_loc=d32[: num_seqs + 1],
            seq_lens=d32[num_seqs + 1 : n32],
            block_tables=self._dtable[:num_seqs],
            slot_mapping=d64[2 * t : 3 * t],
            max_query_len=layout.max_query_len,
            max_seq_len=layout.max_seq_len,
            host_query_start_loc=qsl.tolist(),
            host_seq_lens=seq_lens.tolist(),
        )
        rows = layout.logits_start
        return PreparedStep(
            input_ids=input_ids,
            positions=d64[t : 2 * t],
            meta=meta,
            logits_index=None if rows < 0 else d64[rows : rows + layout.num_rows],
            num_logit_rows=layout.num_rows,
            graph_size=None if layout.graph_size < 0 else layout.graph_size,
        )

    def _copy(self, n64: int, n32: int, num_seqs: int) -> None:
        if self._on_host:
            return
        self._d64[:n64].copy_(self._h64[:n64], non_blocking=True)
        self._d32[:n32].copy_(self._h32[:n32], non_blocking=True)
        if num_seqs:
            self._dtable[:num_seqs].copy_(self._htable[:num_seqs], non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._copied = event
