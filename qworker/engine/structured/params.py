"""``StructuredOutputsParams``: what a request's output must match (vLLM's names).

Exactly one of ``json`` (a JSON schema, as a dict or as JSON text), ``json_object=True``
(any JSON object), ``regex`` or ``choice`` (one of a list of strings) is given. Checking
the fields needs no grammar library; compiling them is ``qworker.engine.structured``'s
grammar backend's job (``docs/structured_outputs.md``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from qworker.errors import InvalidRequestError

#: Kinds of constraint, in the order the fields are declared.
KINDS = ("json", "json_object", "regex", "choice")


@dataclass(slots=True)
class StructuredOutputsParams:
    """Constrain generation so the text always parses as / matches the given spec.

    ``json``: a JSON schema (dict, bool, or its JSON text); ``json_object``: True for
    any JSON object; ``regex``: a regular expression the whole output matches;
    ``choice``: the output is exactly one of these strings. Invalid values raise
    ``InvalidRequestError`` (a ``ValueError``) naming the field; call ``validate()``
    after mutating an instance.
    """

    json: dict[str, Any] | bool | str | None = None
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    _key: tuple[str, str] = field(init=False, repr=False, compare=False, default=("", ""))
    #: Where the spec came from, for error messages (a job sets e.g.
    #: ``"body.response_format.json_schema.schema"``); default ``structured_outputs.<kind>``.
    where: str = field(init=False, repr=False, compare=False, default="")

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check the fields; raise ``InvalidRequestError`` naming the first bad one."""
        given = [k for k in KINDS if getattr(self, k) is not None]
        if self.json_object is False:  # json_object=False means "not this one"
            given.remove("json_object")
        if len(given) != 1:
            raise InvalidRequestError(
                "structured_outputs needs exactly one of json, json_object, regex, choice; "
                f"got {given or 'none'}"
            )
        kind = given[0]
        if kind == "json":
            self._key = ("json", _schema_text(self.json))
        elif kind == "json_object":
            if self.json_object is not True:
                raise InvalidRequestError(
                    f"structured_outputs.json_object must be true, got {self.json_object!r}"
                )
            self._key = ("json_object", "")
        elif kind == "regex":
            if not isinstance(self.regex, str) or not self.regex:
                raise InvalidRequestError(
                    f"structured_outputs.regex must be a non-empty string, got {self.regex!r}"
                )
            self._key = ("regex", self.regex)
        else:
            choice = self.choice
            if (not isinstance(choice, list) or not choice
                    or not all(isinstance(c, str) and c for c in choice)):
                raise InvalidRequestError(
                    "structured_outputs.choice must be a non-empty list of non-empty strings, "
                    f"got {_short(choice)}"
                )
            self._key = ("choice", json.dumps(choice, ensure_ascii=False))

    @property
    def kind(self) -> str:
        """Which constraint this is: "json", "json_object", "regex" or "choice"."""
        return self._key[0]

    @property
    def label(self) -> str:
        """The field to name in an error about this spec."""
        return self.where or f"structured_outputs.{self.kind}"

    @property
    def key(self) -> tuple[str, str]:
        """A canonical, hashable form: equal keys compile to the same grammar."""
        return self._key


def _schema_text(schema: Any) -> str:
    """Canonical JSON text of a schema given as a dict, a bool or JSON text."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as exc:
            raise InvalidRequestError(
                f"structured_outputs.json is not valid JSON: {exc}"
            ) from None
    if not isinstance(schema, dict | bool):
        raise InvalidRequestError(
            f"structured_outputs.json must be a JSON schema object, got {_short(schema)}"
        )
    try:
        # key order kept: properties are generated in the order the schema declares them
        return json.dumps(schema, separators=(",", ":"), allow_nan=False,
                          ensure_ascii=False)
    except (TypeError, ValueError, RecursionError) as exc:
        raise InvalidRequestError(
            f"structured_outputs.json is not a JSON value: {exc}"
        ) from None


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
