"""Grammar state of the running sequences and their token masks, one batch per step.

Each constrained sequence has a matcher that has consumed exactly its generated
tokens. The matcher is brought up to date lazily, from ``seq.token_ids``, when the
sequence next samples: tokens appended since are consumed; a sequence whose kept
tokens are fewer than the matcher consumed (tokens taken back) or that the manager
has not seen for a while (its matcher was dropped) gets a fresh matcher that replays
its tokens. So preemption by recompute or swap, and prefix caching, need nothing
special: the matcher always matches the tokens the sequence keeps.

``prepare(seqs)`` starts filling the step's masks on a helper thread (llguidance
drops the GIL), so the fill overlaps the model's forward; ``masks(seqs)`` waits for
it and fills whatever the prepared set missed (siblings forked this step). The overlap
is off (``overlap=False``: fills happen in ``masks``) when the forward itself keeps
every core busy, as a CPU forward on all cores does: a fill thread competing with
torch's threads slowed that forward several times over on a 2-core machine.
"""

from __future__ import annotations

import concurrent.futures
import logging
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from qworker.engine.sequence import Sequence
from qworker.engine.structured.backend import GrammarBackend, words_per_mask
from qworker.engine.structured.params import StructuredOutputsParams

logger = logging.getLogger(__name__)

#: A matcher unused for this many steps is dropped (rebuilt by replay if needed again).
_IDLE_STEPS = 32


@dataclass(slots=True, eq=False)
class _State:
    seq: Sequence
    matcher: Any
    num_consumed: int
    last_step: int
    failed: bool = False


@dataclass(slots=True)
class StepMasks:
    """One step's masks: for each constrained row of the batch, its bitmask row.

    ``rows[i]`` is the batch row whose allowed tokens are ``words[index[i]]`` (``words``
    is a CPU int32 ``[n, words_per_mask(vocab)]`` tensor, pinned next to a GPU);
    ``stopped[i]`` says the grammar is complete there (only EOS allowed).
    """

    rows: np.ndarray
    index: np.ndarray
    words: torch.Tensor
    stopped: np.ndarray


