"""How deep a job's JSON may nest, and which field goes too deep (docs/formats.md, "Jobs").

Everything a job's JSON reaches is bounded by ``MAX_JOB_DEPTH`` levels before any code
recurses over it (validators, grammar compilation, fingerprints, record building): the
message itself (its top-level object is level 1) and JSON given as text inside a field
(``guided_json``, ``structured_outputs.json``), counted from that text's own top. Both
functions here are iterative: the value may be as deep as the parser allows.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

#: Deepest nesting of a job (body, schemas, choices, content parts included).
MAX_JOB_DEPTH = 64


def nesting_depth(value: Any, stop_above: int | None = None) -> int:
    """Levels of nested arrays/objects in ``value`` (a scalar is 0).

    With ``stop_above``, returns as soon as a level above it is found.
    """
    if not isinstance(value, dict | list):
        return 0
    deepest, stack = 1, [_containers_in(value)]
    while stack:
        for child in stack[-1]:
            stack.append(_containers_in(child))
            deepest = max(deepest, len(stack))
            if stop_above is not None and deepest > stop_above:
                return deepest
            break
        else:
            stack.pop()
    return deepest


def deep_field(value: Any, limit: int) -> str | None:
    """The field of a parsed message that is nested deeper than ``limit`` levels, or None.

    Iterative (the value may be 1,024 levels deep), in memory that grows with the depth,
    not the width (a list of 100,000 empty lists holds one iterator, not 100,000 entries).
    The field is named as far as a user would look for it: ``body.<field>``, plus the
    index and key inside a list of objects (``body.messages[2].content``); a top-level
    field by its name.
    """
    if not isinstance(value, dict | list):
        return None
    if limit < 1:
        return _field_name(())
    stack: list[tuple[Iterator[tuple[str | int, Any]], tuple[str | int, ...]]] = [
        (_keyed_containers_in(value), ())]
    while stack:
        children, path = stack[-1]
        for key, child in children:
            child_path = (*path, key) if len(path) < 5 else path
            if len(stack) + 1 > limit:
                return _field_name(child_path)
            stack.append((_keyed_containers_in(child), child_path))
            break
        else:
            stack.pop()
    return None


def _keyed_containers_in(item: dict[str, Any] | list[Any]) -> Iterator[tuple[str | int, Any]]:
    """``(key or index, child)`` of the arrays and objects directly in ``item``."""
    values: Any = item.values() if isinstance(item, dict) else item
    # A long list of scalars (token ids) is skipped at C speed: no per-item Python.
    if len(item) > 16 and not _CONTAINERS & set(map(type, values)):
        return iter(())
    keys: Any = item.keys() if isinstance(item, dict) else range(len(item))
    return ((k, v) for k, v in zip(keys, values, strict=True) if isinstance(v, dict | list))


def _containers_in(item: dict[str, Any] | list[Any]) -> Iterator[Any]:
    """The arrays and objects directly in ``item``."""
    return (child for _, child in _keyed_containers_in(item))


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
