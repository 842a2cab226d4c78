"""Structured outputs through the engine: every answer parses and validates, with
continuous batching, n > 1, seeds, preemption (recompute and swap), prefix caching,
max_tokens cut-offs, stop strings and bad schemas.

Most tests use a tiny random Llama with SmolLM2's tokenizer (fast; its schemas bound
every string and number so a random model finishes too); the last one runs the real
SmolLM2 on extraction schemas.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from qworker import LLM, SamplingParams, StructuredOutputsParams
from qworker.engine.config import EngineConfig
from qworker.engine.engine import Engine
from qworker.errors import InvalidRequestError

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")

BOUNDED = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 999},
        "kind": {"enum": ["alpha", "beta", "gamma"]},
        "name": {"type": "string", "maxLength": 6},
        "score": {"type": "number", "minimum": 0, "maximum": 1},
        "flags": {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 3},
        "owner": {"type": "object",
                  "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 120},
                                 "ok": {"type": "boolean"}},
                  "required": ["age", "ok"], "additionalProperties": False},
    },
    "required": ["id", "kind", "name", "flags", "owner"],
    "additionalProperties": False,
}
PROMPT = "Give me JSON:"


def _json(schema: dict[str, Any] = BOUNDED, **kwargs: Any) -> SamplingParams:
    kwargs.setdefault("max_tokens", 80)
    return SamplingParams(structured_outputs=StructuredOutputsParams(json=schema), **kwargs)


def _valid(text: str, schema: dict[str, Any] = BOUNDED) -> None:
    jsonschema.validate(json.loads(text), schema)


def _llm(path: Path, **kwargs: Any) -> LLM:
    kwargs.setdefault("num_kv_blocks", 64)
    kwargs.setdefault("max_model_len", 256)
    return LLM(str(path), dtype="float32", device="cpu", **kwargs)


def _texts(outs: list[Any]) -> list[list[str]]:
    return [[c.text for c in o.outputs] for o in outs]


def test_constrained_and_free_rows_share_steps_and_every_answer_validates(
    tiny_chat_model_dir: Path,
) -> None:
    llm = _llm(tiny_chat_model_dir)
    free = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    (alone,) = llm.generate(PROMPT, free, use_tqdm=False)
    params = [_json(temperature=0), _json(temperature=1.0, seed=1),
              _json(temperature=0.8, seed=2, top_k=20, top_p=0.9, min_p=0.05),
              _json(temperature=1.2, seed=3, presence_penalty=1.0, frequency_penalty=0.5),
              free,
              SamplingParams(temperature=1.0, seed=4, max_tokens=20,
                             structured_outputs=StructuredOutputsParams(json_object=True)),
              SamplingParams(temperature=1.0, seed=5, max_tokens=20,
                             structured_outputs=StructuredOutputsParams(regex=r"[A-Z]{2}-[0-9]{3}")),
              SamplingParams(temperature=1.0, seed=6, max_tokens=20,
                             structured_outputs=StructuredOutputsParams(choice=["red", "green",
                                                                                "blue"]))]
    outs = llm.generate([PROMPT] * len(params), params, use_tqdm=False)
    for out in outs[:4]:
        comp = out.outputs[0]
        assert comp.finish_reason == "stop", comp.text
        _valid(comp.text)
    assert outs[4].outputs[0].token_ids == alone.outputs[0].token_ids  # neighbours change nothing
    json_obj, regex, choice = (o.outputs[0] for o in outs[5:])
    if json_obj.finish_reason == "stop":  # any JSON object may be long for a random model
        assert isinstance(json.loads(json_obj.text), dict)
    else:
        assert json_obj.finish_reason == "length" and json_obj.text.startswith("{")
    assert regex.finish_reason == "stop" and len(regex.text) == 6
    assert regex.text[:2].isupper() and regex.text[2] == "-" and regex.text[3:].isdigit()
    assert choice.finish_reason == "stop" and choice.text in ("red", "green", "blue")


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_keeps_each_matcher_on_the_tokens_kept(tiny_chat_model_dir: Path,
                                                          mode: str) -> None:
    params = [_json(temperature=0)] + [_json(temperature=1.0, seed=s) for s in range(5)]
    roomy = _llm(tiny_chat_model_dir).generate([PROMPT] * 6, params, use_tqdm=False)
    tight = _llm(tiny_chat_model_dir, num_kv_blocks=13, block_size=8, preemption_mode=mode,
                 swap_space=1 << 20, max_model_len=100)
    outs = tight.generate([PROMPT] * 6, params, use_tqdm=False)
    stats = tight.stats()
    assert stats["num_preemptions"] > 0
    if mode == "swap":
        assert stats["num_swap_outs"] > 0
    for out in outs:
        assert out.outputs[0].finish_reason == "stop"
        _valid(out.outputs[0].text)
    assert _texts(outs) == _texts(roomy)


def test_n_siblings_each_follow_their_grammar_and_seeds_reproduce(tiny_chat_model_dir: Path
                                                                  ) -> None:
    llm = _llm(tiny_chat_model_dir)
    params = _json(n=4, temperature=1.0, seed=42)
    (first,) = llm.generate(PROMPT, params, use_tqdm=False)
    assert len(first.outputs) == 4
    for comp in first.outputs:
        assert comp.finish_reason == "stop"
        _valid(comp.text)
    assert len({c.text for c in first.outputs}) > 1  # each sibling draws its own tokens
    (again,) = llm.generate(PROMPT, params, use_tqdm=False)
    crowd = llm.generate([PROMPT, "Other prompt", PROMPT],
                         [_json(temperature=1.0, seed=7), _json(temperature=0.5, seed=8), params],
                         use_tqdm=False)
    assert _texts([first]) == _texts([again]) == _texts([crowd[2]])


def test_overlapped_steps_give_the_same_constrained_and_free_answers(tiny_chat_model_dir: Path
                                                                    ) -> None:
    # A step holding a constrained row waits for the previous step's tokens (its grammar
    # needs them on the host); once the constrained answers are done the rest overlap.
    code = StructuredOutputsParams(regex=r"[A-Z]{2}-[0-9]{3}")
    params = [_json(temperature=0), _json(temperature=1.0, seed=9, frequency_penalty=0.5),
              SamplingParams(temperature=1.0, seed=5, max_tokens=10, structured_outputs=code),
              SamplingParams(temperature=0.9, seed=2, max_tokens=90, ignore_eos=True,
                             presence_penalty=1.0),
              SamplingParams(temperature=0, max_tokens=90, ignore_eos=True)]
    results = []
    for overlap in (False, True):
        llm = _llm(tiny_chat_model_dir)
        llm.engine.async_scheduling = overlap  # the CPU default is off; the logic is the same
        results.append(_texts(llm.generate([PROMPT] * 5, params, use_tqdm=False)))
        if overlap:
            assert llm.engine.num_overlapped_steps > 0
    assert results[0] == results[1]
    for texts in results[0][:2]:
        _valid(texts[0])


def test_prefix_cached_prompts_get_the_same_constrained_answer(tiny_chat_model_dir: Path) -> None:
    llm = _llm(tiny_chat_model_dir, block_size=8)
    prompt = "A longer instruction that fills a few KV blocks before the answer: "
    (first,) = llm.generate(prompt, _json(temperature=0), use_tqdm=False)
    (second,) = llm.generate(prompt, _json(temperature=0), use_tqdm=False)
    assert second.num_cached_tokens > 0
    assert second.outputs[0].text == first.outputs[0].text
    _valid(second.outputs[0].text)


def test_max_tokens_cuts_with_length_and_stop_strings_cut_the_text(tiny_chat_model_dir: Path
                                                                   ) -> None:
    llm = _llm(tiny_chat_model_dir)
    full, cut, stopped = llm.generate(
        [PROMPT] * 3,
        [_json(temperature=0), _json(temperature=0, max_tokens=6),
         _json(temperature=0, stop=['"kind"'])], use_tqdm=False)
    text = full.outputs[0].text
    assert cut.outputs[0].finish_reason == "length" and len(cut.outputs[0].token_ids) == 6
    assert text.startswith(cut.outputs[0].text) and cut.outputs[0].text != text
    with pytest.raises(json.JSONDecodeError):
        json.loads(cut.outputs[0].text)
    assert stopped.outputs[0].finish_reason == "stop" and stopped.outputs[0].stop_reason == '"kind"'
    assert stopped.outputs[0].text == text[: text.index('"kind"')]


def test_min_tokens_defers_the_grammar_end_only_while_the_grammar_allows(
    tiny_chat_model_dir: Path,
) -> None:
    llm = _llm(tiny_chat_model_dir)
    digits = StructuredOutputsParams(regex=r"[0-9]{1,8}")
    short, longer, fixed = llm.generate(
        ["x"] * 3,  # greedy ends "x" with one digit, then EOS
        [SamplingParams(temperature=0, max_tokens=20, structured_outputs=digits),
         SamplingParams(temperature=0, max_tokens=20, min_tokens=4, structured_outputs=digits),
         SamplingParams(temperature=0, max_tokens=20, min_tokens=10,
                        structured_outputs=StructuredOutputsParams(choice=["ok"]))],
        use_tqdm=False)
    for out in (short, longer):
        assert out.outputs[0].finish_reason == "stop" and out.outputs[0].text.isdigit()
    assert len(short.outputs[0].token_ids) == 2  # one digit, EOS
    assert len(longer.outputs[0].token_ids) >= 4 + 1  # EOS only once 4 tokens are out
    assert longer.outputs[0].text.startswith(short.outputs[0].text)
    # a complete grammar ends the answer even short of min_tokens
    assert fixed.outputs[0].text == "ok" and fixed.outputs[0].finish_reason == "stop"


def test_bad_schemas_are_refused_and_the_batch_goes_on(tiny_chat_model_dir: Path) -> None:
    engine = Engine(EngineConfig(model=str(tiny_chat_model_dir), dtype="float32", device="cpu",
                                 max_model_len=256, num_kv_blocks=64))
    engine.add_request("good-1", PROMPT, _json(temperature=0))
    for rid, schema, message in [
        ("bad-type", {"type": "nope"}, "Invalid type: nope"),
        ("bad-bounds", {"type": "integer", "minimum": 3, "maximum": 1},
         "minimum (3) is greater than maximum (1)"),
        ("bad-keyword", {"not": {}}, 'Unimplemented keys: ["not"]'),
    ]:
        with pytest.raises(InvalidRequestError, match=None) as info:
            engine.add_request(rid, PROMPT, _json(schema))
        assert message in str(info.value) and str(info.value).startswith("structured_outputs.json")
    engine.add_request("good-2", PROMPT, _json(temperature=1.0, seed=3))
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            done[out.request_id] = out
    assert sorted(done) == ["good-1", "good-2"]
    for out in done.values():
        _valid(out.outputs[0].text)


@pytest.mark.slow
def test_smollm2_extraction_answers_validate_greedy_sampled_and_preempted(
    smollm2_hf_dir: Path,
) -> None:
    from qworker.testing.extraction import PERSON, REVIEW, cap_strings

    # Nested object, enums, bounded arrays, required fields, integers and a number; strings
    # capped so the answers stay short (the real model is slow on a CPU).
    llm = LLM(str(smollm2_hf_dir), dtype="float32", device="cpu", max_model_len=192,
              num_kv_blocks=14, block_size=16)
    convs, params = [], []
    for case, temp, seed in ((PERSON, 0.0, None), (PERSON, 0.7, 11), (REVIEW, 0.8, 12)):
        convs.append([{"role": "user", "content": case.prompt}])
        params.append(SamplingParams(temperature=temp, seed=seed, max_tokens=90,
                                     structured_outputs=StructuredOutputsParams(
                                         json=cap_strings(case.schema, 16))))
    outs = llm.chat(convs, params, use_tqdm=False)
    assert llm.stats()["num_preemptions"] > 0
    for out, p in zip(outs, params, strict=True):
        comp = out.outputs[0]
        assert comp.finish_reason == "stop", comp.text
        assert p.structured_outputs is not None
        _valid(comp.text, p.structured_outputs.json)  # type: ignore[arg-type]
