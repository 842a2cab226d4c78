"""How deep a job's JSON may nest, and which field goes too deep (docs/formats.md, "Jobs").

Everything a job's JSON reaches is bounded by ``MAX_JOB_DEPTH`` levels before any code
recurses over it (validators, grammar compilation, fingerprints, record building): the
message itself (its top-level object is level 1) and JSON given as text inside a field
(``guided_json``, ``structured_outputs.json``), counted from that text's own top. Both
functions here are iterative: the value may be as deep as the parser allows.
"""

from __future__ import annotations

from typing import Any

#: Deepest nesting of a job (body, schemas, choices, content parts included).
MAX_JOB_DEPTH = 64


def nesting_depth(value: Any, stop_above: int | None = None) -> int:
    """Levels of nested arrays/objects in ``value`` (a scalar is 0).

    With ``stop_above``, returns as soon as a level above it is found.
    """
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, level = stack.pop()
        if not isinstance(item, dict | list):
            continue
        deepest = max(deepest, level)
        if stop_above is not None and deepest > stop_above:
            return deepest
        stack.extend((child, level + 1) for child in
                     (item.values() if isinstance(item, dict) else item)
                     if isinstance(child, dict | list))
    return deepest


def deep_field(value: Any, limit: int) -> str | None:
    """The field of a parsed message that is nested deeper than ``limit`` levels, or None.

    Iterative (the value may be 1,024 levels deep). The field is named as far as a user
    would look for it: ``body.<field>``, plus the index and key inside a list of objects
    (``body.messages[2].content``); a top-level field by its name.
    """
    stack: list[tuple[Any, int, tuple[str | int, ...]]] = [(value, 1, ())]
    while stack:
        item, level, path = stack.pop()
        if level > limit:
            return _field_name(path)
        keep = len(path) < 5
        if isinstance(item, dict):
            values: Any = item.values()
            keys: Any = item.keys()
        else:
            values, keys = item, range(len(item))
        # A long list of scalars (token ids) is skipped at C speed: no per-item Python.
        if len(item) > 16 and not _CONTAINERS & set(map(type, values)):
            continue
        for key, child in zip(keys, values, strict=True):
            if isinstance(child, dict | list):
                stack.append((child, level + 1, (*path, key) if keep else path))
    return None


_CONTAINERS = frozenset({dict, list})


def _field_name(path: tuple[str | int, ...]) -> str:
    if not path:
        return "the job"
    top, rest = str(path[0]), list(path[1:])
    if top != "body" or not rest:
        return top
    name = f"body.{rest.pop(0)}"
    if rest and isinstance(rest[0], int):
        name += f"[{rest.pop(0)}]"
        if rest and isinstance(rest[0], str):
            name += f".{rest.pop(0)}"
    return name
