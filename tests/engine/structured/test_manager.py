"""GrammarManager: each sequence's matcher follows the tokens it keeps (appended,
taken back, dropped and replayed), fills run ahead on a thread, siblings get theirs."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest

from qworker import SamplingParams, StructuredOutputsParams
from qworker.engine.structured.manager import GrammarManager
from tests.engine.helpers import make_seq

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"},
                                           "tags": {"type": "array", "items": {"enum": ["x", "y"]},
                                                    "maxItems": 2}},
          "required": ["name", "tags"], "additionalProperties": False}
ANSWER = {"name": "Bo", "tags": ["x", "y"]}


def _seq(tokenizer: Any, prompt: list[int] | None = None) -> Any:
    params = SamplingParams(structured_outputs=StructuredOutputsParams(json=SCHEMA))
    return make_seq(prompt or [1, 2, 3], params)


def _bits(masks: Any, j: int) -> np.ndarray:
    words = masks.words[masks.index[j]].numpy()
    return np.unpackbits(words.view(np.uint8), bitorder="little")


def _fresh_bits(backend: Any, tokens: list[int]) -> np.ndarray:
    """The mask of a brand-new matcher that consumed ``tokens``."""
    import torch

    m = backend.new_matcher(backend.compile(StructuredOutputsParams(json=SCHEMA)))
    assert m.consume_tokens(tokens)
    mask = torch.zeros(1, (backend.vocab_size + 31) // 32, dtype=torch.int32)
    backend.fill([(m, 0)], mask)
    return np.unpackbits(mask.numpy().view(np.uint8), bitorder="little")


def test_matcher_follows_appended_and_taken_back_tokens(backend: Any,
                                                        smollm2_tokenizer: Any) -> None:
    answer = smollm2_tokenizer.encode(json.dumps(ANSWER), add_special_tokens=False)
    manager = GrammarManager(backend)
    seq = _seq(smollm2_tokenizer)
    manager.validate(seq.request.params.structured_outputs)
    for k in range(len(answer)):
        masks = manager.masks([seq])
        assert masks is not None and masks.rows.tolist() == [0]
        assert _bits(masks, 0)[answer[k]], k  # the answer's next token is allowed
        assert (_bits(masks, 0) == _fresh_bits(backend, answer[:k])).all()
        assert not masks.stopped[0]
        seq.token_ids.append(answer[k])
    done = manager.masks([seq])
    assert done is not None and done.stopped[0] and set(np.nonzero(_bits(done, 0))[0]) == {2}
    # recompute after preemption keeps tokens; taking tokens back (3 of them) rebuilds
    del seq.token_ids[-3:]
    back = manager.masks([seq])
    assert back is not None and not back.stopped[0]
    assert (_bits(back, 0) == _fresh_bits(backend, answer[:-3])).all()


@pytest.mark.parametrize("overlap", [True, False])
def test_prepared_fill_covers_the_batch_and_siblings_are_filled_on_demand(
    backend: Any, smollm2_tokenizer: Any, overlap: bool,
) -> None:
    manager = GrammarManager(backend, overlap=overlap)
    a, free = _seq(smollm2_tokenizer), make_seq([5], SamplingParams())
    a.token_ids.extend(smollm2_tokenizer.encode('{"name": "', add_special_tokens=False))
    manager.prepare([a, free])
    assert (manager._prepared is not None) == overlap
    sibling = make_seq(list(a.token_ids[:3]), a.request.params, index=1, request=a.request)
    masks = manager.masks([free, a, sibling])
    assert masks is not None and masks.rows.tolist() == [1, 2]
    assert (_bits(masks, 0) == _fresh_bits(backend, a.token_ids[3:])).all()
    assert (_bits(masks, 1) == _fresh_bits(backend, [])).all()
    assert manager.masks([free]) is None


def test_idle_matchers_are_dropped_and_replayed_exactly(backend: Any,
                                                        smollm2_tokenizer: Any) -> None:
    manager = GrammarManager(backend)
    seq = _seq(smollm2_tokenizer)
    seq.token_ids.extend(smollm2_tokenizer.encode('{"name": "Al", "ta', add_special_tokens=False))
    expected = _fresh_bits(backend, seq.token_ids[3:])
    manager.masks([seq])
    other = _seq(smollm2_tokenizer)
    for _ in range(70):  # the first sequence waits (preempted) while another runs
        manager.masks([other])
    assert seq.seq_id not in manager._states
    again = manager.masks([seq])
    assert again is not None and (_bits(again, 0) == expected).all()


def test_a_token_the_grammar_rejects_ends_the_sequence_with_eos(backend: Any,
                                                                smollm2_tokenizer: Any) -> None:
    manager = GrammarManager(backend)
    seq = _seq(smollm2_tokenizer)
    seq.token_ids.extend(smollm2_tokenizer.encode("hello", add_special_tokens=False))
    masks = manager.masks([seq])
    assert masks is not None and masks.stopped[0]
    assert set(np.nonzero(_bits(masks, 0))[0]) == {2}


@pytest.mark.parametrize("n", [1, 64])
def test_masks_keep_batch_order_for_any_mix(backend: Any, smollm2_tokenizer: Any,
                                            n: int) -> None:
    manager = GrammarManager(backend)
    seqs = []
    for i in range(n):
        seqs.append(_seq(smollm2_tokenizer) if i % 2 == 0 else make_seq([4], SamplingParams()))
    manager.prepare(seqs[::-1])
    masks = manager.masks(seqs)
    assert masks is not None and masks.rows.tolist() == list(range(0, n, 2))
    for j in range(len(masks.rows)):
        assert (_bits(masks, j) == _fresh_bits(backend, [])).all()
