"""The llguidance backend: compiled once per spec, errors naming the problem, a bounded
compile time, and masks that allow exactly what the grammar allows."""

from __future__ import annotations

import builtins
import json
import threading
import time
from typing import Any

import numpy as np
import pytest
import torch

from qworker import StructuredOutputsParams
from qworker.engine.structured.backend import GrammarBackend, load_llguidance, words_per_mask
from qworker.errors import InvalidRequestError

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
          "additionalProperties": False}


def _allowed(backend: GrammarBackend, matcher: Any) -> set[int]:
    mask = torch.zeros(1, words_per_mask(backend.vocab_size), dtype=torch.int32)
    backend.fill([(matcher, 0)], mask)
    bits = np.unpackbits(mask.numpy().view(np.uint8), bitorder="little")
    return set(np.nonzero(bits)[0].tolist())


def test_a_spec_compiles_once_however_often_it_is_asked_for(backend: GrammarBackend) -> None:
    first = backend.compile(StructuredOutputsParams(json=SCHEMA))
    for _ in range(50):  # a batch repeats its schema: same object, same text, any key order
        assert backend.compile(StructuredOutputsParams(json=json.dumps(SCHEMA))) is first
    assert backend.num_compiled == 1
    backend.compile(StructuredOutputsParams(regex="[ab]+"))
    assert backend.num_compiled == 2


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"json": {"type": "foo"}},
         "structured_outputs.json is invalid or unsupported: Invalid type: foo"),
        ({"json": {"type": "string", "pattern": "(["}},
         "structured_outputs.json is invalid or unsupported: regex parse error"),
        ({"json": {"not": {"type": "string"}}},
         'structured_outputs.json is invalid or unsupported: Unimplemented keys: ["not"]'),
        ({"json": {"type": "array", "minItems": 5, "maxItems": 2}},
         "structured_outputs.json is invalid or unsupported: Unsatisfiable schema: minItems (5) is "
         "greater than maxItems (2)"),
        ({"json": {"$ref": "#/$defs/missing"}}, "structured_outputs.json is invalid or unsupp"),
        ({"json": False}, "structured_outputs.json is invalid: the schema false matches nothing"),
        ({"regex": "a{5,2}"}, "structured_outputs.regex is invalid or unsupported"),
    ],
)
def test_invalid_or_unsupported_specs_name_the_problem(backend: GrammarBackend, spec: dict,
                                                       message: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        backend.compile(StructuredOutputsParams(**spec))
    assert str(info.value).startswith(message), str(info.value)
    assert "\n" not in str(info.value) and len(str(info.value)) <= 400
    again = StructuredOutputsParams(**spec)
    again.where = "body.response_format.json_schema.schema"
    with pytest.raises(InvalidRequestError) as info:  # cached: the repeat fails the same way
        backend.compile(again)
    assert str(info.value).startswith(again.where + " is invalid")
    assert backend.num_compiled == 0


def test_a_slow_compile_is_refused_after_the_timeout_and_repeats_fail_at_once(
    backend: GrammarBackend, monkeypatch: pytest.MonkeyPatch,
) -> None:
    release = threading.Event()
    real = backend._build

    def slow(key: tuple[str, str]) -> Any:
        if key[0] == "regex":
            release.wait(10)
        return real(key)

    monkeypatch.setattr(backend, "_build", slow)
    backend.compile_timeout = 0.2
    spec = StructuredOutputsParams(regex="x+")
    start = time.monotonic()
    slow_message = r"structured_outputs\.regex did not compile within 0\.2 s"
    with pytest.raises(InvalidRequestError, match=slow_message):
        backend.compile(spec)
    with pytest.raises(InvalidRequestError, match=slow_message):
        backend.compile(spec)
    assert time.monotonic() - start < 2.0
    release.set()
    # the compile thread is free again for other specs
    backend.compile_timeout = 5.0
    assert backend.compile(StructuredOutputsParams(json=SCHEMA)) is not None


def test_choice_and_regex_masks_allow_exactly_the_grammar(backend: GrammarBackend,
                                                          smollm2_tokenizer: Any) -> None:
    choices = ['yes', 'no "way"', "a|b", "x\\y", "ünï"]
    grammar = backend.compile(StructuredOutputsParams(choice=choices))
    for choice in choices:
        m = backend.new_matcher(grammar)
        assert m.consume_tokens(smollm2_tokenizer.encode(choice, add_special_tokens=False))
        assert m.is_stopped() and _allowed(backend, m) == {2}  # only EOS after a full choice
    m = backend.new_matcher(grammar)
    assert not m.consume_tokens(smollm2_tokenizer.encode("maybe", add_special_tokens=False))
    digits = backend.new_matcher(backend.compile(StructuredOutputsParams(regex=r"[0-9]{3}")))
    allowed = _allowed(backend, digits)
    for tok in allowed:
        assert smollm2_tokenizer.decode([tok]).isdigit()
    assert smollm2_tokenizer.encode("7", add_special_tokens=False)[0] in allowed


def test_without_llguidance_a_structured_request_gets_a_clear_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real_import = builtins.__import__

    def no_llguidance(name: str, *args: Any, **kwargs: Any) -> Any:
        if name.startswith("llguidance"):
            raise ImportError("No module named 'llguidance'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_llguidance)
    with pytest.raises(InvalidRequestError, match="structured outputs need the llguidance"):
        load_llguidance()
    with pytest.raises(InvalidRequestError, match="structured outputs need the llguidance"):
        GrammarBackend(None, 100, [2]).compile(StructuredOutputsParams(regex="a"))


def test_fill_without_a_pool_writes_the_same_masks(backend: GrammarBackend,
                                                   smollm2_tokenizer: Any) -> None:
    serial = GrammarBackend(smollm2_tokenizer, 49152, [2], num_threads=0)
    spec = StructuredOutputsParams(json=SCHEMA)
    prefix = smollm2_tokenizer.encode('{"n": 1', add_special_tokens=False)
    masks = []
    for b in (backend, serial):
        grammar = b.compile(spec)
        fresh, moved = b.new_matcher(grammar), b.new_matcher(grammar)
        assert moved.consume_tokens(prefix)
        out = torch.zeros(3, words_per_mask(49152), dtype=torch.int32)
        b.fill([(moved, 2), (fresh, 0)], out)
        masks.append(out)
    assert torch.equal(masks[0], masks[1]) and not masks[0][1].any()
    assert not torch.equal(masks[0][0], masks[0][2])
