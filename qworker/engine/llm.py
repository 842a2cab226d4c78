"""``LLM``: the offline, synchronous face of the engine (vLLM's names and behaviour)."""

from __future__ import annotations

import contextlib
import itertools
import logging
from collections.abc import Sequence
from typing import Any

from qworker.engine import open_engine
from qworker.engine.config import EngineConfig
from qworker.engine.embedding_engine import EmbeddingEngine
from qworker.engine.engine import Engine
from qworker.engine.outputs import EmbeddingOutput, RequestOutput
from qworker.engine.sampling_params import SamplingParams
from qworker.engine.stats import EngineStats
from qworker.errors import InvalidRequestError

logger = logging.getLogger(__name__)

Prompt = str | list[int]


class LLM:
    """Load a model once, then ``generate`` / ``chat`` over batches of prompts, or
    ``embed`` inputs when the model serves task "embed".

    Keyword arguments are ``EngineConfig`` fields (docs/configuration.md, "Engine");
    ``task`` picks the engine (``open_engine``). Not thread-safe: use ``Engine`` /
    ``EmbeddingEngine`` directly to drive them from another thread.
    """

    engine: Any  # Engine | EmbeddingEngine

    def __init__(self, model: str, **kwargs: Any) -> None:
        unknown = set(kwargs) - set(EngineConfig.__dataclass_fields__)
        if unknown:
            raise TypeError(f"LLM got unknown arguments: {sorted(unknown)}")
        self.engine = open_engine(EngineConfig(model=str(model), **kwargs))
        self._ids = itertools.count()

    @classmethod
    def from_engine(cls, engine: Engine | EmbeddingEngine) -> LLM:
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
        self._require("generate", "generate")
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
        self._require("generate", "chat")
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
        self._require("generate", "beam_search")
        try:
            from qworker.engine.beam_search import beam_search
        except ImportError as exc:
            raise NotImplementedError("beam search is not available in this build") from exc
        return beam_search(self, prompts, beam_width=beam_width, max_tokens=max_tokens,
                           length_penalty=length_penalty, ignore_eos=ignore_eos)

    def embed(self, inputs: Prompt | Sequence[Prompt], dimensions: int | None = None,
              use_tqdm: bool = True) -> list[EmbeddingOutput]:
        """One embedding per input, in the order of ``inputs`` (task "embed").

        ``inputs``: a string, a list of token ids, or a list of either. ``dimensions``
        keeps the first N components, scaled back to unit length.
        Every input is validated before any runs (ValueError naming the problem). Inputs
        go to the engine shortest first, so each packed step holds inputs of similar
        length (less padding inside attention; docs/embeddings.md).
        """
        self._require("embed", "embed")
        engine: EmbeddingEngine = self.engine
        items = _as_prompt_list(inputs)
        engine.check_dimensions(dimensions)
        ids = [engine.validate_embedding_input(item) for item in items]
        order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
        names = {f"emb-{next(self._ids)}": i for i in order}
        for rid, i in names.items():
            engine.add_embedding(rid, [ids[i]], dimensions)
        vectors: list[list[float] | None] = [None] * len(ids)
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(ids), desc="Embedded inputs", dynamic_ncols=True)
        try:
            while engine.has_unfinished():
                for out in engine.step():
                    vectors[names[out.request_id]] = (out.embeddings or [None])[0]
                    if bar is not None:
                        bar.update(1)
        except BaseException:
            for rid in names:
                engine.abort(rid)
            with contextlib.suppress(Exception):  # leave the engine empty for the next call
                while engine.has_unfinished():
                    engine.step()
            raise
        finally:
            if bar is not None:
                bar.close()
        missing = [i for i, v in enumerate(vectors) if v is None]
        if missing:
            raise RuntimeError(f"the engine returned no embedding for inputs {missing[:5]}")
        return [EmbeddingOutput(i, v, len(ids[i]))  # type: ignore[arg-type]
                for i, v in enumerate(vectors)]

    def _require(self, task: str, call: str) -> None:
        """ValueError naming the task when ``call`` does not fit the engine's task."""
        have = getattr(self.engine, "task", "generate")
        if have != task:
            raise ValueError(f"LLM.{call} needs task '{task}', but this model was loaded "
                             f"with task '{have}'")

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
