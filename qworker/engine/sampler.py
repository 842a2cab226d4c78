"""Turn one step's logits into next tokens, for any mix of per-row settings at once.

Order of processing: penalties (repetition, then presence/frequency; ``penalties``),
``min_tokens`` (EOS and stop ids forbidden until reached), the grammar masks of
constrained rows (``structured``), then greedy argmax, or temperature, top-k, top-p,
min-p and a draw. Every stage is a few tensor ops over all the rows that need it; the
per-row settings become arrays (numpy, from each request's precomputed ``RowParams``)
and one small host-to-device copy, never a Python loop of torch ops.

A draw inverts the row's CDF at one uniform number ``u``: exact categorical sampling
with a single random number per row. For a seeded request ``u`` is a hash of (seed,
completion index, index of the token being generated), so its draws do not depend on
which other rows share the batch, nor on preemption; unseeded rows take ``u`` from
torch's global generator (``torch.manual_seed`` / the engine's ``seed``).

Log-probabilities are those of the model's raw distribution (``log_softmax`` of the
unprocessed logits, vLLM's default), computed only for rows that ask. Greedy rows
without penalties, constraints or min_tokens are exactly ``logits.argmax(-1)``.

The result keeps the token ids on the device (``SamplerOutput.token_ids_device``);
the host gets them, with the logprobs, in one copy (``sampler_output``).
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch

from qworker.engine.device_copy import to_device
from qworker.engine.penalties import TokenCounts
from qworker.engine.sampler_output import SamplerOutput
from qworker.engine.sampling_params import SamplingParams
from qworker.engine.sequence import Sequence
from qworker.engine.structured.bitmask import (
    apply_token_bitmask,
    masked_argmax_cpu,
    unpack_allowed,
)
from qworker.errors import InvalidRequestError

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def _mix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finalizer on a uint64 array (wrapping arithmetic)."""
    x = (x ^ (x >> np.uint64(30))) * _M1
    x = (x ^ (x >> np.uint64(27))) * _M2
    return x ^ (x >> np.uint64(31))


