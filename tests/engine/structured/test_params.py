"""StructuredOutputsParams: exactly one constraint, each checked, with canonical keys."""

from __future__ import annotations

import pytest

from qworker import SamplingParams, StructuredOutputsParams
from qworker.errors import InvalidRequestError


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({}, "structured_outputs needs exactly one of json, json_object, regex, choice; got none"),
        ({"json": {"type": "object"}, "regex": "a+"},
         "structured_outputs needs exactly one of json, json_object, regex, choice; "
         "got ['json', 'regex']"),
        ({"json": "{not json"}, "structured_outputs.json is not valid JSON"),
        ({"json": [1, 2]}, "structured_outputs.json must be a JSON schema object, got [1, 2]"),
        ({"json": 5}, "structured_outputs.json must be a JSON schema object, got 5"),
        ({"json": {"x": float("nan")}}, "structured_outputs.json is not a JSON value"),
        ({"json_object": "yes"}, "structured_outputs.json_object must be true, got 'yes'"),
        ({"regex": 7}, "structured_outputs.regex must be a non-empty string, got 7"),
        ({"choice": []}, "structured_outputs.choice must be a non-empty list of non-empty"),
        ({"choice": ["a", ""]},
         "structured_outputs.choice must be a non-empty list of non-empty strings"),
        ({"choice": "a"}, "structured_outputs.choice must be a non-empty list"),
    ],
)
def test_invalid_specs_raise_naming_the_field(kwargs: dict, message: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        StructuredOutputsParams(**kwargs)
    assert str(info.value).startswith(message)
    assert isinstance(info.value, ValueError)


def test_keys_are_canonical_and_keep_property_order() -> None:
    a = StructuredOutputsParams(json={"type": "object", "properties": {"b": {}, "a": {}}})
    b = StructuredOutputsParams(json='{"type": "object",  "properties": {"b": {}, "a": {}}}')
    c = StructuredOutputsParams(json={"properties": {"a": {}, "b": {}}, "type": "object"})
    assert a.key == b.key and a.kind == "json"
    assert a.key != c.key  # properties are generated in declared order: a different grammar
    assert StructuredOutputsParams(json_object=True).key == ("json_object", "")
    assert StructuredOutputsParams(choice=["x", "y"]).key == ("choice", '["x", "y"]')
    assert StructuredOutputsParams(regex=r"\d+").kind == "regex"


def test_sampling_params_check_penalties_min_tokens_and_structured_outputs() -> None:
    for kwargs, message in [
        ({"presence_penalty": 2.5}, "presence_penalty must be a number in [-2, 2], got 2.5"),
        ({"frequency_penalty": "x"}, "frequency_penalty must be a number in [-2, 2], got 'x'"),
        ({"frequency_penalty": float("inf")}, "frequency_penalty must be a number in [-2, 2]"),
        ({"min_tokens": -1}, "min_tokens must be an integer >= 0, got -1"),
        ({"min_tokens": True}, "min_tokens must be an integer >= 0, got True"),
        ({"min_tokens": 20, "max_tokens": 10}, "min_tokens must be <= max_tokens (10), got 20"),
        ({"structured_outputs": {"json": {}}},
         "structured_outputs must be a StructuredOutputsParams or None, got dict"),
    ]:
        with pytest.raises(InvalidRequestError, match=None) as info:
            SamplingParams(**kwargs)
        assert str(info.value).startswith(message), kwargs
    p = SamplingParams(temperature=0, presence_penalty=-2, frequency_penalty=2, min_tokens=3,
                       structured_outputs=StructuredOutputsParams(regex="a+"))
    assert p.row.penalized and p.row.structured and not p.row.plain and p.row.min_tokens == 3
    assert SamplingParams(temperature=0).row.plain
    assert not SamplingParams(temperature=0, min_tokens=1).row.plain
