"""Beam search over the paged engine, with beams sharing their KV blocks.

Each request's prompt is prefilled once (chunked under ``max_num_batched_tokens``);
then every step decodes one token for every live beam of every request in one
forward. Candidates are ranked as in ``transformers``' ``_beam_search`` (5.x): the
top ``max(2, 1 + n_eos) * beam_width`` (token, beam) pairs by cumulative
log-probability; those among the first ``beam_width`` that end (EOS or the length
limit) enter a per-request set of ``beam_width`` hypotheses scored
``sum_logprobs / generated_len ** length_penalty``; the best ``beam_width`` that do
not end go on. A request stops when its hypotheses cannot improve any more
(transformers' early-stopping heuristic, ``early_stopping=False`` by default), when
``early_stopping=True`` and its hypothesis set is full, or at the length limit.

KV sharing: a kept beam continues in its parent's sequence; a parent kept more than
once is forked (``KVCacheManager.fork``: its blocks' reference counts go up), and
the first write into a shared, partially filled block copies it (the manager's
pending copies, run through ``ModelRunner.copy_blocks`` before the forward). A
dropped beam's blocks are freed. Full prompt blocks are never written again, so all
beams of a request hold one copy of them.

The engine must be idle: beam search drives its KV manager and model runner
directly, bypassing the scheduler. Requests are admitted while the worst case of
every admitted request fits the pool, so a pool too small for all of them at once
serves them in turns, never by preemption.
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Any

import torch

from qworker.engine.detokenizer import full_output_text, start_offsets
from qworker.engine.model_runner import StepInput
from qworker.engine.output_processor import finished_output
from qworker.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from qworker.engine.sampling_params import SamplingParams
from qworker.engine.sequence import Request, Sequence, SequenceStatus
from qworker.errors import ContextLengthExceededError, EngineError, InvalidRequestError

logger = logging.getLogger(__name__)

Prompt = str | list[int]

_request_ids = itertools.count()


@dataclass(slots=True)
class Hypothesis:
    """A finished beam: its generated tokens, raw log-probability sum and ranking score."""

    score: float
    token_ids: list[int]
    cumulative_logprob: float
    finish_reason: str


@dataclass(slots=True, eq=False)
class _BeamRequest:
    """One prompt under beam search: its live beams (best first) and finished hypotheses."""

    request: Request
    max_new: int
    reserve: int
    prefill: Sequence | None = None
    beams: list[Sequence] = field(default_factory=list)
    scores: torch.Tensor | None = None
    best_score: torch.Tensor | None = None
    finished: list[Hypothesis] = field(default_factory=list)
    num_generated: int = 0
    done: bool = False


class BeamSearch:
    """Runs beam search for a batch of prompts on an idle ``Engine``.

    Build one per call; after ``run`` the figures ``peak_kv_blocks_used`` (distinct
    blocks held at once) and ``peak_kv_blocks_unshared`` (what the same beams would
    hold without sharing) and ``num_forwards`` describe the run.
    """

    def __init__(
        self,
        engine: Any,
        beam_width: int = 4,
        max_tokens: int = 32,
        length_penalty: float = 1.0,
        ignore_eos: bool = False,
        early_stopping: bool | str = False,
    ) -> None:
        _check_args(beam_width, max_tokens, length_penalty, ignore_eos, early_stopping)
        self.engine = engine
        self.kv = engine.kv
        self.runner = engine.runner
        self.beam_width = beam_width
        self.max_tokens = max_tokens
        self.length_penalty = float(length_penalty)
        self.early_stopping = early_stopping
        self.eos_ids = frozenset() if ignore_eos else frozenset(engine.spec.eos_token_ids)
        # transformers keeps enough candidates that beam_width of them survive even if
        # every live beam's best continuations are EOS tokens.
        self.num_candidates = max(2, 1 + len(self.eos_ids)) * beam_width
        self.params = SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                     ignore_eos=ignore_eos)
        self.budget = max(1, engine.config.max_num_batched_tokens)
        self.max_beams = max(engine.config.max_num_seqs, beam_width)
        self.peak_kv_blocks_used = 0
        self.peak_kv_blocks_unshared = 0
        self.num_forwards = 0
        self._seq_ids = itertools.count(-1, -1)  # negative: never clashes with the engine's

    # ---- entry ---------------------------------------------------------------------

    def run(self, prompts: Prompt | Seq[Prompt]) -> list[RequestOutput]:
        """Beam-search every prompt; one RequestOutput each, in order, beams best first.

        Validates every prompt before running any (``InvalidRequestError`` /
        ``ContextLengthExceededError``); raises ``EngineError`` if the engine is busy.
        """
        prompt_list = _as_prompt_list(prompts)
        if not prompt_list:
            return []
        validated = [self.engine.validate_prompt(p, self.params) for p in prompt_list]
        if self.engine.has_unfinished():
            raise EngineError("beam_search needs an idle engine: finish or abort the engine's "
                              "requests first")
        capacity = self.kv.num_free_blocks
        reqs = [self._make_request(text, ids, i, capacity)
                for i, (text, ids) in enumerate(validated)]
        try:
            self._loop(reqs)
        finally:
            self._release(reqs)
        self._refresh_stats()
        return [self._output(r) for r in reqs]

    def _make_request(self, text: str | None, ids: list[int], index: int,
                      capacity: int) -> _BeamRequest:
        max_new = min(self.max_tokens, self.engine.max_model_len - len(ids))
        bs = self.kv.block_size
        shared = len(ids) // bs  # full prompt blocks: never written again, held once
        # The last generated token is never fed back, so keys/values stop one short.
        per_beam = self.kv.blocks_for(len(ids) + max_new - 1) - shared
        reserve = shared + self.beam_width * per_beam
        if reserve > capacity:
            raise ContextLengthExceededError(
                f"beam search of prompt {index} ({len(ids)} tokens) may need {reserve} KV "
                f"blocks for beam_width={self.beam_width} beams of max_tokens={max_new}, but "
                f"the pool has {capacity} free; lower beam_width or max_tokens, or give the "
                "pool more memory"
            )
        request = Request(
            request_id=f"beam-{next(_request_ids)}",
            prompt=text,
            prompt_token_ids=ids,
            params=self.params,
            max_tokens=max_new,
            metrics=RequestMetrics(arrival_time=time.time()),
        )
        return _BeamRequest(request, max_new, reserve)

    # ---- main loop -----------------------------------------------------------------

    def _loop(self, reqs: list[_BeamRequest]) -> None:
        pending = list(reqs)
        pending.reverse()
        active: list[_BeamRequest] = []
        capacity = self.kv.num_free_blocks
        reserved = 0
        while pending or active:
            admitted: list[_BeamRequest] = []
            num_beams = len(active) * self.beam_width
            while pending and reserved + pending[-1].reserve <= capacity and (
                num_beams + self.beam_width <= self.max_beams or not (active or admitted)
            ):
                r = pending.pop()
                reserved += r.reserve
                num_beams += self.beam_width
                admitted.append(r)
            if not active and not admitted:
                raise EngineError("beam search cannot admit a request into an empty pool")
            first_logits = self._prefill(admitted) if admitted else {}
            running = [r for r in active if r.beams]
            decode_logits = self._decode(running) if running else None
            row = 0
            for r in running:
                n = len(r.beams)
                self._select(r, decode_logits[row : row + n])  # type: ignore[index]
                row += n
            for r in admitted:
                self._select(r, first_logits[id(r)])
            active += admitted
            for r in [r for r in active if r.done]:
                active.remove(r)
                reserved -= r.reserve
                self._free_beams(r)
                r.request.metrics.finished_time = time.time()

    def _new_seq(self, r: _BeamRequest, token_ids: list[int]) -> Sequence:
        num_prompt = len(r.request.prompt_token_ids)
        seq = Sequence(next(self._seq_ids), r.request, 0, token_ids, num_prompt)
        seq.status = SequenceStatus.RUNNING
        return seq

    def _allocate(self, seq: Sequence, num_new: int, computed: list[Any] | None = None) -> None:
        if not self.kv.allocate_slots(seq, num_new, computed):
            # Cannot happen while admission keeps within the reserve; never corrupt state.
            raise EngineError(f"KV pool exhausted during beam search ({self.kv.num_free_blocks} "
                              "blocks free)")

    def _prefill(self, admitted: list[_BeamRequest]) -> dict[int, torch.Tensor]:
        """Compute every admitted prompt (chunked); return each request's last-token logits."""
        for r in admitted:
            seq = self._new_seq(r, list(r.request.prompt_token_ids))
            r.prefill = seq
            computed = self.kv.get_computed_blocks(seq)
            self._allocate(seq, 0, computed)
            self.kv.record_prefix_query(seq.num_tokens)
            seq.num_computed_tokens += len(computed) * self.kv.block_size
            r.request.num_cached_tokens = seq.num_computed_tokens
            r.request.metrics.first_scheduled_time = time.time()
            self.engine.prompt_tokens += seq.num_prompt_tokens
        out: dict[int, torch.Tensor] = {}
        todo = list(admitted)
        while todo:
            budget = self.budget
            batch: list[tuple[_BeamRequest, int]] = []
            for r in todo:
                if budget <= 0:
                    break
                seq = r.prefill
                n = min(seq.num_uncomputed_tokens, budget)  # type: ignore[union-attr]
                self._allocate(seq, n)  # type: ignore[arg-type]
                batch.append((r, n))
                budget -= n
            batch.sort(key=lambda item: item[1] != 1)  # the runner wants decodes first
            seqs = [r.prefill for r, _ in batch]
            logits = self._forward(seqs, [n for _, n in batch])  # type: ignore[arg-type]
            row = 0
            for (r, n), seq in zip(batch, seqs, strict=True):
                seq.num_computed_tokens += n  # type: ignore[union-attr]
                self.kv.cache_full_blocks(seq)  # type: ignore[arg-type]
                if seq.num_uncomputed_tokens == 0:  # type: ignore[union-attr]
                    out[id(r)] = logits[row : row + 1]  # type: ignore[index]
                    row += 1
                    r.beams = [seq]  # type: ignore[list-item]
                    r.prefill = None
                    todo.remove(r)
        return out

    def _decode(self, running: list[_BeamRequest]) -> torch.Tensor:
        """One forward over every live beam of ``running``; logits rows in beam order."""
        seqs = [s for r in running for s in r.beams]
        for seq in seqs:
            self._allocate(seq, 1)
        logits = self._forward(seqs, [1] * len(seqs))
        for seq in seqs:
            seq.num_computed_tokens += 1
            self.kv.cache_full_blocks(seq)
        return logits  # type: ignore[return-value]

    def _forward(self, seqs: list[Sequence], num_new: list[int]) -> torch.Tensor | None:
        self._track_usage()
        self.runner.copy_blocks(self.kv.take_pending_copies())
        step = StepInput(
            token_chunks=[s.token_ids[s.num_computed_tokens : s.num_computed_tokens + n]
                          for s, n in zip(seqs, num_new, strict=True)],
            num_computed=[s.num_computed_tokens for s in seqs],
            block_tables=[self.kv.block_ids(s.seq_id) for s in seqs],
            sample=[s.num_computed_tokens + n == s.num_tokens
                    for s, n in zip(seqs, num_new, strict=True)],
        )
        self.num_forwards += 1
        return self.runner.execute(step)

    # ---- selection (transformers' rules) -------------------------------------------

    def _select(self, r: _BeamRequest, logits: torch.Tensor) -> None:
        """Rank the candidates of one request's step and move its beams forward."""
        bw = self.beam_width
        logits = logits.float()
        vocab = logits.shape[-1]
        log_probs = torch.log_softmax(logits, dim=-1)
        if r.scores is not None:
            log_probs = log_probs + r.scores[:, None]
        flat = log_probs.reshape(-1)
        k = min(self.num_candidates, flat.numel())
        top_vals, top_idx = torch.topk(flat, k)
        # One device-to-host copy each; the ranking arithmetic below runs in fp32 on the
        # host exactly as transformers does it on a CPU.
        vals_host, idx_host = top_vals.cpu(), top_idx.cpu()
        gen_len = r.num_generated + 1
        penalized = (vals_host / (gen_len**self.length_penalty)).tolist()
        vals = vals_host.tolist()
        parents = (idx_host // vocab).tolist()
        tokens = (idx_host % vocab).tolist()
        at_limit = gen_len >= r.max_new
        self.engine.generation_tokens += len(r.beams)
        keep: list[int] = []
        for j in range(k):
            is_eos = tokens[j] in self.eos_ids
            if is_eos or at_limit:
                if j < bw:  # only the top beam_width candidates may become hypotheses
                    beam = r.beams[parents[j]]
                    r.finished.append(Hypothesis(
                        score=penalized[j],
                        token_ids=[*beam.output_token_ids, tokens[j]],
                        cumulative_logprob=vals[j],
                        finish_reason="stop" if is_eos else "length",
                    ))
            elif len(keep) < bw:
                keep.append(j)
        r.finished.sort(key=lambda h: h.score, reverse=True)
        del r.finished[bw:]
        if r.request.metrics.first_token_time is None:
            r.request.metrics.first_token_time = time.time()
        r.num_generated = gen_len
        self._advance(r, [(parents[j], tokens[j]) for j in keep], top_vals[keep])
        r.best_score = vals_host[keep[:1]]
        r.done = not r.beams or self._cannot_improve(r)

    def _cannot_improve(self, r: _BeamRequest) -> bool:
        """transformers' stop rule for one request, after its hypotheses were updated."""
        if len(r.finished) < self.beam_width:
            return False
        if self.early_stopping is True:
            return True
        if self.early_stopping == "never" and self.length_penalty > 0.0:
            best_len = r.max_new
        else:
            best_len = r.num_generated
        best_running = (r.best_score / (best_len**self.length_penalty)).item()  # type: ignore[operator]
        return not best_running > r.finished[-1].score

    def _advance(self, r: _BeamRequest, kept: list[tuple[int, int]],
                 scores: torch.Tensor) -> None:
        """Replace the request's beams by ``kept`` (parent index, token), sharing blocks."""
        children: dict[int, int] = {}
        for parent, _ in kept:
            children[parent] = children.get(parent, 0) + 1
        for i, seq in enumerate(r.beams):  # free dropped beams first: their blocks return
            if i not in children:
                self.kv.free(seq.seq_id)
        reused: set[int] = set()
        beams: list[Sequence] = []
        for parent, _ in kept:
            src = r.beams[parent]
            if parent in reused:
                seq = self._fork(r, src)
            else:
                reused.add(parent)
                seq = src
            beams.append(seq)
        # Append after every fork, so forks copy the parents' tokens without the new ones.
        for seq, (_, token) in zip(beams, kept, strict=True):
            seq.token_ids.append(token)
        r.beams = beams
        r.scores = scores.clone()

    def _fork(self, r: _BeamRequest, parent: Sequence) -> Sequence:
        child = self._new_seq(r, list(parent.token_ids))
        child.num_computed_tokens = parent.num_computed_tokens
        child.block_hashes = list(parent.block_hashes)
        self.kv.fork(parent.seq_id, child.seq_id)
        return child

    # ---- bookkeeping ---------------------------------------------------------------

    def _track_usage(self) -> None:
        self.peak_kv_blocks_used = max(self.peak_kv_blocks_used, self.kv.pool.num_used_blocks)
        unshared = sum(len(ids) for ids in self.kv.table_ids.values())
        self.peak_kv_blocks_unshared = max(self.peak_kv_blocks_unshared, unshared)

    def _free_beams(self, r: _BeamRequest) -> None:
        for seq in r.beams:
            self.kv.free(seq.seq_id)
        r.beams = []
        if r.prefill is not None:
            self.kv.free(r.prefill.seq_id)
            r.prefill = None

    def _release(self, reqs: list[_BeamRequest]) -> None:
        for r in reqs:
            self._free_beams(r)
        # Copies queued for blocks just freed must never run against reused blocks.
        self.kv.take_pending_copies()

    def _refresh_stats(self) -> None:
        refresh = getattr(self.engine, "refresh_stats", None)
        if refresh is not None:
            refresh()
        elif not self.engine.has_unfinished():
            self.engine.step()  # an idle step only re-takes the stats snapshot

    def _output(self, r: _BeamRequest) -> RequestOutput:
        request = r.request
        outputs = []
        for i, hyp in enumerate(r.finished):
            outputs.append(CompletionOutput(
                index=i,
                text=self._text(request, hyp),
                token_ids=hyp.token_ids,
                cumulative_logprob=hyp.cumulative_logprob,
                finish_reason=hyp.finish_reason,
            ))
        return finished_output(request, outputs)

    def _text(self, request: Request, hyp: Hypothesis) -> str:
        tokenizer = self.engine.tokenizer
        if tokenizer is None or not hyp.token_ids:
            return ""
        seq = Sequence(0, request, 0, request.prompt_token_ids + hyp.token_ids,
                       len(request.prompt_token_ids))
        seq.prefix_offset, seq.read_offset = start_offsets(seq.num_prompt_tokens)
        return full_output_text(tokenizer, seq, exclude_last=hyp.finish_reason == "stop")


def beam_search(
    llm: Any,
    prompts: Prompt | Seq[Prompt],
    beam_width: int = 4,
    max_tokens: int = 32,
    length_penalty: float = 1.0,
    ignore_eos: bool = False,
    early_stopping: bool | str = False,
) -> list[RequestOutput]:
    """Beam search for every prompt on ``llm`` (an ``LLM`` or an ``Engine``), in order.

    Each RequestOutput holds ``beam_width`` CompletionOutputs, best first by
    ``cumulative_logprob / len(token_ids) ** length_penalty``; ``cumulative_logprob`` is
    the raw sum, ``token_ids`` include a final EOS (``text`` does not). The engine must
    be idle (``EngineError`` otherwise). Bad arguments or prompts raise
    ``InvalidRequestError`` naming the field; ``early_stopping`` is transformers'
    (False, True or "never").
    """
    engine = getattr(llm, "engine", llm)
    search = BeamSearch(engine, beam_width, max_tokens, length_penalty, ignore_eos,
                        early_stopping)
    return search.run(prompts)


def _check_args(beam_width: Any, max_tokens: Any, length_penalty: Any, ignore_eos: Any,
                early_stopping: Any) -> None:
    if not isinstance(beam_width, int) or isinstance(beam_width, bool) or beam_width < 1:
        raise InvalidRequestError(f"beam_width must be an integer >= 1, got {beam_width!r}")
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise InvalidRequestError(f"max_tokens must be an integer >= 1, got {max_tokens!r}")
    if (not isinstance(length_penalty, int | float) or isinstance(length_penalty, bool)
            or not math.isfinite(length_penalty)):
        raise InvalidRequestError(
            f"length_penalty must be a finite number, got {length_penalty!r}"
        )
    if not isinstance(ignore_eos, bool):
        raise InvalidRequestError(f"ignore_eos must be a bool, got {ignore_eos!r}")
    if not (isinstance(early_stopping, bool) or early_stopping == "never"):
        raise InvalidRequestError(
            f"early_stopping must be False, True or 'never', got {early_stopping!r}"
        )


def _as_prompt_list(prompts: Prompt | Seq[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    if not isinstance(prompts, list | tuple):
        raise InvalidRequestError(
            f"prompts must be a string or a list, got {type(prompts).__name__}"
        )
    if prompts and all(isinstance(t, int) and not isinstance(t, bool) for t in prompts):
        return [list(prompts)]  # type: ignore[arg-type]
    return [list(p) if isinstance(p, tuple) else p for p in prompts]  # type: ignore[misc]