def seeded_uniforms(seeds: np.ndarray, index: np.ndarray, position: np.ndarray) -> np.ndarray:
    """Uniform floats in [0, 1), one per row, a fixed function of (seed, index, position).

    ``seeds`` are uint64 (a seed modulo 2**64); ``index`` the completion index within
    its request; ``position`` the index of the output token being drawn.
    """
    with np.errstate(over="ignore"):
        h = _mix64(seeds.astype(np.uint64) + _GOLDEN)
        h = _mix64(h ^ (index.astype(np.uint64) * _GOLDEN + np.uint64(1)))
        h = _mix64(h ^ (position.astype(np.uint64) * _M1 + np.uint64(2)))
    return (h >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


class Sampler:
    """Batched sampler; ``sample`` handles any mix of per-row settings.

    ``tokenizer``/``vocab_size``/``eos_token_ids`` are the model's; structured outputs
    need the tokenizer (and the llguidance package, imported on first use).
    """

    def __init__(self, device: torch.device | str = "cpu", tokenizer: Any | None = None,
                 vocab_size: int | None = None, eos_token_ids: list[int] | tuple[int, ...] = (),
                 compile_timeout: float | None = None) -> None:
        self.device = torch.device(device)
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self._compile_timeout = compile_timeout
        self._counts: TokenCounts | None = None
        self._grammar: Any = None  # GrammarManager, built on the first structured request
        self._kernels: Any = None  # CpuKernels, False where they cannot be built

    # ---- request admission (any thread) -------------------------------------------------

    def validate(self, params: SamplingParams) -> None:
        """Compile ``params``' structured output spec (cached), or raise
        ``InvalidRequestError`` naming the problem; nothing to do for other params."""
        if params.structured_outputs is not None:
            self._grammar_manager().validate(params.structured_outputs)

    def _grammar_manager(self) -> Any:
        if self._grammar is None:
            from qworker.engine.structured.backend import DEFAULT_COMPILE_TIMEOUT, GrammarBackend
            from qworker.engine.structured.manager import GrammarManager

            if self.vocab_size is None:
                raise InvalidRequestError("structured outputs need the model's vocabulary size")
            gpu = self.device.type == "cuda"
            # Overlap fills with the forward, on llguidance's thread pool, only with cores
            # torch's threads leave free: the GPU runs a CUDA forward; on CPU, fill threads
            # competing with torch's slow the forward down more than the fill costs. The
            # packed matmuls' helpers (qworker.cpu_kernels) share work and tolerate it: with
            # them on every core, overlapped fills cost 1.15x against 1.24x for serial
            # ones (docs/benchmarks.md).
            free = (os.cpu_count() or 1) - torch.get_num_threads()
            spare = gpu or free > 0
            backend = GrammarBackend(
                self.tokenizer, self.vocab_size, list(self.eos_token_ids),
                compile_timeout=self._compile_timeout or DEFAULT_COMPILE_TIMEOUT,
                num_threads=None if gpu else max(0, free))
            self._grammar = GrammarManager(backend, pin_memory=gpu, overlap=spare)
        return self._grammar

    # ---- per step (engine thread) ----------------------------------------------------

    def prepare(self, seqs: list[Sequence]) -> None:
        """Optional, before the forward: start this step's grammar mask fill for ``seqs``
        (the sequences that will sample) so it overlaps the model's work."""
        if self._grammar is not None:
            self._grammar.prepare(seqs)

    def sample(
        self,
        logits: torch.Tensor,
        seqs: list[Sequence],
        output_positions: list[int] | None = None,
    ) -> SamplerOutput:
        """Choose a token for each row of fp32 ``logits`` ``[len(seqs), vocab]``.

        ``output_positions[i]`` is the index of the token being generated for row ``i``
        (default: the sequence's current number of output tokens). Each sequence
        appears at most once.
        """
        rows = [s.request.params.row for s in seqs]
        if all(r.plain for r in rows):
            return SamplerOutput(logits.argmax(dim=-1))
        vocab = logits.shape[1]
        dev = logits.device
        if output_positions is None:
            output_positions = [s.num_output_tokens for s in seqs]
        pos = np.asarray(output_positions, dtype=np.int64)
        lp_rows = [i for i, r in enumerate(rows) if r.logprobs >= 0]
        lp_idx = raw_lp = None
        if lp_rows:
            lp_idx = to_device(lp_rows, dev, np.int64)
            raw_lp = torch.log_softmax(logits.index_select(0, lp_idx), dim=-1)

        pen_rows = [i for i, r in enumerate(rows) if r.penalized]
        masks = self._grammar.masks(seqs) if self._grammar is not None else None
        short = [i for i, r in enumerate(rows) if r.min_tokens > pos[i]]
        # penalties and min_tokens work in place: on a copy, never on the caller's logits
        x = logits.clone() if pen_rows or short else logits
        slots = None
        if pen_rows:
            counts = self._token_counts(vocab, dev)
            slots = counts.slots_for([seqs[i] for i in pen_rows])
            counts.apply(x, np.asarray(pen_rows), slots,
                         np.array([rows[i].repetition_penalty for i in pen_rows]),
                         np.array([rows[i].presence_penalty for i in pen_rows]),
                         np.array([rows[i].frequency_penalty for i in pen_rows]))
        if short:
            self._ban_until_min_tokens(x, seqs, short, masks)
        random_rows = [i for i, r in enumerate(rows) if r.temperature != 0.0]
        kernels = (self._cpu_kernels() if masks is not None and not random_rows
                   and x.dtype == torch.float32 else None)
        if masks is not None and kernels is not None:  # one pass, no masked copy
            tokens = masked_argmax_cpu(kernels, x, masks.rows, masks.index, masks.words)
        else:
            if masks is not None:
                allowed = unpack_allowed(masks.words, vocab, dev)
                index = masks.index
                if not (len(index) == allowed.shape[0]
                        and (index == np.arange(len(index))).all()):
                    allowed = allowed.index_select(0, to_device(index, dev))
                x = apply_token_bitmask(x, masks.rows, allowed)
                if dev.type == "cuda":
                    event = torch.cuda.Event()
                    event.record()
                    self._grammar.copied(event)
            tokens = x.argmax(dim=-1)
        if random_rows:
            r_idx = to_device(random_rows, dev, np.int64)
            tokens.index_copy_(0, r_idx, self._draw(
                x.index_select(0, r_idx), [rows[i] for i in random_rows],
                [seqs[i].index for i in random_rows], pos[random_rows]))
        if slots is not None and self._counts is not None:
            self._counts.advance(slots, tokens.index_select(0, to_device(pen_rows, dev,
                                                                         np.int64)))
        chosen = top_vals = top_ids = None
        ks = [rows[i].logprobs for i in lp_rows]
        if raw_lp is not None:
            assert lp_idx is not None
            chosen = raw_lp.gather(1, tokens.index_select(0, lp_idx).unsqueeze(1)).squeeze(1)
            if max(ks):
                top_vals, top_ids = raw_lp.topk(max(ks), dim=-1)
        return SamplerOutput(tokens, lp_rows, ks, chosen, top_vals, top_ids)

    def _cpu_kernels(self) -> Any:
        """The compiled CPU kernels when this sampler runs on the CPU and they build here
        (``qworker.cpu_kernels``), else None (the torch forms)."""
        if self.device.type != "cpu":
            return None
        if self._kernels is None:
            from qworker import cpu_kernels

            self._kernels = cpu_kernels.load() or False
        return self._kernels or None

    def _token_counts(self, vocab: int, dev: torch.device) -> TokenCounts:
        if self._counts is None or self._counts.vocab_size != vocab:
            self._counts = TokenCounts(dev, vocab)
        return self._counts

    def _ban_until_min_tokens(self, x: torch.Tensor, seqs: list[Sequence], short: list[int],
                              masks: Any) -> None:
        """``-inf`` for EOS and stop ids of the rows ``short`` of their ``min_tokens``.

        A constrained row whose grammar is complete (only EOS possible) is exempt: the
        grammar's end wins over min_tokens.
        """
        if masks is not None and masks.stopped.any():
            done = set(masks.rows[masks.stopped].tolist())
            short = [i for i in short if i not in done]
        r_idx, t_idx = [], []
        vocab = x.shape[1]
        for i in short:
            ids = self.eos_token_ids + tuple(seqs[i].request.params.stop_token_ids or ())
            ids = tuple(t for t in ids if t < vocab)
            r_idx.extend([i] * len(ids))
            t_idx.extend(ids)
        if r_idx:
            dev = x.device
            x[to_device(r_idx, dev, np.int64), to_device(t_idx, dev, np.int64)] = float("-inf")

    def _draw(self, x: torch.Tensor, rows: list[Any], index: list[int],
              pos: np.ndarray) -> torch.Tensor:
        """Temperature, top-k, top-p, min-p, then inverse-CDF draws, for these rows."""
        dev = x.device
        vocab = x.shape[1]
        temps = np.array([r.temperature for r in rows], dtype=np.float32)
        x = x / to_device(temps, dev).unsqueeze(1)
        ks = np.array([r.top_k if r.top_k < vocab else 0 for r in rows], dtype=np.int64)
        if ks.any():
            kmax = int(ks.max())
            kth = x.topk(kmax, dim=-1).values
            k_t = to_device(np.maximum(ks, 1) - 1, dev).unsqueeze(1)
            thr = kth.gather(1, k_t)
            thr = torch.where(to_device(ks > 0, dev).unsqueeze(1), thr,
                              torch.full_like(thr, float("-inf")))
            x = x.masked_fill(x < thr, float("-inf"))  # ties at the k-th value stay (transformers)
        ps = np.array([r.top_p for r in rows], dtype=np.float32)
        p_rows = np.nonzero(ps < 1.0)[0]
        if len(p_rows):
            p_idx = to_device(p_rows, dev, np.int64)
            sub = x.index_select(0, p_idx)
            sorted_x, order = sub.sort(dim=-1, descending=True)
            probs = sorted_x.softmax(dim=-1)
            before = probs.cumsum(dim=-1) - probs  # mass of the better tokens
            p_t = to_device(ps[p_rows], dev).unsqueeze(1)
            sorted_x = sorted_x.masked_fill(before >= p_t, float("-inf"))  # keeps the best one
            x = x.index_copy(0, p_idx, torch.empty_like(sub).scatter_(1, order, sorted_x))
        probs = x.softmax(dim=-1)
        min_ps = np.array([r.min_p for r in rows], dtype=np.float32)
        if min_ps.any():
            m_t = to_device(min_ps, dev).unsqueeze(1)
            probs = probs.masked_fill(probs < probs.max(dim=-1, keepdim=True).values * m_t, 0.0)
        u = self._uniforms(rows, index, pos)
        cdf = probs.cumsum(dim=-1)
        # Scaled just below the row's total, u * total stays under the last CDF value even
        # after rounding, so the first CDF value above it belongs to a token with p > 0.
        total = cdf[:, -1:] * (1.0 - 2.0**-22)
        target = to_device(u, dev).unsqueeze(1) * total
        return torch.searchsorted(cdf, target, right=True).clamp_(max=vocab - 1).squeeze(1)

    def _uniforms(self, rows: list[Any], index: list[int], pos: np.ndarray) -> np.ndarray:
        seeded = np.fromiter((r.seeded for r in rows), dtype=bool, count=len(rows))
        u = np.empty(len(rows), dtype=np.float64)
        if seeded.any():
            seeds = np.array([r.seed for r in rows], dtype=np.uint64)
            u[seeded] = seeded_uniforms(seeds[seeded], np.asarray(index)[seeded], pos[seeded])
        if not seeded.all():
            u[~seeded] = torch.rand(int((~seeded).sum()), dtype=torch.float64).numpy()
        return u.astype(np.float32)
