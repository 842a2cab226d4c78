"""``LLM``: the offline, synchronous face of the engine (vLLM's names and behaviour)."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence
from typing import Any

from qworker.engine.config import EngineConfig
from qworker.engine.engine import Engine
from qworker.engine.outputs import RequestOutput
from qworker.engine.sampling_params import SamplingParams
from qworker.engine.stats import EngineStats
from qworker.errors import InvalidRequestError

logger = logging.getLogger(__name__)

Prompt = str | list[int]


class LLM:
    """Load a model once, then ``generate`` / ``chat`` over batches of prompts.

    Keyword arguments are ``EngineConfig`` fields (docs/configuration.md, "Engine").
    Not thread-safe: use ``Engine`` directly to drive generation from another thread.
    """

    def __init__(self, model: str, **kwargs: Any) -> None:
        unknown = set(kwargs) - set(EngineConfig.__dataclass_fields__)
        if unknown:
            raise TypeError(f"LLM got unknown arguments: {sorted(unknown)}")
        self.engine = Engine(EngineConfig(model=str(model), **kwargs))
        self._ids = itertools.count()

    @classmethod
    def from_engine(cls, engine: Engine) -> LLM:
        """An ``LLM`` over an ``Engine`` built elsewhere (one given a tensor-parallel group
        to share, say)."""
        llm = cls.__new__(cls)
        llm.engine = engine
        llm._ids = itertools.count()
        return llm

    def close(self) -> None:
        """Stop the engine's other tensor-parallel ranks (``Engine.close``)."""
        self.engine.close()

    @property
    def tokenizer(self) -> Any | None:
        """The model's tokenizer, or None."""
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs in the order of ``prompts``.

        ``prompts``: a string, a list of token ids, or a list of either. Every prompt is
        validated before any runs (ValueError naming the problem).
        """
        prompt_list = _as_prompt_list(prompts)
        params = _align_params(sampling_params, len(prompt_list))
        validated = [self.engine.validate_prompt(p, sp)
                     for p, sp in zip(prompt_list, params, strict=True)]
        return self._run(validated, params, use_tqdm)

    def chat(
        self,
        conversations: list[dict[str, Any]] | Sequence[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate replies to message lists through the tokenizer's chat template."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]  # type: ignore[list-item]
        ids = [self.engine.encode_chat(list(c)) for c in conversations]  # type: ignore[arg-type]
        params = _align_params(sampling_params, len(ids))
        validated = [self.engine.validate_prompt(p, sp) for p, sp in zip(ids, params, strict=True)]
        return self._run(validated, params, use_tqdm)

    def beam_search(self, prompts: Prompt | Sequence[Prompt], beam_width: int = 4,
                    max_tokens: int = 32, length_penalty: float = 1.0,
                    ignore_eos: bool = False) -> list[RequestOutput]:
        """Beam search over the paged engine (``qworker.engine.beam_search``), best beam first."""
        try:
            from qworker.engine.beam_search import beam_search
        except ImportError as exc:
            raise NotImplementedError("beam search is not available in this build") from exc
        return beam_search(self, prompts, beam_width=beam_width, max_tokens=max_tokens,
                           length_penalty=length_penalty, ignore_eos=ignore_eos)

    def stats(self) -> EngineStats:
        """The engine's counters and pool figures (``EngineStats``; ``stats["key"]`` works)."""
        return self.engine.stats()

    def _run(self, validated: list[tuple[str | None, list[int]]], params: list[SamplingParams],
             use_tqdm: bool) -> list[RequestOutput]:
        ids = [f"llm-{next(self._ids)}" for _ in validated]
        for rid, (text, tokens), sp in zip(ids, validated, params, strict=True):
            self.engine.add_validated(rid, text, tokens, sp)
        results: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(ids), desc="Processed prompts", dynamic_ncols=True)
        try:
            while len(results) < len(ids):
                for out in self.engine.step():
                    results[out.request_id] = out
                    if bar is not None:
                        bar.update(1)
                if not self.engine.has_unfinished() and len(results) < len(ids):
                    raise RuntimeError("engine went idle with requests unanswered")
        except BaseException:
            for rid in ids:
                if rid not in results:
                    self.engine.abort(rid)
            try:  # leave the engine empty for the next call if it still works
                while self.engine.has_unfinished():
                    self.engine.step()
            except Exception:
                logger.exception("could not drain the engine after an interrupted generate")
            raise
        finally:
            if bar is not None:
                bar.close()
        return [results[rid] for rid in ids]


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, list | tuple) and prompts and all(
        isinstance(t, int) and not isinstance(t, bool) for t in prompts
    ):
        return [list(prompts)]  # type: ignore[arg-type]
    if not isinstance(prompts, list | tuple):
        raise InvalidRequestError(f"prompts must be a string or a list, got {type(prompts)!r}")
    return [list(p) if isinstance(p, tuple) else p for p in prompts]  # type: ignore[misc]


def _align_params(
    sampling_params: SamplingParams | Sequence[SamplingParams] | None, n: int
) -> list[SamplingParams]:
    if sampling_params is None:
        return [SamplingParams()] * n
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * n
    params = list(sampling_params)
    if len(params) != n:
        raise InvalidRequestError(
            f"sampling_params has {len(params)} entries but there are {n} prompts"
        )
    return params
