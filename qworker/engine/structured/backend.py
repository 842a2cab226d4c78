"""The grammar engine behind structured outputs: llguidance, imported lazily.

llguidance was chosen by measurement on our workload (``docs/structured_outputs.md``,
``scripts/bench_grammar.py``): it compiles a schema in well under a millisecond,
lazily, within fuel limits (an expensive-to-compile schema cannot stall the worker),
fills a batch's token masks about as fast as xgrammar, and is one dependency-free
wheel. The engine imports without it; a structured request then gets a clear error.

``GrammarBackend.compile`` turns a ``StructuredOutputsParams`` into a compiled grammar
(a template matcher), once per distinct spec: results, errors included, are cached by
the spec's canonical key, and the wait is bounded by ``compile_timeout`` seconds.
``new_matcher`` copies the template for one sequence; ``fill`` computes the token
bitmasks of many matchers into one int32 array, in parallel, without the GIL.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import re
import threading
from collections import OrderedDict
from typing import Any

import torch

from qworker.engine.structured.params import StructuredOutputsParams
from qworker.errors import InvalidRequestError

logger = logging.getLogger(__name__)

#: Seconds a request waits for its grammar to compile before it is refused.
DEFAULT_COMPILE_TIMEOUT = 5.0
#: Distinct compiled specs kept (a batch usually repeats one schema thousands of times).
DEFAULT_CACHE_SIZE = 512
#: JSON is generated compact but readable: ``{"a": 1, "b": [2, 3]}``, no free whitespace
#: (a small model given free whitespace can emit newlines until max_tokens).
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_MAX_ERROR_CHARS = 300


class CompileFailure(Exception):
    """Why a spec cannot be compiled, worded to follow the field's name (cached)."""


def load_llguidance() -> Any:
    """The ``llguidance`` module, or ``InvalidRequestError`` saying how to get it."""
    try:
        import llguidance
        import llguidance.hf
    except ImportError as exc:
        raise InvalidRequestError(
            "structured outputs need the llguidance package, which is not installed here "
            f"(pip install 'llguidance>=1.0,<2'): {exc}"
        ) from None
    return llguidance


def words_per_mask(vocab_size: int) -> int:
    """int32 words of one token bitmask (one bit per token id, little-endian)."""
    return (vocab_size + 31) // 32


