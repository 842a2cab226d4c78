"""After sampling: append each new token, decide whether its sequence stops, and build
the ``RequestOutput`` of a finished request.

Stop checks in order: a ``stop_token_ids`` token, EOS (unless ``ignore_eos``; with
structured outputs EOS comes only when the grammar is complete and always stops), a stop
string in the incrementally decoded text (cut from the text; ``finish_reason``
"stop"), ``max_tokens``, and ``max_model_len`` (both "length").
"""

from __future__ import annotations

from typing import Any

from qworker.engine.detokenizer import append_new_text, find_stop, full_output_text
from qworker.engine.outputs import CompletionOutput, RequestOutput
from qworker.engine.sequence import Request, Sequence, SequenceStatus


def finished_output(request: Request, outputs: list[CompletionOutput]) -> RequestOutput:
    """The final ``RequestOutput`` of ``request`` with ``outputs`` (given in index order)."""
    return RequestOutput(
        request_id=request.request_id,
        prompt=request.prompt,
        prompt_token_ids=request.prompt_token_ids,
        outputs=outputs,
        finished=True,
        metrics=request.metrics,
        num_cached_tokens=request.num_cached_tokens,
    )


class OutputProcessor:
    """Stateless apart from its settings; the engine thread calls it."""

    def __init__(self, tokenizer: Any | None, eos_token_ids: list[int], max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = max_model_len

    def append_token(
        self,
        seq: Sequence,
        token: int,
        logprob: float | None,
        top_logprobs: dict[int, float] | None,
    ) -> SequenceStatus | None:
        """Add ``token`` to ``seq``; return the FINISHED_* status it reached, or None."""
        seq.token_ids.append(token)
        params = seq.request.params
        if params.logprobs is not None and logprob is not None:
            seq.cumulative_logprob += logprob
            if seq.logprobs is None:
                seq.logprobs = []
            seq.logprobs.append(top_logprobs or {})
        if params.stop_token_ids and token in params.stop_token_ids:
            seq.stop_reason = token
            return SequenceStatus.FINISHED_STOPPED
        if token in self.eos_token_ids and (
            not params.ignore_eos or params.structured_outputs is not None
        ):  # a constrained row draws EOS only once its grammar is complete
            return SequenceStatus.FINISHED_STOPPED
        if params.stop_strings and self.tokenizer is not None:
            new = append_new_text(self.tokenizer, seq)
            if new:
                hit = find_stop(seq.text, len(new), params.stop_strings)
                if hit is not None:
                    seq.text = seq.text[: hit[0]]
                    seq.stop_reason = hit[1]
                    return SequenceStatus.FINISHED_STOPPED
        if seq.num_output_tokens >= seq.request.max_tokens or seq.num_tokens >= self.max_model_len:
            return SequenceStatus.FINISHED_LENGTH
        return None

    def make_output(self, request: Request) -> RequestOutput:
        """The ``RequestOutput`` of a finished (or aborted) request, completions by index."""
        outputs = []
        for seq in sorted(request.seqs, key=lambda s: s.index):
            outputs.append(
                CompletionOutput(
                    index=seq.index,
                    text=self._text(seq),
                    token_ids=seq.output_token_ids,
                    cumulative_logprob=(
                        seq.cumulative_logprob if request.params.logprobs is not None else None
                    ),
                    logprobs=seq.logprobs,
                    finish_reason=seq.status.finish_reason,
                    stop_reason=seq.stop_reason,
                )
            )
        return finished_output(request, outputs)

    def _text(self, seq: Sequence) -> str:
        if self.tokenizer is None or seq.num_output_tokens == 0:
            return ""
        # A stop token or EOS ends the sequence without appearing in its text.
        by_token = seq.status is SequenceStatus.FINISHED_STOPPED and not isinstance(
            seq.stop_reason, str
        )
        if seq.request.params.stop_strings:
            if seq.status is not SequenceStatus.FINISHED_STOPPED:
                append_new_text(self.tokenizer, seq)  # flush a held-back partial character
            return seq.text
        return full_output_text(self.tokenizer, seq, exclude_last=by_token)
