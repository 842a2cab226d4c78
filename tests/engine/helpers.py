"""Model-free helpers for engine unit tests: requests and sequences without an engine."""

from __future__ import annotations

from qworker.engine.outputs import RequestMetrics
from qworker.engine.sampling_params import SamplingParams
from qworker.engine.sequence import Request, Sequence

_next_id = [0]


def make_seq(tokens: list[int], params: SamplingParams | None = None, index: int = 0,
             request: Request | None = None) -> Sequence:
    """A fresh WAITING sequence (with its own request unless one is given)."""
    if request is None:
        request = Request(
            request_id=f"r{_next_id[0]}",
            prompt=None,
            prompt_token_ids=list(tokens),
            params=params or SamplingParams(),
            max_tokens=16,
            metrics=RequestMetrics(arrival_time=0.0),
        )
    seq = Sequence(_next_id[0], request, index, list(tokens), len(request.prompt_token_ids))
    _next_id[0] += 1
    request.seqs.append(seq)
    return seq