class GrammarBackend:
    """Compiles specs into grammars for one tokenizer and fills their token masks.

    ``tokenizer`` is the model's Hugging Face (fast) tokenizer; ``vocab_size`` the width
    of the logits; ``eos_token_ids`` the ids that end generation (allowed exactly when
    the grammar is complete). ``num_threads`` sizes llguidance's fill pool (None: its
    default; 0: no pool, masks are filled one by one on the calling thread). Thread-safe:
    ``compile`` runs on request threads, the rest on the engine thread.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: list[int],
                 compile_timeout: float = DEFAULT_COMPILE_TIMEOUT,
                 cache_size: int = DEFAULT_CACHE_SIZE, num_threads: int | None = None) -> None:
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.compile_timeout = compile_timeout
        self._hf_tokenizer = tokenizer
        self._cache_size = cache_size
        self._num_threads = num_threads
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self._pending: dict[tuple[str, str], concurrent.futures.Future[Any]] = {}
        self._llg: Any = None
        self._tokenizer: Any = None
        self._limits: Any = None
        self._executor: Any = None
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self.num_compiled = 0

    # ---- setup (lazy: the first structured request pays ~0.3 s once) ------------------

    def _ensure_ready(self) -> None:
        with self._lock:
            if self._tokenizer is not None:
                return
            llg = load_llguidance()
            if self._hf_tokenizer is None:
                raise InvalidRequestError(
                    "structured outputs need the model's tokenizer; this model has none"
                )
            try:
                tokenizer = llg.hf.from_tokenizer(
                    self._hf_tokenizer, n_vocab=self.vocab_size,
                    eos_token=self.eos_token_ids or None)
            except Exception as exc:  # a tokenizer llguidance cannot read: every request says so
                raise InvalidRequestError(
                    f"structured outputs cannot use this model's tokenizer: {exc}"
                ) from None
            self._llg = llg
            self._limits = llg.LLParserLimits(verbose_errors=False)
            if self._num_threads != 0:
                self._executor = llg.LLExecutor(num_threads=self._num_threads)
            self._pool = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="qworker-grammar-compile")
            self._tokenizer = tokenizer

    # ---- compile ---------------------------------------------------------------------

    def compile(self, spec: StructuredOutputsParams) -> Any:
        """The compiled grammar of ``spec`` (cached); ``InvalidRequestError`` naming the
        field (``spec.label``) and the problem when the spec is invalid, unsupported or
        slower to compile than the timeout."""
        self._ensure_ready()
        key = spec.key
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                if isinstance(hit, CompileFailure):
                    raise InvalidRequestError(f"{spec.label} {hit}")
                return hit
            future = self._pending.get(key)
            submitted = future is None
            if future is None:
                assert self._pool is not None
                future = self._pool.submit(self._build, key)
                self._pending[key] = future
        if submitted:  # outside the lock: a finished future runs the callback right here
            future.add_done_callback(lambda f, k=key: self._store(k, f))
        try:
            return future.result(timeout=self.compile_timeout)
        except concurrent.futures.TimeoutError:
            failure = CompileFailure(
                f"did not compile within {self.compile_timeout:g} s; simplify it")
            with self._lock:  # later requests with this spec fail at once, not after a wait
                self._put(key, failure)
            raise InvalidRequestError(f"{spec.label} {failure}") from None
        except CompileFailure as exc:
            raise InvalidRequestError(f"{spec.label} {exc}") from None

    def _store(self, key: tuple[str, str], future: concurrent.futures.Future[Any]) -> None:
        exc = future.exception()
        with self._lock:
            self._pending.pop(key, None)
            if key in self._cache:  # a timeout already recorded its failure
                return
            if exc is None:
                self._put(key, future.result())
            elif isinstance(exc, CompileFailure):
                self._put(key, exc)

    def _put(self, key: tuple[str, str], value: Any) -> None:
        self._cache[key] = value
        self._cache.move_to_end(key)
        while len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)

    def _build(self, key: tuple[str, str]) -> Any:
        kind, text = key
        llg = self._llg
        try:
            grammar = grammar_text(llg, kind, text)
            matcher = llg.LLMatcher(self._tokenizer, grammar, log_level=0, limits=self._limits)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as exc:  # ValueError, or a Rust panic (a BaseException)
            raise CompileFailure(f"is invalid: {_clean(exc)}") from None
        if matcher.is_error():
            raise CompileFailure(f"is invalid or unsupported: {_clean(matcher.get_error())}")
        self.num_compiled += 1
        return matcher

    # ---- per step --------------------------------------------------------------------

    def new_matcher(self, compiled: Any) -> Any:
        """A fresh matcher (start state) of a compiled grammar."""
        return compiled.deep_copy()

    def fill(self, pairs: list[tuple[Any, int]], masks: torch.Tensor) -> None:
        """Write each ``(matcher, row)``'s allowed-token bitmask into ``masks[row]``.

        ``masks`` is a contiguous CPU int32 ``[rows, words_per_mask(vocab)]`` tensor.
        """
        if not pairs:
            return
        if self._executor is None:  # num_threads=0: on the calling thread, no pool
            row_bytes = masks.shape[1] * 4
            base = masks.data_ptr()
            for matcher, row in pairs:
                matcher.unsafe_compute_mask_ptr(base + row * row_bytes, row_bytes)
            return
        self._executor.unsafe_compute_mask_ptr(
            pairs, masks.data_ptr(), masks.shape[1] * 4, masks.shape[0])


def grammar_text(llg: Any, kind: str, text: str) -> str:
    """llguidance grammar source for a spec key (``StructuredOutputsParams.key``)."""
    if kind == "json":
        schema = json.loads(text)
        if schema is True:
            schema = {}
        elif schema is False:
            raise ValueError("the schema false matches nothing")
        return llg.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    if kind == "json_object":
        return llg.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
    if kind == "regex":
        return llg.LLMatcher.grammar_from_regex(text)
    if kind == "choice":
        # Lark string literals take JSON escapes, so json.dumps quotes any choice safely.
        return llg.LLMatcher.grammar_from_lark(
            "start: " + " | ".join(json.dumps(c) for c in json.loads(text)))
    raise ValueError(f"unknown structured output kind {kind!r}")


def _clean(message: object) -> str:
    """One line, at most a few hundred characters, of a library's error message."""
    text = re.sub(r"\s+", " ", str(message)).strip()
    return text if len(text) <= _MAX_ERROR_CHARS else text[: _MAX_ERROR_CHARS - 3] + "..."