class GrammarManager:
    """Per-sequence matchers and batched mask fills for one engine (engine thread)."""

    def __init__(self, backend: GrammarBackend, pin_memory: bool = False,
                 overlap: bool = True) -> None:
        self.backend = backend
        self.overlap = overlap
        self.words = words_per_mask(backend.vocab_size)
        self._pin = pin_memory
        self._buffer = torch.empty(0, self.words, dtype=torch.int32)
        self._eos_words = np.zeros(self.words, dtype=np.uint32)
        for t in backend.eos_token_ids:
            if 0 <= t < backend.vocab_size:
                self._eos_words[t // 32] |= np.uint32(1 << (t % 32))
        self._states: dict[int, _State] = {}
        self._step = 0
        self._thread: concurrent.futures.ThreadPoolExecutor | None = None
        self._prepared: tuple[dict[int, int], concurrent.futures.Future[np.ndarray]] | None = None
        self._copy_done: Any = None  # CUDA event after the last host-to-device mask copy

    def validate(self, spec: StructuredOutputsParams) -> None:
        """Compile ``spec`` now (cached), raising ``InvalidRequestError`` if it cannot be."""
        self.backend.compile(spec)

    # ---- per step --------------------------------------------------------------------

    def prepare(self, seqs: list[Sequence]) -> None:
        """Start filling the masks of the constrained ``seqs`` on the helper thread."""
        if self._prepared is not None:  # a step that never sampled: let its fill finish
            self._prepared[1].result()
            self._prepared = None
        todo = [s for s in seqs if s.request.params.structured_outputs is not None]
        if not todo or not self.overlap:
            return
        self._wait_copy()
        self._grow(len(todo))
        if self._thread is None:
            self._thread = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="qworker-grammar-mask")
        slots = {s.seq_id: i for i, s in enumerate(todo)}
        self._prepared = (slots, self._thread.submit(self._fill, todo, 0))

    def masks(self, seqs: list[Sequence]) -> StepMasks | None:
        """The masks of the constrained rows of ``seqs`` (one sampled row per sequence)."""
        rows = [i for i, s in enumerate(seqs) if s.request.params.structured_outputs is not None]
        if not rows:
            self._prepared = None
            return None
        slots: dict[int, int] = {}
        stopped_by_slot: list[bool] = []
        if self._prepared is not None:
            slots, future = self._prepared
            self._prepared = None
            stopped_by_slot = list(future.result())
        missing = [seqs[i] for i in rows if seqs[i].seq_id not in slots]
        if missing:
            self._wait_copy()
            start = len(stopped_by_slot)
            self._grow(start + len(missing))
            stopped_by_slot.extend(self._fill(missing, start))
            for j, s in enumerate(missing):
                slots[s.seq_id] = start + j
        index = np.fromiter((slots[seqs[i].seq_id] for i in rows), dtype=np.int64,
                            count=len(rows))
        stopped = np.asarray(stopped_by_slot, dtype=bool)[index]
        return StepMasks(np.asarray(rows, dtype=np.int64), index,
                         self._buffer[: len(stopped_by_slot)], stopped)

    def copied(self, event: Any) -> None:
        """Record the CUDA event after which the mask buffer may be overwritten."""
        self._copy_done = event

    # ---- internals -------------------------------------------------------------------

    def _wait_copy(self) -> None:
        if self._copy_done is not None:
            self._copy_done.synchronize()
            self._copy_done = None

    def _grow(self, rows: int) -> None:
        if self._buffer.shape[0] >= rows:
            return
        size = max(rows, 2 * self._buffer.shape[0], 8)
        old = self._buffer
        self._buffer = torch.empty(size, self.words, dtype=torch.int32, pin_memory=self._pin)
        self._buffer[: old.shape[0]] = old

    def _fill(self, seqs: list[Sequence], start: int) -> np.ndarray:
        """Sync the matchers of ``seqs`` and fill buffer rows ``start..``; stopped flags."""
        self._step += 1
        states = [self._sync(s) for s in seqs]
        pairs = [(st.matcher, start + j) for j, st in enumerate(states) if not st.failed]
        self.backend.fill(pairs, self._buffer)
        stopped = np.zeros(len(states), dtype=bool)
        view = self._buffer.numpy().view(np.uint32)
        for j, st in enumerate(states):
            if st.failed:  # cannot continue the grammar: end the sequence
                view[start + j] = self._eos_words
                stopped[j] = True
            else:
                stopped[j] = st.matcher.is_stopped()
        if self._step % _IDLE_STEPS == 0:
            old = self._step - _IDLE_STEPS
            self._states = {k: v for k, v in self._states.items() if v.last_step > old}
        return stopped

    def _sync(self, seq: Sequence) -> _State:
        if seq.num_pending:  # the engine waits for these (SamplingParams.needs_host_history)
            raise RuntimeError(f"sequence {seq.seq_id}: a constrained row sampled before its "
                               "previous token reached the host")
        st = self._states.get(seq.seq_id)
        out = seq.num_output_tokens
        if st is None or st.seq is not seq or st.num_consumed > out:
            st = self._fresh(seq)
        if st.num_consumed < out and not st.failed:
            new = seq.token_ids[seq.num_prompt_tokens + st.num_consumed :]
            if not st.matcher.consume_tokens(new):
                st.failed = True
                logger.warning("sequence %d: grammar rejected a generated token (%s); ending it",
                               seq.seq_id, st.matcher.get_error()[:200])
        st.num_consumed = out
        st.last_step = self._step
        return st

    def _fresh(self, seq: Sequence) -> _State:
        spec = seq.request.params.structured_outputs
        assert spec is not None
        try:
            matcher = self.backend.new_matcher(self.backend.compile(spec))
        except ValueError as exc:  # validated at admission; a failure now ends the sequence
            logger.warning("sequence %d: grammar unavailable (%s); ending it", seq.seq_id, exc)
            st = _State(seq, None, 0, self._step, failed=True)
        else:
            st = _State(seq, matcher, 0, self._step)
        self._states[seq.seq_id] = st
        return st
